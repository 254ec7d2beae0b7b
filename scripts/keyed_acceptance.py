"""What keyed sampling costs in acceptance: the accept length of sampled speculative decoding with
``strict``'s keyed rule (a drafted child is accepted when it is the target's keyed choice at its
parent: :mod:`adaptivespec.sampling`) against the sequential residual rule it replaced
(:func:`~adaptivespec.tree_sampling.sibling_accept` + :func:`~adaptivespec.tree_sampling.residual_draw`,
still in the plugin API), on the same prompts and seeds, per category.

Both rules are exact, and for a deterministic top-k draft both accept a child with probability
p(child); this measures it. Usage::

    python scripts/keyed_acceptance.py --config configs/hybrid.yaml --per-category 4 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import collections
import sys

from adaptivespec.api import accepted_path, emit, residual_draw, sibling_accept
from adaptivespec.config import load_config
from adaptivespec.decode import Engine
from adaptivespec.evaluation.datasets import load_dataset


def residual_rule(self, tree, logits):
    """The rule strict used before keyed sampling: children tried in order against their residual."""
    sampler = self.sampler
    probs = sampler.probs(logits)
    last = accepted_path(tree, sibling_accept(tree, probs, sampler.uniform(tree.tokens.shape[0])))
    return emit(tree, last, residual_draw(tree, probs, last, sampler))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/hybrid.yaml")
    ap.add_argument("--dataset", default="specbench")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    args = ap.parse_args(argv)
    config = load_config(args.config, [f"generation.temperature={args.temperature}"])
    engine = Engine(config)
    if type(engine.verifier).__name__ != "StrictVerifier":
        print(f"--config: expected a config with the strict verifier, got {config.verifier.name!r}", file=sys.stderr)
        return 2
    keyed = type(engine.verifier).verify
    taken: dict[str, int] = collections.Counter()
    problems = [p for p in load_dataset(args.dataset)
                if taken.update([p.category]) or taken[p.category] <= args.per_category]
    rows = collections.defaultdict(lambda: {"keyed": [0, 0], "residual": [0, 0]})
    for i, p in enumerate(problems):
        ids = engine.encode(p.prompt)
        for seed in range(args.seeds):
            for rule, verify in (("keyed", keyed), ("residual", residual_rule)):
                type(engine.verifier).verify = verify
                try:
                    res = engine.generate_ids(ids, max_new_tokens=args.max_new_tokens, seed=1000 * i + seed)
                finally:
                    type(engine.verifier).verify = keyed
                for key in (p.category, "all"):
                    rows[key][rule][0] += res.stats["new_tokens"]
                    rows[key][rule][1] += res.stats["target_forwards"]
        print(f"{i + 1}/{len(problems)} prompts", file=sys.stderr, end="\r")
    print(f"\n{args.config}, {args.dataset} {args.per_category} per category x {args.seeds} seeds, "
          f"{args.max_new_tokens} tokens, temperature {args.temperature}: tokens per target forward")
    print(f"{'category':<24}{'keyed':>8}{'residual':>10}{'ratio':>8}")
    for cat in [c for c in rows if c != "all"] + ["all"]:
        k, r = (rows[cat][rule][0] / max(rows[cat][rule][1], 1) for rule in ("keyed", "residual"))
        print(f"{cat:<24}{k:>8.3f}{r:>10.3f}{k / r:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
