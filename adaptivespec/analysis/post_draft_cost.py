"""What the tree policy's in-step rules cost: the time spent inside ``select_level``, ``select_final``
and the fusion rules, against the whole step, over a few decodes.

    python -m adaptivespec.analysis.post_draft_cost --config configs/post-draft.yaml --max-new-tokens 128

Prompts: ``adaptivespec calibrate``'s four built-in ones (none from an evaluation set). Each rule
is wrapped with a ``perf_counter`` pair (about a microsecond per call, included in the figure).
"""

from __future__ import annotations

import argparse
import json
import time

RULES = ("select_level", "select_final", "fusion_scores", "fusion_source_scores", "fusion_size", "next_shape")


def measure(engine, prompts: list[str], max_new_tokens: int) -> dict:
    """Per-step milliseconds spent in each rule of ``engine.policy``, and the step's own."""
    policy = engine.policy
    spent = {r: 0.0 for r in RULES if hasattr(policy, r)}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    for name in spent:
        setattr(policy, name, timed(name, getattr(policy, name)))
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    spent.update({k: 0.0 for k in spent})
    steps, step_ms = 0, 0.0
    for text in prompts:
        res = engine.generate(text, max_new_tokens=max_new_tokens)
        steps += len(res.records)
        step_ms += sum(r.draft_ms + r.verify_ms + r.other_ms for r in res.records)
    rules_ms = {k: 1e3 * v / max(steps, 1) for k, v in spent.items()}
    total = sum(rules_ms.values())
    return {"steps": steps, "step_ms": step_ms / max(steps, 1), "rules_ms_per_step": rules_ms,
            "rules_total_ms_per_step": total, "share_of_step": total / (step_ms / max(steps, 1))}


def main(argv=None) -> int:
    from adaptivespec.calibrate import PROMPTS
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    engine = Engine(load_config(args.config, args.overrides))
    print(json.dumps(measure(engine, PROMPTS, args.max_new_tokens), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
