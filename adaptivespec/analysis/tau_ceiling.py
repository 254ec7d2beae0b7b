"""How far can τ go with this draft head, whatever the tree? Teacher-forced accepted lengths per category.

Reads the full teacher-forced trees that ``adaptivespec.analysis.shape_oracle --out X.json`` saves beside its
summary (``X.pt``: at every position of each prompt's greedy output, the depth-7 beam tree of every
branching, each node's depth, parent, draft score and whether its token continues the output) and
replays static shapes on them: at each step the shape's tree (the ``ndt - 1`` best-scored nodes of
depth <= ``nsteps``, as the drafter keeps them) accepts the longest path that matches the output,
exactly what strict verification accepts; the next step starts after the accepted tokens and the
bonus token. τ = new tokens / target forwards (prefill included), as ``adaptivespec bench`` counts
it. ``ceiling`` takes, at every step, the longest match of any full tree (up to 393 nodes, depth 7):
no tree shape or per-step policy drafted from this head accepts more.

    python -m adaptivespec.analysis.shape_oracle --profile adaptivespec/profiles/cpu-smollm2-135m-bf16.json \\
        --dataset specbench --per-category 5 --max-new-tokens 128 --out runs/oracle/specbench.json
    python -m adaptivespec.analysis.tau_ceiling runs/oracle/specbench.pt --shape 3,4,8 --shape 7,8,64 --plot tau-ceiling.png

Prints a markdown table (one row per category, then the mean over categories) and ``--json`` writes
the same figures. Files from an oracle run without categories count as one category named after
the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from adaptivespec.training.counterfactual import kept_nodes

DEPTH = 7


class CeilingError(ValueError):
    """Bad input: printed as one line, exit status 2."""


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        n, k, ndt = (int(x) for x in text.split(","))
    except ValueError:
        raise CeilingError(f"--shape: expected NSTEPS,TOPK,NDT (e.g. 3,4,8), got {text!r}") from None
    if not (1 <= n <= DEPTH and k >= 1 and ndt >= 2):
        raise CeilingError(f"--shape: {text!r} out of range; expected 1 <= NSTEPS <= {DEPTH}, TOPK >= 1, NDT >= 2")
    return n, k, ndt


def _oracle():
    """:mod:`adaptivespec.analysis.shape_oracle`, whose schedule walk (``simulate``) this replays."""
    from adaptivespec.analysis import shape_oracle

    return shape_oracle


def accepted(rec: dict, nsteps: int, ndt: int | None) -> int:
    """Accepted draft tokens of the shape's tree cut from one full tree record (``ndt`` None: every node
    of depth <= ``nsteps``)."""
    depth, parents = rec["depth"].long(), rec["parents"].long()
    ok = kept_nodes(depth, rec["logp"], nsteps, ndt) & rec["match"]
    for d in range(1, nsteps + 1):  # a node counts only if its whole path is kept and matches
        lvl = depth == d
        ok[lvl] &= ok[parents[lvl]]
    return int(depth[ok].max())


def steps(acc: list[int]) -> list[int]:
    """The accepted lengths of the steps a static decode takes when the step at position i accepts
    ``acc[i]`` (``shape_oracle.simulate``'s walk)."""
    seen: list[int] = []
    _oracle().simulate(lambda i: 0, [{0: a} for a in acc], {0: 0.0}, seen.append)
    return seen


def tau(acc: list[int]) -> tuple[int, int]:
    """(new tokens, target forwards) of a decode whose step at position i accepts ``acc[i]``."""
    return len(acc) + 1, len(steps(acc)) + 1


def load(paths: list[Path]) -> list[tuple[str, dict[int, list]]]:
    """(category, {branching: [tree record per position]}) per prompt of every file."""
    prompts = []
    for path in paths:
        if not path.is_file():
            raise CeilingError(f"{str(path)!r}: no such file; expected the .pt that shape_oracle.py --out writes")
        blob = torch.load(path, weights_only=False)
        trees = blob.get("trees") or {}
        if not trees:
            raise CeilingError(f"{str(path)!r}: holds no trees; expected a shape_oracle.py --out file of this version")
        n = len(next(iter(trees.values())))
        cats = blob.get("categories") or [path.stem] * n
        for p in range(n):
            prompts.append((cats[p], {k: v[p] for k, v in trees.items()}))
    return prompts


def table(prompts, shapes: list[tuple[int, int, int]]) -> dict[str, dict]:
    """Per category: prompts, tokens, τ of each shape, the ceiling, and the share of steps of the first
    shape that accept >= 1, 2, 3 draft tokens."""
    cols = [f"({n}, {k}, {ndt})" for n, k, ndt in shapes] + ["ceiling"]
    sums: dict[str, dict] = {}
    for cat, trees in prompts:
        for n, k, _ in shapes:
            if k not in trees:
                raise CeilingError(f"--shape: no trees of branching {k} in the oracle files; it drafts {sorted(trees)}")
        s = sums.setdefault(cat, {"prompts": 0, "tokens": 0, **{c: [0, 0] for c in cols}, "ge": [0, 0, 0, 0]})
        s["prompts"] += 1
        first = None
        for c, (n, k, ndt) in zip(cols, shapes):
            acc = [accepted(r, n, ndt) for r in trees[k]]
            first = acc if first is None else first
            t, f = tau(acc)
            s[c][0] += t
            s[c][1] += f
        best = [max(accepted(r, DEPTH, None) for r in recs) for recs in zip(*trees.values())]
        t, f = tau(best)
        s["ceiling"][0] += t
        s["ceiling"][1] += f
        s["tokens"] += t
        for a in steps(first):  # step statistics of the first shape, over the steps its static decode takes
            s["ge"][0] += 1
            for g in (1, 2, 3):
                s["ge"][g] += a >= g
    out = {}
    for cat, s in sums.items():
        taken = max(s["ge"][0], 1)
        out[cat] = {"prompts": s["prompts"], "tokens": s["tokens"], "tau": {c: s[c][0] / s[c][1] for c in cols},
                    "first_shape_accepts_ge": [s["ge"][g] / taken for g in (1, 2, 3)]}
    return out


def markdown(rows: dict[str, dict]) -> str:
    cols = list(next(iter(rows.values()))["tau"])
    head = "| category | prompts | tokens | " + " | ".join(f"τ {c}" for c in cols) + f" | ≥1 / ≥2 / ≥3 at {cols[0]} |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(cols) + "---|"]
    for cat, r in rows.items():
        ge = " / ".join(f"{x:.2f}" for x in r["first_shape_accepts_ge"])
        lines.append(f"| {cat} | {r['prompts']} | {r['tokens']} | " + " | ".join(f"{r['tau'][c]:.2f}" for c in cols) + f" | {ge} |")
    mean = {c: sum(r["tau"][c] for r in rows.values()) / len(rows) for c in cols}
    lines.append(f"| mean of {len(rows)} | | | " + " | ".join(f"**{mean[c]:.2f}**" for c in cols) + " | |")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: Path, targets: tuple[float, float] = (2.5, 3.0)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(rows)
    cols = list(rows[cats[0]]["tau"])
    width = 0.8 / len(cols)
    fig, ax = plt.subplots(figsize=(10, 4))
    for j, c in enumerate(cols):
        ax.bar([i + (j - (len(cols) - 1) / 2) * width for i in range(len(cats))], [rows[k]["tau"][c] for k in cats],
               width, label=c if c == "ceiling" else f"shape {c}")
    for y, style in zip(targets, (":", "--")):
        ax.axhline(y, color="k", linestyle=style, linewidth=1, label=f"τ {y}")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("τ (teacher-forced, tokens per target forward)")
    ax.set_title("How far τ goes with this draft head, per category")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pt", nargs="+", type=Path, help="shape_oracle.py --out files (.pt)")
    ap.add_argument("--shape", action="append", default=[], metavar="NSTEPS,TOPK,NDT",
                    help="a static shape to replay (repeatable; default 3,4,8); its topk must be one the oracle drafted")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--plot", type=Path, help="a bar chart per category (PNG)")
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shape or ["3,4,8"]]
        rows = table(load(args.pt), shapes)
    except CeilingError as exc:
        print(f"tau_ceiling.py: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
