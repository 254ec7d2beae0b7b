"""Does a seed hold? Seeded sampled requests decoded three ways per config: alone by the one-request
engine (``generate``, ``serve --parallel 1``), alone in the batch engine, and among others in the
batch engine (``--slots`` lanes full, other seeds and prompts beside it, ``serve --parallel N``).
Reported per config: requests whose three texts are identical, and the mean share of the tokens
before the first divergence. Held-out Spec-Bench prompts (first turns, spread over categories), each
with its own seed, ``--temperature`` 0.8.

    python scripts/seed_check.py                                  # hybrid, batched-hybrid, cost-aware-hybrid
    python scripts/seed_check.py configs/batched-hybrid-int8.yaml --requests 20 --max-new-tokens 96
"""
from __future__ import annotations

import argparse
import sys

from batch_mismatch import common_prefix  # (this folder: run as a script)

DEFAULT_CONFIGS = ["configs/hybrid.yaml", "configs/batched-hybrid.yaml", "configs/cost-aware-hybrid.yaml"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args(argv)

    from adaptivespec.batch import BatchEngine, Request
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.evaluation.datasets import load_dataset
    from adaptivespec.hardware import cpu_kind

    problems = load_dataset("specbench")
    step = max(1, len(problems) // args.requests)
    problems = problems[::step][:args.requests]  # spread over the file's categories
    print(f"CPU: {cpu_kind()}; {len(problems)} Spec-Bench prompts, seeds 100..{99 + len(problems)}, "
          f"temperature {args.temperature}, {args.max_new_tokens} tokens, {args.slots} lanes")
    print("| config | identical (generate = batch alone = among others) | batch alone = generate | "
          "among others = alone | mean share before a divergence |")
    print("|---|---:|---:|---:|---:|")
    for path in args.configs:
        config = load_config(path, [f"generation.temperature={args.temperature}"])
        one = Engine(config)
        prompts = [one.encode(p.prompt) for p in problems]
        seeds = [100 + i for i in range(len(prompts))]
        n = args.max_new_tokens
        alone = [one.generate_ids(p, max_new_tokens=n, seed=s).token_ids for p, s in zip(prompts, seeds)]
        be = BatchEngine(config, args.slots, log=lambda _: None)
        solo = [be.generate_many([p], seeds=[s], max_new_tokens=n)[0].token_ids for p, s in zip(prompts, seeds)]
        reqs = [be.submit(Request(prompt=p, max_new_tokens=n, seed=s)) for p, s in zip(prompts, seeds)]
        while be.busy:
            be.step()
        among = [r.out for r in reqs]
        same = sum(a == b == c for a, b, c in zip(alone, solo, among))
        share = sum(min(common_prefix(a, b), common_prefix(a, c)) / max(len(a), 1) for a, b, c in zip(alone, solo, among)) / len(alone)
        print(f"| `{path.rsplit('/', 1)[-1].removesuffix('.yaml')}` | {same}/{len(alone)} | "
              f"{sum(a == b for a, b in zip(alone, solo))}/{len(alone)} | {sum(b == c for b, c in zip(solo, among))}/{len(alone)} | "
              f"{share:.1%} |", flush=True)
        del be
    return 0


if __name__ == "__main__":
    sys.exit(main())
