"""The batch engine's step (``configs/batched-hybrid.yaml``, bf16): 8 and 16 requests decoding at once,
a plain step (the row budget drafts for nobody: one root row each) and a drafting step (every request's
head tree and retrieval candidates, cut by the row budget), so a regression run catches the batch path.

Each round is one :meth:`BatchEngine.step` at steady state: every request past its prompt, EOS ignored
and a limit far away (within the lanes' reserved 2048 positions), so rounds only lengthen the contexts by a few tokens. The row budget ranks over a
fixed synthetic cost table (no calibration in a benchmark run; the step itself is what is timed). The
rows verified per step and the tokens emitted are in each benchmark's ``extra_info``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptivespec.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPTS = (
    "Summarize the plot of a detective story in three sentences.",
    "Write a Python function that returns the factorial of n.",
    "Translate to French: the weather is nice today and we will walk to the market.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
)


def synthetic_costs():
    from adaptivespec.batch import CostTable

    fixed, per_row = 20.0, 0.5
    top = fixed + per_row * 511
    return CostTable(rows=(1, 512), verify_short=(fixed, top), verify_long=(fixed, top), contexts=(128, 1024),
                     per_request=0.1, draft_rows=(1, 128), draft=(0.5, 0.5), machine={"cpu": "synthetic"})


@pytest.fixture(scope="module")
def batch16():
    from adaptivespec.batch import BatchEngine

    config = load_config(CONFIGS / "batched-hybrid.yaml", ["generation.stop_at_eos=false"])
    return BatchEngine(config, 16, costs=synthetic_costs(), log=lambda _: None)


@pytest.mark.model
@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "drafting"])
@pytest.mark.parametrize("requests", [8, 16])
def test_batched_step(benchmark, batch16, requests, drafting):
    from adaptivespec.batch import Request, Status

    be = batch16
    benchmark.group = f"batched step, {requests} requests (batched-hybrid, bf16, CPU)"
    reqs = [be.submit(Request(prompt=be.encode(PROMPTS[i % len(PROMPTS)]), max_new_tokens=1500))
            for i in range(requests)]

    def speculate(*args, **kwargs):
        be.budget.mode = drafting
        return drafting

    be.budget.speculate = speculate
    try:
        while not all(r.status is Status.DECODE for r in reqs):
            be.step()
        be.step()  # the heads brought up to date (a drafting step after plain ones)
        tokens = [0]

        def step():
            before = sum(len(r.out) for r in reqs)
            be.step()
            tokens[0] += sum(len(r.out) for r in reqs) - before

        benchmark.pedantic(step, rounds=8, warmup_rounds=2, iterations=1)
        last = be.last
        assert last.decoders == requests and (last.undrafted == "load") is not drafting
        benchmark.extra_info.update(rows=last.rows, verify_rows=last.verify_rows,
                                    tokens_per_step=tokens[0] / 10)
    finally:
        del be.budget.speculate
        for r in reqs:
            r.cancel()
        while be.busy:
            be.step()
