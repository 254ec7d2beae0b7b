"""Upper bound of what trees can gain on llama.cpp, from a bench run's per-step accepted lengths.

For every step of one config in a bench run folder (``records.jsonl``, e.g. ``hybrid``), an oracle
that knew the step's accepted length ``a`` verifies exactly the chain of ``a + 1`` rows (``a`` head
forwards of ``--head-ms``, the commit's included) or, where that costs more per token, ``a + 1``
plain steps. The bound is plain decoding's time per token over the oracle's, per category, decode
only (prompt processing is the same for both). ``--rows``: what a decode of n rows costs, in ms (the
defaults: docs/llamacpp.md's quiet-machine medians, 2 threads, AMD EPYC, 2026-12-07)::

    adaptivespec bench --configs configs/ar.yaml configs/hybrid.yaml --dataset specbench --per-category 2 \\
        --max-new-tokens 128 --runtime llamacpp --set model.target=Q8_0.gguf --out runs/q8
    python scripts/llamacpp_oracle.py runs/q8 --rows q8_0
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

ROWS = {  # ms per llama_decode of n rows after 200 cached positions (docs/llamacpp.md)
    "q8_0": {1: 8.6, 2: 15.7, 3: 19.1, 4: 19.7, 5: 23.9, 6: 25.8, 7: 28.3, 8: 27.9, 9: 33.4, 12: 37.2, 16: 44.2},
    "q4_1": {1: 7.3, 2: 13.4, 3: 18.4, 4: 23.9, 5: 30.2, 6: 35.6, 7: 43.0, 8: 40.5, 9: 47.1, 12: 56.3, 16: 71.2},
}


def decode_ms(rows: dict[int, float], n: int) -> float:
    """A decode of ``n`` rows, interpolated between the measured counts (the largest beyond them)."""
    counts = sorted(rows)
    return float(np.interp(min(n, counts[-1]), counts, [rows[c] for c in counts]))


def oracle_time(accepted: list[int], rows: dict[int, float], head_ms: float) -> tuple[float, float]:
    """(tokens, oracle's ms) over steps that accepted ``accepted`` tokens each."""
    plain = rows[1]
    tokens = ms = 0.0
    for a in accepted:
        ms += min(plain * (a + 1), decode_ms(rows, a + 1) + head_ms * a)
        tokens += a + 1
    return tokens, ms


def main() -> None:
    from adaptivespec.evaluation.datasets import load_dataset

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a bench run folder (its records.jsonl)")
    p.add_argument("--config", default="hybrid", help="the config whose steps are replayed (default: %(default)s)")
    p.add_argument("--rows", choices=sorted(ROWS), default="q8_0", help="the file's row costs (default: %(default)s)")
    p.add_argument("--head-ms", type=float, default=1.46, help="one head forward, ms (default: %(default)s)")
    p.add_argument("--dataset", default="specbench", help="the run's dataset, for categories (default: %(default)s)")
    args = p.parse_args()
    category = {str(q.id): q.category for q in load_dataset(args.dataset)}
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in (args.run / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["config"] == args.config:
            tokens, ms = oracle_time(r["accepted"], ROWS[args.rows], args.head_ms)
            for key in (category.get(str(r["id"]), "?"), "all"):
                totals[key][0] += tokens
                totals[key][1] += ms
    plain = ROWS[args.rows][1]
    print({key: round(plain * tokens / ms, 2) for key, (tokens, ms) in totals.items()})


if __name__ == "__main__":
    main()
