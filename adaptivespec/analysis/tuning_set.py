"""Write a tuning set: GSM8K *train* problems the shipped draft head never saw.

Shapes and kappa are tuned on training prompts, never on an evaluation set; and not on the prompts
whose answers the head was distilled from either, or the head would look better there than
anywhere else (deep trees and low kappa would win for the wrong reason). This keeps the GSM8K train
problems whose ``gsm8k-train-N`` id is absent from the distillation corpus, in file order.

    python -m adaptivespec.analysis.tuning_set --n 64 --out runs/tuning/gsm8k-train-heldout.jsonl
    adaptivespec sweep --config configs/eagle3.yaml ... --dataset gsm8k --data runs/tuning/gsm8k-train-heldout.jsonl

The data root is ``$ADAPTIVESPEC_DATA`` or ``shared/data`` beside the checkout (see
``adaptivespec.training.data``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptivespec.training.data import DATA_ROOT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="problems to write (default 64)")
    ap.add_argument("--out", required=True, help="JSON-lines file to write (GSM8K fields: question, answer)")
    ap.add_argument("--data-root", default=str(DATA_ROOT), help=f"data root (default {DATA_ROOT})")
    ap.add_argument("--distilled", help="distillation corpus whose ids are excluded "
                                        "(default DATA_ROOT/distill/smollm2-135m-instruct.jsonl)")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n: expected a positive integer, got {args.n}")
    root = Path(args.data_root)
    train = root / "gsm8k" / "train.jsonl"
    distilled = Path(args.distilled) if args.distilled else root / "distill" / "smollm2-135m-instruct.jsonl"
    for arg, path in (("--data-root", train), ("--distilled", distilled)):
        if not path.is_file():
            print(f"tuning_set: {arg}: {path} does not exist; expected the shared data folder "
                  "(set ADAPTIVESPEC_DATA or --data-root)", file=sys.stderr)
            return 2
    seen = set()
    with distilled.open() as f:
        for line in f:
            rid = json.loads(line)["id"]
            if rid.startswith("gsm8k-train-"):
                seen.add(int(rid.rsplit("-", 1)[1]))
    kept = []
    with train.open() as f:
        for i, line in enumerate(f):
            if i not in seen and line.strip():
                kept.append(line if line.endswith("\n") else line + "\n")
                if len(kept) == args.n:
                    break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(kept))
    print(f"tuning_set: wrote {len(kept)} GSM8K train problems (not among the {len(seen)} the head was "
          f"distilled from) to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
