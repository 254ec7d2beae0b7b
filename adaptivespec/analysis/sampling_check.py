"""Do speculative configs sample like plain decoding? A permutation test on the first tokens.

For every config, ``--samples`` seeded generations (config k: seeds k * 10^6 + 0..N-1) of ``--tokens`` tokens of one
prompt at ``generation.temperature`` (and any ``--set``); each config's outcomes are compared with
the first config's (the reference, normally ``configs/ar.yaml``) by a permutation test on three
statistics: the total-variation distance between the empirical distributions of the first token,
of the second token and of the pair (outcomes seen fewer than ``--min-count`` times in the pooled
sample are pooled into one "other" cell). A lossless sampler cannot be told apart from plain
sampling: its p-values are uniform, so they are small only by chance.

    python -m adaptivespec.analysis.sampling_check --configs configs/ar.yaml configs/eagle3.yaml configs/adaptivespec-dynamic.yaml \\
        --samples 300 --set generation.temperature=1.0 [--set runtime.dtype=float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Hashable, Sequence

PROMPT = "Name a color and describe it in one sentence."


def tv_binned(a: Sequence[Hashable], b: Sequence[Hashable], keep: set) -> float:
    """Total-variation distance between the empirical laws of ``a`` and ``b``, outcomes outside
    ``keep`` pooled into one cell."""
    ca = Counter(x if x in keep else "<other>" for x in a)
    cb = Counter(x if x in keep else "<other>" for x in b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in set(ca) | set(cb))


def permutation_test(a: Sequence[Hashable], b: Sequence[Hashable], *, permutations: int = 1000, seed: int = 0,
                     min_count: int = 5) -> tuple[float, float]:
    """(statistic, p-value) of the two-sample permutation test with the binned TV distance."""
    pooled = list(a) + list(b)
    counts = Counter(pooled)
    keep = {k for k, c in counts.items() if c >= min_count}
    observed = tv_binned(a, b, keep)
    rng = random.Random(seed)
    hits = 0
    for _ in range(permutations):
        rng.shuffle(pooled)
        hits += tv_binned(pooled[: len(a)], pooled[len(a):], keep) >= observed - 1e-12
    return observed, (hits + 1) / (permutations + 1)


def compare(ref: list[tuple[int, ...]], other: list[tuple[int, ...]], permutations: int = 1000, min_count: int = 5) -> dict:
    """p-values for the first token, the second token and the pair."""
    out = {}
    views = {"first": lambda s: s[0], "second": lambda s: s[1] if len(s) > 1 else None, "pair": lambda s: tuple(s[:2])}
    for name, view in views.items():
        stat, p = permutation_test([view(s) for s in ref], [view(s) for s in other],
                                   permutations=permutations, min_count=min_count)
        out[name] = {"tv": stat, "p": p}
    return out


SEED_STRIDE = 1_000_000
"""Config k of a run samples with seeds ``k * SEED_STRIDE + 0..N-1``: the configs' samples must be
independent for a permutation test (with shared seeds, identical prefill logits would give
identical first tokens, a coupling that hides differences)."""


def sample(config_path: str, overrides: list[str], prompt: str, n: int, tokens: int, first_seed: int = 0) -> list[tuple[int, ...]]:
    from tqdm import tqdm

    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    engine = Engine(load_config(config_path, overrides))
    ids = engine.encode(prompt)
    return [tuple(engine.generate_ids(ids, max_new_tokens=tokens, seed=first_seed + s).token_ids)
            for s in tqdm(range(n), desc=Path(config_path).stem, file=sys.stderr)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", required=True, help="the first is the reference (plain decoding)")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--tokens", type=int, default=2)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--permutations", type=int, default=2000)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--json", help="write the samples and p-values here")
    args = p.parse_args(argv)
    overrides = args.overrides or ["generation.temperature=1.0"]
    samples = {c: sample(c, overrides, args.prompt, args.samples, args.tokens, k * SEED_STRIDE) for k, c in enumerate(args.configs)}
    ref = args.configs[0]
    report = {"settings": vars(args) | {"overrides": overrides}, "results": {}}
    for c in args.configs:
        distinct = {"pairs": len(set(samples[c])), "first": len({s[0] for s in samples[c]})}
        row = {"distinct": distinct}
        if c != ref:
            row |= compare(samples[ref], samples[c], args.permutations)
        report["results"][c] = row
        print(f"{c}: {distinct['pairs']} distinct pairs, {distinct['first']} distinct first tokens"
              + ("".join(f"; {k} TV {row[k]['tv']:.3f} p={row[k]['p']:.3f}" for k in ("first", "second", "pair")) if c != ref else " (reference)"))
    if args.json:
        report["samples"] = {c: [list(s) for s in v] for c, v in samples.items()}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
