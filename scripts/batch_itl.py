"""7 requests decode; a 2,000-token prompt arrives; their inter-token latency before and while it is read.

    python scripts/batch_itl.py configs/batched-hybrid.yaml
"""
import time, sys, statistics
from adaptivespec.config import load_config
from adaptivespec.batch import BatchEngine, Request
cfg = load_config(sys.argv[1] if len(sys.argv) > 1 else "configs/batched-hybrid.yaml")
be = BatchEngine(cfg, slots=8, measure=True, context_length=4096, log=print)
prompts = ["Write a long story about a robot who learns to paint.", "Explain in detail how the internet works.", "Describe the history of Rome.",
           "Write an essay about climate change.", "Explain how compilers work, step by step.", "Describe the water cycle in detail.", "Write a guide to baking bread."]

filler = be.encode("The quick brown fox jumps over the lazy dog. " * 250, raw=True)[:2000]
long_ids = filler
print("long prompt tokens", len(long_ids))
be.generate_many([be.encode("Hello")] * 8, max_new_tokens=4)  # warm
stamps = {i: [] for i in range(7)}
def cb(i):
    def on(ids):
        t = time.perf_counter()
        stamps[i].append((t, len(ids)))
    return on
reqs = [be.submit(Request(prompt=be.encode(p), max_new_tokens=400, on_tokens=cb(i), stop_ids=frozenset())) for i, p in enumerate(prompts)]

steps = 0
while steps < 40: be.step(); steps += 1
t_arrive = time.perf_counter()
long = be.submit(Request(prompt=long_ids, max_new_tokens=8))
while long.first_token is None: be.step()
t_first = time.perf_counter()
def itl(lo, hi):
    out = []
    for i, st in stamps.items():
        prev = None
        for t, n in st:
            if prev is not None and lo <= t <= hi:
                out.append((t - prev) / n)
            prev = t
    return out
span = t_first - t_arrive
before, during = itl(t_arrive - span, t_arrive), itl(t_arrive, t_first)
print(f"prefill of {len(long_ids)} tokens took {span:.2f} s ({steps} steps before); decoders' ITL mean before {statistics.mean(before)*1e3:.1f} ms, during {statistics.mean(during)*1e3:.1f} ms: {statistics.mean(during)/statistics.mean(before):.2f}x; p50 {statistics.median(before)*1e3:.1f} -> {statistics.median(during)*1e3:.1f} ms")
for r in reqs: r.cancel()
while be.running: be.step()
