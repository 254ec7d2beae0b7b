"""PNG plots of a ``bench`` / ``sweep`` results document (matplotlib, Agg backend).

* :func:`speedup_retention`: speedup against accuracy retention, one point per contender;
* :func:`accept_lengths`: distribution of drafted tokens accepted per step, per speculative config;
* :func:`pareto`: a sweep's throughput against retention, the Pareto frontier highlighted and each
  point labelled with its parameter value(s);
* :func:`category_speedups`: speedup per prompt category (datasets with categories);
* :func:`concurrency`: a load run's (``bench --concurrency``) total tokens/s and inter-token
  latency against the requests in flight, one line per contender.

Each returns its :class:`~matplotlib.figure.Figure` (written to ``path`` as a PNG when one is given).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig: Figure, path: str | Path | None) -> Figure:
    """Lay ``fig`` out and, given a ``path``, write it there as a PNG; pyplot forgets it either way."""
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _title(results: dict[str, Any]) -> str:
    m = results["meta"]
    return f"{m['dataset']}: {m['prompts']} prompts, max {m['max_new_tokens']} new tokens"


def _baseline(results: dict[str, Any]) -> tuple[str, float | None]:
    """Speedups are measured against the AR config when there is one, else the first config."""
    rows = results["configs"]
    name = results.get("ar") or rows[0]["name"]
    tps = next(r["tokens_per_second"] for r in rows if r["name"] == name)
    return name, tps


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (higher-or-equal in both, better in one),
    ordered by increasing x. NaN points are never on the front."""
    ok = [i for i, (x, y) in enumerate(points) if not (math.isnan(x) or math.isnan(y))]
    front = []
    for i in ok:
        xi, yi = points[i]
        dominated = any(
            points[j][0] >= xi and points[j][1] >= yi and (points[j][0] > xi or points[j][1] > yi) for j in ok if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def speedup_retention(results: dict[str, Any], path: str | Path | None = None) -> Figure:
    """Speedup (vs AR, else vs the first config) against retention; bars if retention is unknown."""
    plt = _pyplot()
    rows = results["configs"]
    base, base_tps = _baseline(results)
    speedup = [r["tokens_per_second"] / base_tps if r["tokens_per_second"] and base_tps else float("nan") for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if any(r["retention"] is not None for r in rows):
        for r, s in zip(rows, speedup):
            x = 100 * r["retention"] if r["retention"] is not None else float("nan")
            marker = "s" if r["kind"] == "peer" else ("o" if r["lossless"] else "D")
            color = "tab:gray" if r["kind"] == "peer" else ("tab:blue" if r["lossless"] else "tab:red")
            ax.scatter([x], [s], marker=marker, color=color, s=60, zorder=3)
            ax.annotate(r["name"], (x, s), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.axvline(100, color="0.7", lw=0.8, ls="--")
        ax.set_xlabel(f"accuracy retention vs {results['reference']} (%)")
        handles = [plt.Line2D([], [], marker=m, color=c, ls="", label=lab) for m, c, lab in
                   (("o", "tab:blue", "lossless"), ("D", "tab:red", "lossy"), ("s", "tab:gray", "peer"))]
        ax.legend(handles=handles, fontsize=8, loc="best")
    else:
        x = range(len(rows))
        ax.bar(x, [0 if math.isnan(s) else s for s in speedup],
               color=["tab:gray" if r["kind"] == "peer" else ("tab:blue" if r["lossless"] else "tab:red") for r in rows])
        ax.set_xticks(list(x), [r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_xlabel("retention unavailable (ungraded dataset, or the reference scored 0)")
    ax.axhline(1.0, color="0.7", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup vs {base} (tokens/s ratio)")
    ax.set_title(_title(results), fontsize=10)
    ax.grid(alpha=0.3)
    return _finish(plt, fig, path)


def accept_lengths(results: dict[str, Any], path: str | Path | None = None) -> Figure:
    """Fraction of steps accepting k drafted tokens, k = 0, 1, ..., grouped bars per config."""
    plt = _pyplot()
    rows = [r for r in results["configs"] if r["accepted_per_step"]["steps"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if rows:
        top = max(int(k) for r in rows for k in r["accepted_per_step"]["histogram"])
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            h, n = r["accepted_per_step"]["histogram"], r["accepted_per_step"]["steps"]
            ks = list(range(top + 1))
            ax.bar([k - 0.4 + (i + 0.5) * width for k in ks], [h.get(str(k), 0) / n for k in ks], width,
                   label=f"{r['name']} (mean {r['accepted_per_step']['mean']:.2f}, {n} steps)")
        ax.set_xticks(list(range(top + 1)))
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative steps in this run", ha="center", va="center", transform=ax.transAxes)
    others = [r["name"] for r in results["configs"] if not r["accepted_per_step"]["steps"]]
    ax.set_xlabel("drafted tokens accepted per step" + (f"  (no steps: {', '.join(others)})" if others else ""), fontsize=9)
    ax.set_ylabel("fraction of steps")
    ax.set_title(_title(results), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _finish(plt, fig, path)


def _label(sweep: dict[str, Any]) -> str:
    return ", ".join(f"{v:g}" if isinstance(v, (int, float)) else str(v) for v in sweep.values())


def pareto(results: dict[str, Any], path: str | Path | None = None) -> Figure:
    """Tokens/s against retention for a sweep's points and its reference (at 100%), the Pareto
    frontier (higher is better on both axes) highlighted, each point labelled with its value(s).

    Without retention (ungraded dataset), tokens/s is drawn against the swept value instead."""
    plt = _pyplot()
    rows = results["configs"]
    points = [r for r in rows if "sweep" in r]
    ref = next((r for r in rows if r["name"] == results["reference"]), None)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    keys = ", ".join(results["sweep"]["params"])
    if any(r["retention"] is not None for r in points):
        xy = [(100 * r["retention"] if r["retention"] is not None else float("nan"), r["tokens_per_second"] or float("nan"))
              for r in points]
        ref_xy = [(100.0, ref["tokens_per_second"])] if ref is not None and ref["tokens_per_second"] else []
        front = pareto_front(xy + ref_xy)  # the lossless reference is the frontier's 100% end
        both = xy + ref_xy
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], color="tab:blue", s=40, zorder=3, label=f"{keys} points")
        ax.plot([both[i][0] for i in front], [both[i][1] for i in front], color="tab:red", lw=1.5, marker="o",
                ms=9, mfc="none", zorder=4, label="Pareto frontier")
        for r, (x, y) in zip(points, xy):
            ax.annotate(_label(r["sweep"]), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if ref_xy:
            ax.scatter(*zip(*ref_xy), marker="*", s=160, color="black", zorder=5, label=f"reference {ref['name']}")
        ax.set_xlabel(f"accuracy retention vs {results['reference']} (%)")
    else:
        xs = [float(next(iter(r["sweep"].values()))) for r in points]
        ys = [r["tokens_per_second"] or float("nan") for r in points]
        ax.plot(xs, ys, marker="o", color="tab:blue", label=f"{keys} points")
        for r, x, y in zip(points, xs, ys):
            ax.annotate(_label(r["sweep"]), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if ref is not None and ref["tokens_per_second"]:
            ax.axhline(ref["tokens_per_second"], color="black", ls="--", lw=1, label=f"reference {ref['name']}")
        ax.set_xlabel(f"{keys} (retention unavailable: ungraded dataset or the reference scored 0)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"sweep of {keys} — {_title(results)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _finish(plt, fig, path)


def category_speedups(results: dict[str, Any], path: str | Path | None = None) -> Figure:
    """Speedup (vs AR, else vs the first config) per prompt category: grouped bars, one group per
    category, one bar per contender; a contender missing from a category has no bar there."""
    plt = _pyplot()
    cats = results["categories"]
    base = results.get("ar") or results["configs"][0]["name"]
    names = [r["name"] for r in results["configs"] if r["name"] != base]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.3 * len(cats) + 3), 5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, c in enumerate(cats.values()):
            rows = {r["name"]: r for r in c["configs"]}
            r, b = rows.get(name), rows.get(base)
            if r and b and r["tokens_per_second"] and b["tokens_per_second"]:
                xs.append(j - 0.4 + (i + 0.5) * width)
                ys.append(r["tokens_per_second"] / b["tokens_per_second"])
        row = next(r for r in results["configs"] if r["name"] == name)
        hatch = "//" if row["kind"] == "peer" else ("" if row["lossless"] else "..")
        ax.bar(xs, ys, width, label=name, hatch=hatch)
    ax.set_xticks(list(range(len(cats))), [f"{c}\n({v['prompts']})" for c, v in cats.items()], fontsize=8)
    ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup vs {base} (tokens/s ratio)")
    ax.set_xlabel("category (prompts)")
    ax.set_title(f"by category — {_title(results)}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return _finish(plt, fig, path)


def concurrency(results: dict[str, Any], path: str | Path | None = None) -> Figure:
    """A load run (``load.json``): total tokens/s (left) and inter-token latency (right: p50 solid,
    p90 dashed) against the requests in flight, one colour per contender, the levels on a log axis."""
    plt = _pyplot()
    meta = results["meta"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for i, name in enumerate(results["contenders"]):
        rows = sorted((r for r in results["levels"] if r["contender"] == name), key=lambda r: r["concurrency"])
        if not rows:
            continue
        color = f"C{i % 10}"
        xs = [r["concurrency"] for r in rows]
        left.plot(xs, [r["total_tokens_per_second"] for r in rows], marker="o", color=color, label=name)
        right.plot(xs, [r["itl_p50_ms"] if r["itl_p50_ms"] is not None else float("nan") for r in rows],
                   marker="o", color=color, label=f"{name} p50")
        right.plot(xs, [r["itl_p90_ms"] if r["itl_p90_ms"] is not None else float("nan") for r in rows],
                   ls="--", color=color, alpha=0.6, label=f"{name} p90")
    levels = meta["levels"]
    for ax, label in ((left, "total tokens/s (all requests)"), (right, "inter-token latency (ms per token)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("requests in flight (concurrency)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=7, ncol=2)
    cpu = meta.get("machine", {}).get("cpu", "")
    fig.suptitle(f"{meta['dataset']}: {meta['prompts']} prompts, max {meta['max_new_tokens']} new tokens, greedy"
                 + (f" — {cpu}" if cpu else ""), fontsize=10)
    return _finish(plt, fig, path)
