"""Self-distillation throughput of three generation paths on the same prompts:

- ``padded``: ``model.generate`` on padded batches (the first path);
- ``bucketed``: ``generate_greedy`` (rows leave the batch at EOS) on length-bucketed, token-budgeted batches;
- ``continuous``: ``generate_stream`` (what ``train-drafter`` runs now): rows leave at EOS and the
  next prompts take their place, so a batch does not run its longest answers with a few rows.

    python scripts/bench_generation.py --prompts 48 --max-new-tokens 384 --paths bucketed,continuous [--json FILE]

The prompts are the first ``--prompts`` single-turn prompts of the broad training mix
(``build_mix``), bf16; paths alternate within each round. Prints tokens/s of each and the ratio
of each to the first path named.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from adaptivespec.models import encode_prompt, load_target
from adaptivespec.training.data import _generate, generate_greedy, generate_stream, plan_generation
from adaptivespec.training.mix import build_mix

PATHS = ("padded", "bucketed", "continuous")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch of the former path (its default)")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="padded,bucketed,continuous", help="comma-separated, the first is the reference")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.paths.split(",")
    bad = [x for x in names if x not in PATHS]
    if bad:
        ap.error(f"--paths: {bad[0]!r} is not a path; expected names from {', '.join(PATHS)}")
    torch.set_num_threads(args.threads)
    model, tok = load_target("smollm2-135m-instruct", "bfloat16")
    eos = tok.eos_token_id
    prompts = [encode_prompt(tok, p.text) for p in build_mix(10 * args.prompts) if p.follow_up is None][: args.prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def padded() -> int:
        n = 0
        for b in range(0, len(order), args.batch):
            _, resp = _generate(model, [prompts[i] for i in order[b : b + args.batch]], eos, args.max_new_tokens)
            n += sum(map(len, resp))
        return n

    def bucketed() -> int:
        n = 0
        for g in plan_generation([len(p) for p in prompts], args.max_new_tokens, args.gen_batch, args.gen_tokens):
            n += sum(map(len, generate_greedy(model, [prompts[i] for i in g], eos, args.max_new_tokens)))
        return n

    def continuous() -> int:
        stream = generate_stream(model, [prompts[i] for i in order], eos, args.max_new_tokens, batch_size=args.gen_batch,
                                 gen_tokens=args.gen_tokens)
        return sum(len(r) for _, r in stream)

    fns = {"padded": padded, "bucketed": bucketed, "continuous": continuous}
    totals = {name: [0, 0.0] for name in names}
    for _ in range(args.rounds):
        for name in names:
            t0 = time.perf_counter()
            totals[name][0] += fns[name]()
            totals[name][1] += time.perf_counter() - t0
    rows = {k: {"tokens": n, "seconds": round(s, 1), "tokens_per_second": round(n / s, 1)} for k, (n, s) in totals.items()}
    ref = rows[names[0]]["tokens_per_second"]
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rounds": args.rounds,
           "gen_batch": args.gen_batch, "gen_tokens": args.gen_tokens, "paths": rows,
           "ratio_to_first": {k: round(r["tokens_per_second"] / ref, 2) for k, r in rows.items()}}
    print(json.dumps(out, indent=1))
    if args.json:
        open(args.json, "w").write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
