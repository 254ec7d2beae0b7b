"""Write a Spec-Bench-format tuning set from broad-mix prompts that a head was *not* trained on.

The broad mix (``train-drafter --mix``) draws its prompts deterministically; a corpus holds the
records generated so far. The prompts of the same mix that are not in the corpus are training-split
prompts the head has never seen: the right place to tune a head's static shape (never an
evaluation set). Categories are the mix kinds as ``mix:<kind>`` (``mix:math`` is not MT-Bench's
``math``); ``chat2`` is left out (the bench sends one turn).

    python -m adaptivespec.analysis.heldout_mix_set --distilled runs/broad/training/distill.jsonl --per-kind 3 \\
        --out runs/tuning/heldout-mix.jsonl
    adaptivespec sweep --config configs/eagle3.yaml --reference configs/ar.yaml --param policy.nsteps=3,4,5 \\
        --dataset specbench --data runs/tuning/heldout-mix.jsonl --max-new-tokens 96

The tail stays unseen only while generation has not reached it: ``corpus/reserved-ids.txt`` (the last
40 eligible prompts of each kind, written with ``--per-kind 40 --ids-out``) is passed to
``train-drafter --reserve-ids``, which never generates or trains on them, so every set drawn here with
``--skip`` + ``--per-kind`` <= 40 stays the same however far the corpus grows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT, read_records
from adaptivespec.training.mix import build_mix, kind_of, parse_mix

SKIPPED_KINDS = ("chat2",)


def heldout(prompts, seen: set[str], per_kind: int, max_chars: int, skip: int = 0) -> list[dict]:
    """The last ``per_kind`` prompts of each kind whose id (or first turn's id) is not in ``seen``,
    after the last ``skip`` such prompts of the kind (a second, disjoint tuning set: ``skip`` = the
    first set's ``per_kind``).

    The last, because generation walks the mix from the front: the tail is what a growing corpus reaches
    last, so a tuning set drawn from it stays unseen by the next heads too.
    """
    taken: dict[str, int] = {}
    rows = []
    for p in reversed(prompts):
        kind = kind_of(p.id)
        if kind in SKIPPED_KINDS or p.id in seen or f"{p.id}-t1" in seen or len(p.text) > max_chars:
            continue
        taken[kind] = taken.get(kind, 0) + 1
        if skip < taken[kind] <= skip + per_kind:
            rows.append({"question_id": p.id, "category": f"mix:{kind}", "turns": [p.text]})
    return sorted(rows, key=lambda r: r["category"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--distilled", required=True, type=Path, help="the corpus the head was trained on (jsonl records)")
    ap.add_argument("--per-kind", type=int, default=3, help="prompts per kind (default 3)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the last N eligible prompts of each kind first "
                    "(a set disjoint from one made with --per-kind N; default 0)")
    ap.add_argument("--out", required=True, type=Path, help="JSON-lines file to write (Spec-Bench fields)")
    ap.add_argument("--ids-out", type=Path, help="also write the set's prompt ids, one per line (for train-drafter --reserve-ids)")
    ap.add_argument("--mix", default=None, help="the mix the corpus was drawn with (default: the default mix)")
    ap.add_argument("--max-prompts", type=int, default=20000, help="the corpus' --max-prompts (default 20000)")
    ap.add_argument("--prompt-seed", type=int, default=20261129, help="the corpus' --prompt-seed (default 20261129)")
    ap.add_argument("--max-chars", type=int, default=8000, help="skip prompts longer than this (default 8000)")
    ap.add_argument("--data-root", type=Path, default=DATA_ROOT, help=f"data root (default {DATA_ROOT})")
    args = ap.parse_args(argv)
    if args.per_kind < 1:
        ap.error(f"--per-kind: expected a positive integer, got {args.per_kind}")
    if args.skip < 0:
        ap.error(f"--skip: expected a non-negative integer, got {args.skip}")
    try:
        seen = {r.id for r in read_records(args.distilled)}
        prompts = build_mix(args.max_prompts, parse_mix(args.mix), args.data_root, args.prompt_seed)
    except AdaptiveSpecError as e:
        print(f"heldout_mix_set: {e}", file=sys.stderr)
        return 2
    rows = heldout(prompts, seen, args.per_kind, args.max_chars, args.skip)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.ids_out is not None:
        args.ids_out.parent.mkdir(parents=True, exist_ok=True)
        args.ids_out.write_text("".join(r["question_id"] + "\n" for r in rows))
    kinds = sorted({r["category"] for r in rows})
    print(f"wrote {args.out}: {len(rows)} prompts ({', '.join(kinds)}), none of the {len(seen)} corpus records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
