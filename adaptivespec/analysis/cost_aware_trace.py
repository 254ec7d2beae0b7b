"""What ``cost_aware`` learns across prompts: decode prompts one after another in one engine (as a
bench or a server does) and print, after each, its accept length, the most tokens a step accepted,
the share of steps accepting 3 or more, and the policy's continuation rates by depth.

    python -m adaptivespec.analysis.cost_aware_trace --data runs/tuning/pool.jsonl [--config configs/cost-aware.yaml] \\
        [--set policy.cont_prior=4] [--max-new-tokens 96]

``--data``: Spec-Bench-format JSON lines (``adaptivespec.analysis.heldout_mix_set`` writes them; order matters:
it is the order the engine sees). A continuation rate that falls on one kind of prompt and stays
there while later prompts accept at most ``d`` tokens is the trap docs/tuning.md's "Known problem"
describes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

def trace(engine, rows: Iterable[dict], max_new_tokens: int) -> Iterable[dict[str, Any]]:
    """One dict per prompt, in order: id, category, tau, max_accepted, share_ge3, continuation."""
    for row in rows:
        res = engine.generate(row["turns"][0], max_new_tokens=max_new_tokens)
        acc = [r.accepted for r in res.records]
        yield {"id": row.get("question_id"), "category": row.get("category"), "tokens": res.stats["new_tokens"],
               "forwards": res.stats["target_forwards"], "tau": round(res.stats["accept_length_mean"], 3),
               "max_accepted": max(acc, default=0), "share_ge3": round(sum(a >= 3 for a in acc) / max(len(acc), 1), 3),
               "continuation": [round(c, 3) for c in engine.policy.continuation()]}


def main(argv: list[str] | None = None) -> int:
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.errors import AdaptiveSpecError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True, type=Path, help="Spec-Bench-format JSON-lines files, decoded in order")
    ap.add_argument("--config", default="configs/cost-aware.yaml", help="a cost_aware config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depths", type=int, default=6, help="continuation rates shown (depth indices 1..N)")
    args = ap.parse_args(argv)
    try:
        rows = [json.loads(x) for f in args.data for x in f.read_text().splitlines() if x.strip()]
        engine = Engine(load_config(args.config, args.overrides))
        if not hasattr(engine.policy, "continuation"):
            raise AdaptiveSpecError(f"--config: policy {engine.config.policy.name!r} has no continuation rates; expected cost_aware")
    except (OSError, ValueError, AdaptiveSpecError) as exc:
        print(f"cost_aware_trace: {exc}", file=sys.stderr)
        return 2
    tokens = forwards = 0
    for r in trace(engine, rows, args.max_new_tokens):
        tokens, forwards = tokens + r["tokens"], forwards + r["forwards"]
        cont = " ".join(f"{c:.2f}" for c in r["continuation"][1 : args.depths + 1])
        print(f"{str(r['category'])[:14]:<14} {str(r['id'])[:26]:<26} tau {r['tau']:.2f} max {r['max_accepted']} "
              f">=3 {r['share_ge3']:.2f} cont[1..] {cont}", flush=True)
    print(f"pooled tau {tokens / max(forwards, 1):.3f} ({tokens} tokens, {forwards} target forwards)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
