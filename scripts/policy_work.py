"""Per-step work of the ``cost_aware`` policy (level rule, budget rule, calibration update, trace
state) against EAGLE's default beam rules, timed with ``timeit`` on a fake drafter (no model), and
as a share of the step time the cost profile predicts for the trees it drew.

    python scripts/policy_work.py [--config configs/cost-aware.yaml] [--steps 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from adaptivespec.config import load_config
from adaptivespec.plugins import get_plugin_host
from adaptivespec.policies.static import StaticParams, StaticPolicy
from adaptivespec.tree import draft_tree
from adaptivespec.types import StepRecord, VerifyResult

VD, HIDDEN = 8192, 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cost-aware.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    policy = get_plugin_host().policies.get(cfg.policy.name).cls(cfg.policy.params)
    shape = policy.shapes()[0]
    static = StaticPolicy(StaticParams(nsteps=shape.nsteps, topk=shape.topk, ndt=shape.ndt))
    gen = torch.Generator().manual_seed(0)
    logps = [torch.log_softmax(torch.randn(64, VD, generator=gen) * t, -1) for t in (1.0, 2.0, 4.0, 8.0)]
    hidden = torch.zeros(64, HIDDEN)
    which = [0]

    def expand(tokens, states, parent_slots, depth):
        lp = logps[which[0] % len(logps)]
        return lp[: tokens.shape[0]], hidden[: tokens.shape[0]]

    rule_time = [0.0]

    def timed(fn):
        def wrapper(*a):
            t = time.perf_counter()
            out = fn(*a)
            rule_time[0] += time.perf_counter() - t
            return out
        return wrapper

    def run_rules(pol) -> tuple[float, list]:
        rule_time[0] = 0.0
        sl, sf = pol.select_level, pol.select_final
        pol.select_level, pol.select_final = timed(sl), timed(sf)
        trees = []
        try:
            for i in range(args.steps):
                which[0] = i
                lp = logps[i % len(logps)]
                trees.append(draft_tree(shape, torch.tensor(1), lp[-1], hidden[-1], expand, lambda x: x, pol))
        finally:
            del pol.select_level, pol.select_final
        return rule_time[0] / args.steps, trees

    run_rules(policy)  # warm-up
    ours, trees = run_rules(policy)
    base, _ = run_rules(static)
    tree, res = trees[0], VerifyResult(path=[0, 1], tokens=[1, 2])
    rec = StepRecord(step=0, shape=shape, tree_size=tree.size, accepted=1, promoted=0, new_tokens=2,
                     draft_ms=0.0, verify_ms=0.0, other_ms=0.0)

    def learn():
        policy.observe_tree(tree, res)
        policy.observe(rec)
        policy.state()

    n = args.steps
    learn_s = min(timeit.repeat(learn, number=n, repeat=3)) / n
    cost = policy.cost
    step_ms = statistics.mean(
        cost.step_ms(t.size, int(t.depth.max()) - 1, (int(t.depth.max()) - 1) * shape.topk) for t in trees
    )
    work_ms = (ours + learn_s) * 1e3
    print(f"{args.config}: {n} steps; tree rules {ours * 1e3:.3f} ms/step (EAGLE default rules on the same "
          f"shape {base * 1e3:.3f}), calibration update + observe + state {learn_s * 1e3:.3f} ms/step; "
          f"policy work {work_ms:.3f} ms = {100 * work_ms / step_ms:.2f}% of the {step_ms:.1f} ms step the profile "
          f"predicts for these trees (extra over EAGLE's rules: {100 * (work_ms - base * 1e3) / step_ms:.2f}%)")


if __name__ == "__main__":
    main()
