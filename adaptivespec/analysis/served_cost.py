"""Fit the cost model of a *served* decode step from ``adaptivespec serve --trace`` files.

Each trace line holds a step's shape, batch size and times (``ms``: from the shape's choice to the
accept lengths, i.e. the draft and the verify; ``gap_ms``: the rest of the previous step, when the
batch stayed the same); a whole step is one line's ``ms`` plus the next line's ``gap_ms``. The fit is the same linear model the
torch runtime's profiles use (:class:`~adaptivespec.costmodel.CostModel`), with a batch's work
summed over its requests: ``verified = bs * ndt`` rows, ``levels = nsteps`` draft forwards,
``nodes = bs * nsteps * topk`` drafted nodes::

    python -m adaptivespec.analysis.served_cost runs/load-cal/*.steps.jsonl \\
        --out adaptivespec/profiles/sglang-cpu-smollm2-135m-bf16.json --note "how it was measured"

Steps of a batch's first decode after a prefill and one-time compilation stalls are outliers: lines
over ``--max-ms`` are dropped, and per ``(bs, shape)`` cell the median is what is fitted (one row
per cell, weighted by nothing), so a few slow steps do not move the model.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
from pathlib import Path

from adaptivespec.costmodel import CostModel, machine_info


def step_times(records: list[dict]) -> list[tuple[int, tuple[int, int, int], float]]:
    """``(bs, shape, ms)`` per whole step of one server's trace lines, in order (``shape``'s ``ndt``
    replaced by the rows the step verified where the line says: a merged tree's width, or 1 for a
    step that drafted nothing, shape ``(0, 0, 1)``): a step's draft and
    verify (``ms``) plus the rest of it (the next line's ``gap_ms``: its draft extension and the
    scheduler, known when the batch stayed the same). Traces written before ``gap_ms`` existed
    give ``ms`` alone."""
    whole = any("gap_ms" in r for r in records)
    out = []
    for i, rec in enumerate(records):
        ms = rec.get("ms")
        if ms is None:
            continue
        if whole:
            nxt = records[i + 1] if i + 1 < len(records) else None
            if nxt is None or nxt.get("gap_ms") is None or nxt["bs"] != rec["bs"]:
                continue
            ms = ms + nxt["gap_ms"]
        shape = tuple(rec["shape"])
        if "rows" in rec:  # a merged tree verifies more rows than its shape's ndt
            shape = (shape[0], shape[1], int(rec["rows"]))
        out.append((int(rec["bs"]), shape, float(ms)))
    return out


def cells(paths: list[Path], max_ms: float, min_steps: int) -> dict[tuple[int, tuple[int, int, int]], list[float]]:
    """Whole-step times per ``(batch size, shape)`` from trace files (:func:`step_times`)."""
    out: dict[tuple[int, tuple[int, int, int]], list[float]] = collections.defaultdict(list)
    for path in paths:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for bs, shape, ms in step_times(records):
            if 0 < ms <= max_ms:
                out[(bs, shape)].append(ms)
    return {k: v for k, v in out.items() if len(v) >= min_steps}


def fit(table: dict[tuple[int, tuple[int, int, int]], list[float]], **meta) -> CostModel:
    rows = []
    for (bs, (nsteps, topk, ndt)), times in sorted(table.items()):
        rows.append((0.0, nsteps, bs * nsteps * topk, bs * ndt, statistics.median(times)))
    return CostModel.fit(rows, **meta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="serve --trace files (JSON lines with ms)")
    ap.add_argument("--out", required=True, type=Path, help="cost profile to write (JSON)")
    ap.add_argument("--max-ms", type=float, default=2000.0, help="drop steps slower than this (compilation stalls)")
    ap.add_argument("--min-steps", type=int, default=5, help="fit only (bs, shape) cells with this many steps")
    ap.add_argument("--note", default="", help="how the traces were measured (kept in the profile as 'measured')")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.traces if not p.is_file()]
    if missing:
        print(f"served_cost: trace file not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    table = cells(args.traces, args.max_ms, args.min_steps)
    if len(table) < 2:
        print(f"served_cost: need at least 2 (batch size, shape) cells with {args.min_steps}+ timed steps, got "
              f"{len(table)} (were the traces written with step times, adaptivespec serve --trace?)", file=sys.stderr)
        return 2
    per_cell = {f"bs={bs} {tuple(shape)}": {"median_ms": round(statistics.median(t), 3), "steps": len(t)}
                for (bs, shape), t in sorted(table.items())}
    model = fit(table, machine=machine_info(), backend="sglang", per_cell=per_cell, measured=args.note,
                created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python -m adaptivespec.analysis.served_cost " + " ".join(sys.argv[1:] if argv is None else argv))
    model.save(args.out)
    fit_info = model.meta["fit"]
    print(f"{args.out}: fixed {model.fixed:.2f} ms, per verified row {model.per_verified_token:.3f} ms, per draft level "
          f"{model.per_draft_level:.2f} ms, per drafted node {model.per_draft_node:.3f} ms; {len(table)} cells, "
          f"mean error {fit_info['mean_abs_rel_error']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
