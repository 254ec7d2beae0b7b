"""Self-distillation throughput: ``model.generate`` on padded batches (the former path) against
``generate_greedy`` (rows leave the batch at EOS) with length-bucketed, token-budgeted batches.

    python scripts/bench_generation.py --prompts 32 --max-new-tokens 192 --threads 2 [--json FILE]

Both paths answer the same prompts of the broad training mix (the first ``--prompts`` of
``build_mix``), bf16, in alternating rounds; prints tokens/s of each and the speedup.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from adaptivespec.models import encode_prompt, load_target
from adaptivespec.training.data import _generate, generate_greedy, plan_generation
from adaptivespec.training.mix import build_mix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch of the former path (its default)")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target("smollm2-135m-instruct", "bfloat16")
    eos = tok.eos_token_id
    prompts = [encode_prompt(tok, p.text) for p in build_mix(10 * args.prompts) if p.follow_up is None][: args.prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def old() -> int:
        n = 0
        for b in range(0, len(order), args.batch):
            _, resp = _generate(model, [prompts[i] for i in order[b : b + args.batch]], eos, args.max_new_tokens)
            n += sum(map(len, resp))
        return n

    def new() -> int:
        n = 0
        for g in plan_generation([len(p) for p in prompts], args.max_new_tokens, args.gen_batch, args.gen_tokens):
            n += sum(map(len, generate_greedy(model, [prompts[i] for i in g], eos, args.max_new_tokens)))
        return n

    totals = {"model.generate, padded batches": [0, 0.0], "generate_greedy, bucketed": [0, 0.0]}
    for _ in range(args.rounds):
        for name, fn in zip(totals, (old, new)):
            t0 = time.perf_counter()
            totals[name][0] += fn()
            totals[name][1] += time.perf_counter() - t0
    rows = {k: {"tokens": n, "seconds": round(s, 1), "tokens_per_second": round(n / s, 1)} for k, (n, s) in totals.items()}
    a, b = (r["tokens_per_second"] for r in rows.values())
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rounds": args.rounds,
           "paths": rows, "speedup": round(b / a, 2)}
    print(json.dumps(out, indent=1))
    if args.json:
        open(args.json, "w").write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
