"""Which tokenization of the grammar's forced string does the target accept? A replay, no model.

Constrained greedy decoding is lossless, so ``configs/grammar.yaml`` (the grammar source alone,
``strict``) emits exactly the constrained ``ar.yaml`` output. Replaying that output step by step
gives, for each ``tokens`` mode of the grammar source, what every step would have proposed and
how much of it the target accepted: accepted tokens per target forward, share of proposed tokens
accepted. Input: a ``--prompts`` file with ``response_format`` per record and the matching
``generate --json`` output of ``configs/ar.yaml``.

    adaptivespec generate --config configs/ar.yaml --prompts runs/tuning/structured-tuning.jsonl \\
        --max-new-tokens 128 --json > runs/tuning/ar.jsonl
    python -m adaptivespec.analysis.grammar_draft_replay runs/tuning/structured-tuning.jsonl runs/tuning/ar.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

MODES = ("canonical", "greedy", "single")


def replay(constraint_factory, outputs: list[list[int]], formats: list, mode: str, max_depth: int = 16) -> dict:
    proposed = accepted = forwards = tokens = 0
    for ids, fmt in zip(outputs, formats):
        c = constraint_factory(fmt)
        c.accept(ids[:1])  # prefill's token
        pos, forwards, tokens = 1, forwards + 1, tokens + len(ids)
        while pos < len(ids):
            chain = c.forced_tokens(mode, max_depth)
            k = 0
            while k < len(chain) and pos + k < len(ids) and chain[k] == ids[pos + k]:
                k += 1
            proposed += len(chain)
            accepted += k
            step = ids[pos:pos + k + 1]
            c.accept(step)
            pos += len(step)
            forwards += 1
    return {"mode": mode, "tokens": tokens, "target_forwards": forwards, "tokens_per_forward": tokens / forwards,
            "proposed": proposed, "accepted": accepted, "accepted_share": accepted / max(proposed, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts")
    ap.add_argument("ar_output")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from adaptivespec.response_format import parse_response_format
    from adaptivespec.constraints import GrammarBackend
    from adaptivespec.models import embedded_folder

    backend = GrammarBackend(AutoTokenizer.from_pretrained(str(embedded_folder())), 49152)
    recs = [json.loads(line) for line in open(a.prompts) if line.strip()]
    outs = [json.loads(line) for line in open(a.ar_output) if line.strip()]
    formats = [parse_response_format(r["response_format"], a.prompts) for r in recs[:len(outs)]]
    ids = [o["token_ids"] for o in outs]
    for mode in MODES:
        print(json.dumps(replay(backend.constraint, ids, formats, mode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
