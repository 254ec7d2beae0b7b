"""Per-step time outside model forwards (tree building, verification rule, cache compaction).

Times every target forward and every drafter forward (layer + lm_head) of a speculative decode and
reports, per step, the rest of the wall time against one target forward. Also times plain AR
decoding on the same runtime against transformers' own greedy ``generate``, interleaved.

    python scripts/step_overhead.py --config configs/eagle3.yaml [--set model.drafter=DIR] [--prompts 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaptivespec.config import load_config
from adaptivespec.decode import Engine

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Janet has 3 apples and buys 5 more. She gives 2 to a friend. How many apples does she have?",
    "Explain in two sentences why the sky is blue.",
    "List five prime numbers and explain what makes them prime.",
]


class Timer:
    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.total += time.perf_counter() - t
            return out

        return timed


def overhead(config: str, overrides: list[str], n_prompts: int, tokens: int) -> None:
    engine = Engine(load_config(config, overrides))
    rt = engine.runtime
    target_t, draft_t = Timer(), Timer()
    target_forward = rt.target.forward
    rt.target.forward = target_t.wrap(target_forward)
    d = rt.drafter
    d.step, d.log_probs = draft_t.wrap(d.step), draft_t.wrap(d.log_probs)
    steps, per_step_target, per_step_other = 0, [], []
    engine.generate(PROMPTS[0], max_new_tokens=8)  # warm-up
    for text in PROMPTS[:n_prompts]:
        ids = engine.encode(text)
        marks = []

        def on_step(record, marks=marks):
            marks.append((time.perf_counter(), target_t.total, draft_t.total))

        t0, tt0, dt0 = time.perf_counter(), target_t.total, draft_t.total
        marks.append((t0, tt0, dt0))
        res = engine.generate_ids(ids, max_new_tokens=tokens, on_step=on_step)
        # the first mark precedes prefill: skip the first interval (prefill + first step)
        for (a, ta, da), (b, tb, db) in zip(marks[1:], marks[2:]):
            wall, tgt, drf = b - a, tb - ta, db - da
            per_step_target.append(tgt)
            per_step_other.append(wall - tgt - drf)
        steps += len(res.records)
    tf = statistics.median(per_step_target) * 1e3
    ot = statistics.median(per_step_other) * 1e3
    print(f"{config} {overrides}: {steps} steps; median target forward {tf:.1f} ms, "
          f"median time outside model forwards {ot:.2f} ms = {100 * ot / tf:.1f}% of a target forward")


def ar_vs_generate(overrides: list[str], n_prompts: int, tokens: int, rounds: int = 2) -> None:
    engine = Engine(load_config("configs/ar.yaml", overrides))
    model, tok = engine.target, engine.tokenizer
    ours, theirs = [0, 0.0], [0, 0.0]
    for _ in range(rounds):
        for text in PROMPTS[:n_prompts]:
            ids = engine.encode(text)
            t = time.perf_counter()
            res = engine.generate_ids(ids, max_new_tokens=tokens)
            ours[0] += res.stats["new_tokens"]
            ours[1] += time.perf_counter() - t
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            theirs[0] += out.shape[1] - len(ids)
            theirs[1] += time.perf_counter() - t
    a, b = ours[0] / ours[1], theirs[0] / theirs[1]
    print(f"AR ({engine.config.runtime.dtype}): adaptivespec ar.yaml {a:.2f} tok/s, transformers generate {b:.2f} tok/s, ratio {a / b:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/eagle3.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-ar", action="store_true")
    args = ap.parse_args()
    overhead(args.config, args.overrides, args.prompts, args.tokens)
    if not args.skip_ar:
        dtype = [o for o in args.overrides if o.startswith("runtime.dtype")]
        ar_vs_generate(dtype, args.prompts, args.tokens)
