"""Held-out agreement of a chain of warm-started draft-head runs against the training tokens they saw.

Each run (a ``train-drafter --out`` folder) continues from the one before it (``--init-from``), so
its validation log is appended at an offset of the tokens the earlier runs trained on. The runs
must score the same held-out records (same ``val_tokens``), or the curve would mix two yardsticks.

    python -m adaptivespec.analysis.head_lineage runs/broad-head3 runs/broad-head4 runs/broad-head5 \\
        --out adaptivespec/heads/smollm2-135m-instruct-eagle3/lineage.png

Prints one row per validation (run, step, cumulative tokens, top-1 agreement at draft step 0,
mean over draft steps, per kind at step 0) and writes a two-panel PNG: agreement vs tokens, and
per-kind agreement at step 0 vs tokens, with a vertical line where each run began.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class LineageError(ValueError):
    """Bad input: printed as one line, exit status 2."""


def validations(run: Path) -> list[dict]:
    from adaptivespec.training.card import log_rows

    if not (run / "training" / "log.jsonl").is_file():
        raise LineageError(f"{str(run)!r}: no training/log.jsonl; expected a train-drafter --out folder")
    return [r for r in log_rows(run) if "val_acc" in r]


def lineage(runs: list[Path]) -> list[dict]:
    """One point per validation of every run, ``tokens`` counted from the first run's start."""
    points, offset, yardstick = [], 0, None
    for run in runs:
        vals = validations(run)
        if not vals:
            raise LineageError(f"{str(run)!r}: its log has no validation; expected at least one")
        for v in vals:
            if yardstick is None:
                yardstick = v["val_tokens"]
            if v["val_tokens"] != yardstick:
                raise LineageError(f"{str(run)!r}: validated on {v['val_tokens']} tokens; expected "
                                 f"{yardstick} like the first run (the same held-out records)")
            acc = v["val_acc"]
            points.append({"run": str(run), "step": v["step"], "tokens": offset + v["tokens"], "acc0": acc[0],
                           "acc_mean": sum(acc) / len(acc),
                           "by_kind": {k: a[0] for k, a in (v.get("val_acc_by_kind") or {}).items()}})
        offset += vals[-1]["tokens"]
    return points


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["tokens"] / 1e6 for p in points]
    a.plot(x, [p["acc0"] for p in points], marker=".", label="draft step 0")
    a.plot(x, [p["acc_mean"] for p in points], marker=".", label="mean over draft steps")
    kinds = sorted({k for p in points for k in p["by_kind"]})
    for k in kinds:
        xs = [p["tokens"] / 1e6 for p in points if k in p["by_kind"]]
        b.plot(xs, [p["by_kind"][k] for p in points if k in p["by_kind"]], label=k)
    for ax in (a, b):
        for p in points:
            if p["step"] == 0:
                ax.axvline(p["tokens"] / 1e6, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("training tokens since the first run began (M)")
        ax.grid(alpha=0.3)
    a.set_ylabel("held-out top-1 agreement")
    a.set_title("agreement (dotted: a warm-started run begins)")
    b.set_title("draft step 0, per kind")
    a.legend()
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="train-drafter --out folders, oldest first")
    ap.add_argument("--out", type=Path, help="PNG to write")
    args = ap.parse_args(argv)
    try:
        points = lineage(args.runs)
    except LineageError as e:
        print(f"head_lineage: {e}", file=sys.stderr)
        return 2
    kinds = sorted({k for p in points for k in p["by_kind"]})
    print("| run | step | tokens (M) | step 0 | mean | " + " | ".join(kinds) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(kinds))
    for p in points:
        cells = " | ".join(f"{p['by_kind'][k]:.3f}" if k in p["by_kind"] else "–" for k in kinds)
        print(f"| {Path(p['run']).name} | {p['step']} | {p['tokens'] / 1e6:.2f} | {p['acc0']:.3f} | {p['acc_mean']:.3f} | {cells} |")
    if args.out:
        plot(points, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
