"""Upper bound of what trees can gain on llama.cpp, from a bench run's per-step accepted lengths.

For every step of ``hybrid`` in a run folder (``records.jsonl``), an oracle that knew the step's
accepted length ``a`` verifies exactly the chain of ``a + 1`` rows (``a`` head levels, the head's
commit included) or, where that costs more per token, ``a + 1`` plain steps; the bound is plain
decoding's time per token over the oracle's, decode only (prompt processing is the same for both).
Row costs: the quiet-machine medians of docs/llamacpp.md (2 threads, AMD EPYC, 2026-12-07).

    python scripts/llamacpp_oracle.py   # reads runs/llamacpp-q8-2026-12-07 and runs/llamacpp-q41-2026-12-07
"""
import json

import numpy as np
rows = {"q8": {1:8.6,2:15.7,3:19.1,4:19.7,5:23.9,6:25.8,7:28.3,8:27.9,9:33.4,12:37.2,16:44.2},
        "q41": {1:7.3,2:13.4,3:18.4,4:23.9,5:30.2,6:35.6,7:43.0,8:40.5,9:47.1,12:56.3,16:71.2}}
HEAD = 1.46
def cost(table, n):
    xs = sorted(table); n = min(n, xs[-1])
    return float(np.interp(n, xs, [table[x] for x in xs]))
for run, key in (("runs/llamacpp-q8-2026-12-07", "q8"), ("runs/llamacpp-q41-2026-12-07", "q41")):
    recs = [json.loads(l) for l in open(run + "/records.jsonl")]
    bycat = {}
    for r in recs:
        if r["config"] != "hybrid": continue
        bycat.setdefault(r["id"], r["accepted"])
    from adaptivespec.evaluation.datasets import load_dataset
    cat_of = {str(p.id): p.category for p in load_dataset("specbench")}
    agg = {}
    one = rows[key][1]
    for pid, acc in bycat.items():
        c = cat_of.get(pid, "?")
        tok = time = 0.0
        for a in acc:
            chain = cost(rows[key], a + 1) + HEAD * a  # a-1 draft levels + the head's commit
            time += min(one * (a + 1), chain); tok += a + 1
        t0, k0 = agg.get(c, (0.0, 0.0)); agg[c] = (t0 + time, k0 + tok)
    print(key, {c: round(one * k / t, 2) for c, (t, k) in agg.items()}, "all", round(one * sum(k for _, k in agg.values()) / sum(t for t, _ in agg.values()), 2))
