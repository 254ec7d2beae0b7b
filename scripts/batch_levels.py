"""Total tok/s of ar, hybrid (static trees) and batched-hybrid (row budget) in process at 1, 2, 4, 8, 16
requests in flight on 12 held-out Spec-Bench prompts (2 per category), and what the budget chose.

    python scripts/batch_levels.py
"""
import time, sys
from adaptivespec.config import load_config
from adaptivespec.batch import BatchEngine, Request
from adaptivespec.evaluation.datasets import load_dataset
names = ["ar", "hybrid", "batched-hybrid"]
probs = load_dataset("specbench", None, None)
by = {}
for p in probs: by.setdefault(p.category, []).append(p)
prompts = [p.prompt for c in sorted(by) for p in by[c][:2]]  # 12 held-out prompts, 2 per category
engines = {n: BatchEngine(load_config(f"configs/{n}.yaml"), slots=16, measure=True, context_length=2048, log=lambda *_: None) for n in names}
ids = [engines["ar"].encode(p) for p in prompts]
for be in engines.values(): be.generate_many(ids[:4], max_new_tokens=8)
print("level | " + " | ".join(names) + " | budget: speculative steps, draft rows/step")
for level in (1, 2, 4, 8, 16):
    row = []
    for n, be in engines.items():
        work = (ids * 4)[: max(level, len(ids))]
        reqs, pending = [], list(work)
        t0 = time.perf_counter(); spec = steps = drows = 0
        while pending or any(not r.done for r in reqs):
            while pending and sum(not r.done for r in reqs) < level:
                reqs.append(be.submit(Request(prompt=pending.pop(0), max_new_tokens=128)))
            be.step(); steps += 1
            if be.budget is not None and be.last.decoders:
                spec += be.budget.mode; drows += be.last.draft_rows
        t = time.perf_counter() - t0
        row.append(f"{sum(len(r.out) for r in reqs)/t:.1f}")
        extra = f"{spec}/{steps}, {drows/max(steps,1):.1f}" if be.budget is not None else ""
    print(f"{level} | " + " | ".join(row) + f" | {extra}", flush=True)
