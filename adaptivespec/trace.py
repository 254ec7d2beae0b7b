"""Per-step traces: JSONL records written by ``generate --trace`` and their plot."""

from __future__ import annotations

import json
from pathlib import Path

from adaptivespec.errors import AdaptiveSpecError


def read_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise AdaptiveSpecError(f"plot-trace: {path}: file not found")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise AdaptiveSpecError(f"plot-trace: {path}:{n}: invalid JSON ({exc.msg})") from None
    if not rows:
        raise AdaptiveSpecError(f"plot-trace: {path}: no step records (was it written by generate --trace with a drafter?)")
    return rows


def plot_trace(path: str | Path, output: str | Path) -> None:
    """Draw the tree shape (nsteps, topk, ndt) and the accepted length over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_trace(path) if r.get("shape")]
    if not rows:
        raise AdaptiveSpecError(f"plot-trace: {path}: no speculative steps (autoregressive trace?)")
    x = list(range(len(rows)))
    decisions = [r for r in rows if "budget" in (r.get("policy_state") or {})]  # in-step tree decisions
    reliability = next((r["policy_state"]["reliability"] for r in reversed(rows) if (r.get("policy_state") or {}).get("reliability")), None)
    if decisions:
        fig, (ax1, ax2, ax4, ax5) = _decision_axes(plt, reliability is not None)
        _plot_decisions(ax4, ax5, x, rows, reliability)
    else:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for i, label in enumerate(("nsteps (depth)", "topk (branching)", "ndt (verified)")):
        ax1.step(x, [r["shape"][i] for r in rows], where="mid", label=label)
    ax1.set_ylabel("tree shape")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.bar(x, [r["accepted"] for r in rows], color="tab:green", label="accepted drafted tokens")
    promoted = [r.get("promoted", 0) for r in rows]
    if any(promoted):
        ax2.bar(x, promoted, color="tab:red", label="of which promoted")
    dcs = [r.get("policy_state", {}).get("dcs") for r in rows]
    if any(v is not None for v in dcs):
        ax3 = ax2.twinx()
        ax3.plot(x, [v if v is not None else float("nan") for v in dcs], color="tab:purple", lw=1, label="DCS")
        ax3.set_ylim(0, 1.05)
        ax3.set_ylabel("DCS")
    ax2.set_xlabel("decode step")
    ax2.set_ylabel("accepted")
    ax2.legend(loc="upper left", fontsize=8)
    ids = {r.get("id") for r in rows}
    fig.suptitle(f"{Path(path).name}: {len(rows)} steps" + (f", {len(ids)} prompts" if len(ids) > 1 else ""))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def _decision_axes(plt, with_reliability: bool):
    """Shape, accepted and in-step decisions share the step axis; the reliability diagram sits apart."""
    fig = plt.figure(figsize=(11, 9))
    grid = fig.add_gridspec(3, 4)
    ax1 = fig.add_subplot(grid[0, :])
    ax2 = fig.add_subplot(grid[1, :], sharex=ax1)
    ax4 = fig.add_subplot(grid[2, :3] if with_reliability else grid[2, :], sharex=ax1)
    ax5 = fig.add_subplot(grid[2, 3]) if with_reliability else None
    return fig, (ax1, ax2, ax4, ax5)


def _plot_decisions(ax, ax_rel, x, rows, reliability) -> None:
    """Per step: draft levels expanded, verify budget (tokens verified) and breaker trips; the
    calibration map's last reliability table (predicted vs observed acceptance)."""
    nan = float("nan")
    st = [r.get("policy_state") or {} for r in rows]
    ax.step(x, [s.get("levels", nan) for s in st], where="mid", color="tab:blue", label="tree depth (levels drafted)")
    ax.step(x, [s.get("budget", nan) for s in st], where="mid", color="tab:orange", label="verify budget (ndt)")
    ax.plot(x, [s.get("expected_tokens", nan) for s in st], color="tab:green", lw=0.8, label="expected tokens")
    if any(s.get("source_nodes") for s in st):  # fused trees: verified nodes the candidate sources put forward
        ax.step(x, [s.get("source_nodes", nan) for s in st], where="mid", color="tab:purple", lw=0.8, label="source nodes verified")
    trips = [i for i, s in zip(x, st) if s.get("breaker_tripped")]
    if trips:
        ax.scatter(trips, [0] * len(trips), marker="x", color="tab:red", label="breaker")
    stops = [i for i, s in zip(x, st) if s.get("stop") == "cost"]
    ax.set_ylabel("decisions")
    ax.set_xlabel("decode step" + (f"  ({len(stops)} of {len(x)} trees stopped early by the cost rule)" if stops else ""))
    ax.legend(loc="upper right", fontsize=7)
    if ax_rel is not None:
        pts = [(p, o, n) for p, o, n in zip(reliability["predicted"], reliability["observed"], reliability["count"]) if n]
        ax_rel.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls="--")
        ax_rel.scatter([p for p, _, _ in pts], [o for _, o, _ in pts], s=[10 + 40 * n / max(c for *_, c in pts) for *_, n in pts])
        ece = reliability.get("ece")
        ax_rel.set_title(f"reliability ({reliability['nodes']} nodes" + (f", ECE {ece:.3f})" if ece is not None else ")"), fontsize=8)
        ax_rel.set_xlabel("predicted", fontsize=8)
        ax_rel.set_ylabel("observed", fontsize=8)
        ax_rel.set_xlim(0, 1), ax_rel.set_ylim(0, 1)
