"""Write a Spec-Bench-format tuning set from *training* prompts (never an evaluation set).

Categories like Spec-Bench's, drawn from the shared training data: summarization (SciTLDR
abstracts), rag (T0 passage + question prompts), qa-context (PubMedQA non-test), translation
(Multi30k German sources), coding (Code Alpaca) and math (GSM8K train from line 7000 on). Used to
tune retrieval settings (extra_slots, skip_draft_match, retrieval.yaml's budget):

    python -m adaptivespec.analysis.retrieval_tuning_set --per-category 3 --out runs/tuning/retrieval.jsonl
    adaptivespec bench --configs configs/eagle3.yaml configs/hybrid.yaml configs/retrieval.yaml \\
        --peers hf-prompt-lookup --dataset specbench --data runs/tuning/retrieval.jsonl --max-new-tokens 128
    adaptivespec sweep --config configs/hybrid.yaml --param sources.0.extra_slots=0,4,8 \\
        --dataset specbench --data runs/tuning/retrieval.jsonl --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptivespec.training.data import DATA_ROOT


def rows(root: Path, per: int, skip: int = 50):
    def read(name: str, n: int, start: int = skip, ok=lambda r: True):
        out = []
        with open(root / name) as fh:
            for i, line in enumerate(fh):
                if i < start:
                    continue
                r = json.loads(line)
                if ok(r):
                    out.append(r)
                if len(out) >= n:
                    break
        return out

    for r in read("train/scitldr_abstracts.jsonl", per):
        yield "summarization", "Summarize the following abstract in a few sentences.\n\n" + r["text"][:1500]
    for r in read("train/t0_context_prompts.jsonl", per, ok=lambda r: len(r["prompt"]) < 2500):
        yield "rag", r["prompt"]
    for r in read("train/pubmedqa_nontest.jsonl", per):
        ctx = r["context"] if isinstance(r["context"], str) else json.dumps(r["context"])
        yield "qa-context", f"Answer the question using the passage.\n\nPassage: {ctx[:1500]}\n\nQuestion: {r['question']}"
    for r in read("train/multi30k_src.jsonl", per):
        yield "translation", f"Translate German to English: {r['text']}"
    for r in read("train/code_alpaca.jsonl", per):
        yield "coding", r["instruction"] + ("\n" + r["input"] if r.get("input") else "")
    for r in read("gsm8k/train.jsonl", per, start=7000):
        yield "math", r["question"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=3, help="prompts per category (default 3)")
    ap.add_argument("--out", required=True, help="JSON-lines file to write (Spec-Bench fields)")
    ap.add_argument("--data-root", default=str(DATA_ROOT), help=f"data root (default {DATA_ROOT})")
    args = ap.parse_args(argv)
    if args.per_category < 1:
        ap.error(f"--per-category: expected a positive integer, got {args.per_category}")
    root = Path(args.data_root)
    if not (root / "train").is_dir():
        print(f"retrieval_tuning_set: --data-root: {root / 'train'} does not exist", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:
        for i, (cat, prompt) in enumerate(rows(root, args.per_category)):
            fh.write(json.dumps({"question_id": f"tune-{i}", "category": cat, "turns": [prompt]}) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
