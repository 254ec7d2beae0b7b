"""The batch engine on the real model (float32): every request of a batch decodes as if it ran alone.

With a strict verifier each request's tokens are transformers' greedy ones, whatever the config,
the row budget, the prompt lengths, and whoever joins or leaves around it; a lossy verifier (FLy)
gives each request what it gives that request alone; sampled requests follow their own seeds and
the exact distribution. One engine per config for the whole module (``engines``), reused by the
tests as a server reuses its lanes. The pure parts (scheduler, row budget, packed forwards) are in
tests/test_batch_budget.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from adaptivespec.batch import BatchEngine, CostTable, Request, Status
from adaptivespec.batch.request import Sampling
from adaptivespec.config import load_config
from adaptivespec.decode import Engine

from shared_prompts import PROMPTS

pytestmark = pytest.mark.model

ROOT = Path(__file__).parents[1]
N = 24
"""max_new_tokens of the lossless runs."""
REPEAT = "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape."
TEXTS = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], REPEAT]
"""Five prompts of different lengths (REPEAT gives retrieval something to copy)."""
SLOTS = 3



def drafted(r) -> list:
    """A request's records of the steps that drafted for it (the row budget's plain steps left out)."""
    return [x for x in r.records if x.undrafted is None]

def config(name: str, *overrides: str):
    return load_config(ROOT / "configs" / name, overrides=["runtime.dtype=float32", *overrides])


def linear_costs(ms_per_row: float, fixed: float = 20.0, draft: float = 0.5) -> CostTable:
    """A synthetic cost table (no calibration in tests): verify(r) = fixed + ms_per_row * (r - 1)."""
    top = fixed + ms_per_row * 511
    return CostTable(rows=(1, 512), verify_short=(fixed, top), verify_long=(fixed, top), contexts=(128, 1024),
                     per_request=0.1, draft_rows=(1, 128), draft=(draft, draft), machine={"cpu": "synthetic"})


TYPICAL = linear_costs(0.5)
"""Rows cost something: the budget cuts the trees' unlikely nodes and keeps the likely ones."""
_ROWS = tuple(range(1, 601))
_GEOMETRIC = tuple(20.0 * 2.5 ** r for r in _ROWS)
STEEP = CostTable(rows=_ROWS, verify_short=_GEOMETRIC, verify_long=_GEOMETRIC, contexts=(128, 1024), per_request=0.1,
                  draft_rows=(1, 128), draft=(0.5, 0.5), machine={"cpu": "synthetic"})
"""Each row multiplies the step's cost by 2.5, more than any node can add to the N tokens the step
brings anyway ((N + S) / N <= 2): every tree is cut to its root (plain batched decoding), but for
the rows that fill the forward's padding (beyond 8 rows it runs a multiple of 8: those cost nothing
more). A linear
table would not do: beside a 64-row prompt chunk one more row adds ~1.5% to the step, and a node
with S > 0.03 pays for it, however dear the row."""
FLAT = linear_costs(0.0)
"""Rows cost nothing: every candidate node is verified."""

CONFIGS = {  # name: (config file, overrides, cost table or None, pinned: every step drafts)
    "ar": ("ar.yaml", (), None, False),
    "eagle3": ("eagle3.yaml", (), None, False),
    "hybrid": ("hybrid.yaml", (), None, False),
    "batched": ("batched.yaml", (), TYPICAL, False),
    "batched-hybrid": ("batched-hybrid.yaml", (), TYPICAL, False),
    "batched-spec": ("batched.yaml", (), TYPICAL, True),
    "batched-hybrid-spec": ("batched-hybrid.yaml", (), TYPICAL, True),
    "batched-steep": ("batched.yaml", (), STEEP, False),
    "batched-hybrid-flat": ("batched-hybrid.yaml", (), FLAT, True),
    "dcs": ("adaptivespec-dynamic.yaml", (), None, False),
    "cost-aware": ("cost-aware.yaml", (), None, False),
    "talon": ("talon.yaml", (), None, False),
    # FLy's window shortened to fit the 3-level tree, so that it can really keep a mismatch (lossy)
    "fly": ("fly.yaml", ("verifier.window=3",), None, False),
}
"""Pinned engines draft at every step: whether a step drafts at all is the budget's decision from
measured step times (RowBudget.speculate), so without the pin which steps draft depends on the
machine's load; the tokens do not (lossless either way), the trees do."""


def pin_speculation(budget, drafts: bool = True) -> None:
    """Every step drafts (the budget still cuts each tree by the goodput rule), or none does."""
    def speculate(*args, **kwargs):
        budget.mode = drafts
        return drafts

    budget.speculate = speculate


@pytest.fixture(scope="module")
def engines():
    """(name, slots) -> BatchEngine of that config, built on first use and kept for the module."""
    made: dict[tuple[str, int], BatchEngine] = {}

    def get(name: str, slots: int = SLOTS) -> BatchEngine:
        if (name, slots) not in made:
            file, overrides, costs, pinned = CONFIGS[name]
            be = BatchEngine(config(file, *overrides), slots=slots, costs=costs, context_length=256, log=lambda _: None)
            if pinned:
                pin_speculation(be.budget)
            made[name, slots] = be
        be = made[name, slots]
        for r in [*be.running, *be.waiting]:  # a failed test's leftovers must not leak into the next one
            r.cancel()
        while be.busy:
            be.step()
        return be

    return get


@pytest.fixture(scope="module")
def eos(engines):
    return engines("ar").lanes[0].engine.eos_ids


def until_idle(be: BatchEngine, limit: int = 2000) -> int:
    steps = 0
    while be.busy:
        be.step()
        steps += 1
        assert steps < limit, "the batch never finished"
    return steps


def expected_reason(ref: list[int], eos, limit: int = N) -> str:
    return "stop" if ref and ref[-1] in eos and len(ref) <= limit else "length"


def run_joining(be: BatchEngine, prompts: list[list[int]], limit: int = N, first: int = SLOTS, early_steps: int = 3,
                **request_kw) -> list[Request]:
    """``first`` requests at once; after ``early_steps`` steps the rest arrive (more than the free
    lanes: they queue, and join as earlier ones leave). Checks each request streamed what it output."""
    streamed: dict[int, list[int]] = {}

    def make(ids):
        r = Request(prompt=list(ids), max_new_tokens=limit, **request_kw)
        streamed[r.rid] = []
        r.on_tokens = streamed[r.rid].extend
        return be.submit(r)

    reqs = [make(p) for p in prompts[:first]]
    for _ in range(early_steps):
        be.step()
    assert all(r.status is not Status.WAITING for r in reqs) and not any(r.done for r in reqs)
    assert any(r.out for r in reqs)  # mid-generation
    late = [make(p) for p in prompts[first:]]
    queued = False
    while be.busy:
        be.step()
        assert len(be.running) <= be.scheduler.slots
        queued |= any(r.status is Status.WAITING for r in late)  # a step ran without it: every lane was taken
    assert queued or len(prompts) <= be.scheduler.slots  # late arrivals really waited for a lane
    reqs += late
    for r in reqs:
        assert r.done and streamed[r.rid] == r.out and r.stats()["new_tokens"] == len(r.out)
    return reqs


# -- 1. lossless as if alone ------------------------------------------------------------------------------
LOSSLESS = [name for name in CONFIGS if name != "fly"]


@pytest.mark.parametrize("name", LOSSLESS)
def test_every_request_decodes_as_greedy_alone(name, engines, greedy_reference, eos):
    """Prompts of different lengths, more of them than lanes, the later ones arriving mid-generation:
    each request's tokens are transformers' greedy ones."""
    be = engines(name)
    refs = [greedy_reference(text, N) for text in TEXTS]
    chosen: list[tuple[int, int, int]] = []  # (rows the budget chose, candidate rows it had, rows spent anyway)
    if be.budget is not None:
        choose = be.budget.choose

        def spy(scores, depths, **kw):
            c = choose(scores, depths, **kw)
            chosen.append((c.rows, sum(s.shape[0] - 1 for s in scores), kw["base_rows"]))
            return c

        be.budget.choose = spy
    try:
        reqs = run_joining(be, [ids for ids, _ in refs])
    finally:
        if be.budget is not None:
            del be.budget.choose
    for r, (ids, ref), text in zip(reqs, refs, TEXTS):
        assert r.out == ref, (name, text)
        assert r.finish_reason == expected_reason(ref, eos), text
    records = [rec for r in reqs for rec in r.records]
    if name == "ar":
        assert all(rec.undrafted == "autoregressive" and rec.tree_size == 1 for rec in records)
        assert all(r.forwards == len(r.out) == len(r.records) + 1 for r in reqs)  # one row, one token, per step
        return
    if name == "batched-steep":  # no row that costs anything is bought: only the forward's padding is filled
        from adaptivespec.fastpath.batched import padded_rows

        assert chosen and all(padded_rows(base + rows) == padded_rows(base) for rows, _, base in chosen)
        assert any(rows == 0 for rows, _, _ in chosen)
        return
    if name in ("batched", "batched-hybrid"):  # drafting or not: the machine's timings decide (see CONFIGS)
        return
    tokens, forwards = sum(len(r.out) for r in reqs), sum(r.forwards for r in reqs)
    assert tokens / forwards > 1.3, (name, tokens / forwards)  # drafts were really accepted in the batch
    assert len(records) == forwards - len(reqs)  # every step after the prefill verified a tree
    assert max(rec.signals.batch_size for rec in records) == SLOTS  # what a policy reads of the batch
    if name == "batched-hybrid-flat":  # every candidate node verified
        assert chosen and all(rows == cand for rows, cand, _ in chosen)
    if name.endswith("-spec"):  # the budget cut some trees, kept others whole or in part
        assert any(0 < rows < cand for rows, cand, _ in chosen), chosen
    if "hybrid" in name:
        sources = Counter()
        for rec in records:
            sources.update(rec.accepted_by_source or {})
        assert sources["retrieval"] > 0, sources  # retrieval candidates were fused and accepted per request
    if name == "dcs":
        assert len({rec.shape for rec in records}) >= 2  # the policy really switched shapes within the batch
    if name in ("eagle3", "batched-hybrid-flat"):
        # beyond the tokens: with static trees (or every node verified) each request drafts and accepts as
        # it does alone, step by step: the head's per-request state (cache, root) followed it in the batch
        alone = Engine(config(CONFIGS[name][0]), structured=True)
        for r, (ids, ref) in zip(reqs[:2], refs):
            solo = alone.generate_ids(ids, max_new_tokens=N)
            assert [x.accepted for x in drafted(r)] == [x.accepted for x in solo.records], name
            assert [x.tree_size for x in drafted(r)] == [x.tree_size for x in solo.records], name


def test_head_follows_steps_that_verify_no_draft(engines, greedy_reference):
    """Plain batched steps of a speculative config (STEEP costs: the budget does not draft, or cuts
    the tree to its root) leave nothing out of a request's draft head: at the next step that drafts,
    its cache and root state are what the head computes over the same tokens prefilled alone."""
    be = engines("batched-steep")
    refs = [greedy_reference(text, N) for text in TEXTS[:3]]
    reqs = [be.submit(Request(prompt=ids, max_new_tokens=N)) for ids, _ in refs]
    try:
        pin_speculation(be.budget, drafts=False)
        for _ in range(5):  # the prefill, then plain steps
            be.step()
        assert all(rec.undrafted == "load" for r in reqs for rec in r.records)  # no step drafted yet
        pin_speculation(be.budget)
        be.step()  # drafts (its trees cut to the root): the head is brought up to date first
    finally:
        del be.budget.speculate
    assert all(len(drafted(r)) == 1 and drafted(r)[0].tree_size == 1 for r in reqs)
    alone = Engine(config("batched.yaml")).runtime
    for r in reqs:
        rt = r.lane.engine.runtime
        assert 2 <= len(r.out) < N and r.status is Status.DECODE
        assert rt.P == len(r.prompt) + len(r.out) - 1 == r.lane.kv.length
        assert alone.prefill(r.prompt + r.out[:-1], N) == r.out[-1]
        torch.testing.assert_close(rt.root_state.reshape(-1), alone.root_state.reshape(-1), rtol=1e-4, atol=1e-4)
        logp = rt.root_logp if rt.root_logp is not None else be.drafter.log_probs(rt.root_state)
        torch.testing.assert_close(logp.reshape(-1), alone.root_logp.reshape(-1), rtol=1e-4, atol=1e-4)
    until_idle(be)
    assert [r.out for r in reqs] == [ref for _, ref in refs]


def test_lossy_verifier_gives_each_request_what_it_gets_alone(engines):
    """FLy may keep a mismatch, so its output is not greedy's: each request's output is the one
    it gets alone (a batch of one lane), since requests in a batch do not interact."""
    batch, solo = engines("fly"), engines("fly", slots=1)
    prompts = [batch.encode(t) for t in TEXTS[1:]]
    reqs = run_joining(batch, prompts)
    for r, ids, text in zip(reqs, prompts, TEXTS[1:]):
        assert r.out, text
        alone = solo.generate_many([ids], max_new_tokens=N)[0]
        assert r.out == alone.token_ids, text
        assert r.finish_reason == alone.stats["finish_reason"]


# -- 2. cancellation -------------------------------------------------------------------------------------
def test_cancelled_requests_leave_at_the_next_step(engines, greedy_reference):
    be = engines("eagle3")
    refs = [greedy_reference(text, N) for text in TEXTS]
    reqs = [be.submit(Request(prompt=ids, max_new_tokens=N)) for ids, _ in refs]
    a, b, c, d, e = reqs
    be.step()
    be.step()
    assert b.status is Status.DECODE and b.out and d.status is e.status is Status.WAITING
    lane, before = b.lane, list(b.out)
    b.cancel()  # running: its lane goes to the first waiter at the next step
    e.cancel()  # waiting: it never runs
    ended = be.step()
    assert b in ended and e in ended
    assert b.done and b.finish_reason == "cancelled" and b.out == before and b.lane is None
    assert e.done and e.finish_reason == "cancelled" and e.out == [] and e.started is None and e.lane is None
    assert d.lane is lane and d.status is not Status.WAITING and d not in be.waiting
    assert before == refs[1][1][: len(before)]
    until_idle(be)
    for r, (ids, ref) in zip((a, c, d), (refs[0], refs[2], refs[3])):
        assert r.out == ref and r.finish_reason in ("stop", "length")
    assert b.out == before and e.out == []  # nothing more after leaving
    assert be.result(b).stats["finish_reason"] == "cancelled"


# -- 3. stop ids and max_new_tokens -------------------------------------------------------------------------
def test_stop_ids_and_limits(engines, greedy_reference, eos):
    be = engines("eagle3")
    reqs, expect = [], []
    for k, text in enumerate(TEXTS[:4]):
        ids, ref = greedy_reference(text, N)
        # a token that first appears at position 3 + k: the output ends right after it
        j = next(j for j in range(3 + k, N) if ref.index(ref[j]) == j and ref[j] not in eos)
        reqs.append(Request(prompt=ids, max_new_tokens=N, stop_ids=frozenset({ref[j]})))
        expect.append((ref[: j + 1], "stop"))
    ids, ref = greedy_reference(TEXTS[4], N)
    for limit in (1, 2, 7):
        reqs.append(Request(prompt=ids, max_new_tokens=limit))
        expect.append((ref[:limit], "length"))
    never = next(i for i in range(100, 200) if i not in ref)
    reqs.append(Request(prompt=ids, max_new_tokens=N, stop_ids=frozenset({never})))
    expect.append((ref, expected_reason(ref, eos)))
    for r in reqs:
        be.submit(r)
    until_idle(be)
    for r, (out, reason) in zip(reqs, expect):
        assert (r.out, r.finish_reason) == (out, reason)


# -- 4. structured output beside free text -----------------------------------------------------------------
def test_json_schema_request_beside_free_text(engines, greedy_reference):
    pytest.importorskip("xgrammar")
    import jsonschema

    from adaptivespec.response_format import ResponseFormat
    from test_structured import PROMPT, SCHEMA

    be = engines("hybrid")
    fmt = ResponseFormat(type="json_schema", schema=SCHEMA)
    ids = be.lanes[0].engine.encode(PROMPT)
    alone = Engine(config("ar.yaml"), structured=True).generate_ids(ids, max_new_tokens=64, response_format=fmt)
    free = [greedy_reference(t, N) for t in TEXTS[:3]]
    reqs = [be.submit(Request(prompt=free[0][0], max_new_tokens=N)),
            be.submit(Request(prompt=ids, max_new_tokens=64, response_format=fmt)),
            be.submit(Request(prompt=free[1][0], max_new_tokens=N))]
    for _ in range(3):
        be.step()
    reqs.append(be.submit(Request(prompt=free[2][0], max_new_tokens=N)))  # free text joins mid-way too
    until_idle(be)
    constrained = reqs[1]
    assert constrained.out == alone.token_ids and len(constrained.out) < 64
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(be.result(constrained).text), SCHEMA)
    for r, (_, ref) in zip((reqs[0], reqs[2], reqs[3]), free):
        assert r.out == ref  # the grammar stayed with its own request
    by_source = Counter()
    for rec in constrained.records:
        by_source.update(rec.accepted_by_source or {})
    assert by_source["grammar"] > 0, by_source  # the grammar's forced tokens were drafted in the batch


# -- 5. sampling ---------------------------------------------------------------------------------------
SEEDED = [(0, 7), (0, 8), (1, None), (2, 7), (0, 7)]
"""(prompt index in TEXTS, seed; None: a greedy request among the sampled ones)."""


def seeded_batch(be: BatchEngine, prompts, limit: int = 10) -> list[Request]:
    """SEEDED's requests (temperature 1 of their own), the last two arriving after the first step."""
    def request(i, seed):
        return Request(prompt=prompts[i], max_new_tokens=limit, seed=seed,
                       sampling=Sampling(temperature=1.0) if seed is not None else None)

    reqs = [be.submit(request(i, s)) for i, s in SEEDED[:3]]
    be.step()
    reqs += [be.submit(request(i, s)) for i, s in SEEDED[3:]]
    until_idle(be)
    return reqs


@pytest.mark.parametrize("name", ["ar", "eagle3"])
def test_sampled_requests_follow_their_own_seeds(name, engines, greedy_reference):
    """A request's draws come from its own generator, seeded with its own seed: the same seed gives the
    same tokens in a batch as alone in a batch of one; other seeds, other tokens; a greedy request
    beside sampled ones stays greedy."""
    be, solo = engines(name), engines(name, slots=1)
    refs = [greedy_reference(t, N) for t in TEXTS[:3]]
    prompts = [ids for ids, _ in refs]
    batch = seeded_batch(be, prompts)
    for r, (i, seed) in zip(batch, SEEDED):
        one = solo.submit(Request(prompt=prompts[i], max_new_tokens=10, seed=seed, sampling=r.sampling))
        until_idle(solo)
        assert r.out == one.out, seed
    assert batch[2].out == refs[1][1][:10]
    assert batch[0].out == batch[4].out  # same prompt, same seed
    assert batch[0].out != batch[1].out  # another seed, another sample
    if name == "eagle3":  # static trees: the very draws of Engine.generate_ids with that seed
        engine = Engine(config("eagle3.yaml", "generation.temperature=1.0"))
        for r, (i, seed) in zip(batch, SEEDED):
            if seed is not None:
                assert r.out == engine.generate_ids(prompts[i], max_new_tokens=10, seed=seed).token_ids, seed


def test_plain_sampling_draws_as_engine_generate_ids(engines, greedy_reference):
    """A sampled plain row is drawn as Engine.ar_step draws it: the same seed gives the same tokens
    in a batch as alone (serve --parallel N as --parallel 1)."""
    prompts = [greedy_reference(t, N)[0] for t in TEXTS[:3]]
    batch = seeded_batch(engines("ar"), prompts)
    engine = Engine(config("ar.yaml", "generation.temperature=1.0"))
    for r, (i, seed) in zip(batch, SEEDED):
        if seed is not None:
            assert r.out == engine.generate_ids(prompts[i], max_new_tokens=10, seed=seed).token_ids, seed


def test_speculative_sampling_in_a_batch_is_exact(engines):
    """Two sampled tokens (temperature 1, top-k 3: nine outcomes) of 150 requests through the row
    budget's cut trees, against the exact joint law computed from the target; greedy requests share
    the batch and stay greedy."""
    from test_sampling import chi_square_pvalue

    from adaptivespec.sampling import warp

    be = engines("batched-spec", slots=8)
    tok = be.tokenizer
    prompt = tok("My favourite colour is", add_special_tokens=False).input_ids
    greedy_prompt = tok("One, two, three, four,", add_special_tokens=False).input_ids
    with torch.inference_mode():
        law = lambda logits: warp(logits, 1.0, top_k=3).softmax(-1)  # noqa: E731
        p1 = law(be.target(torch.tensor([prompt])).logits[0, -1].float())
        firsts = p1.nonzero().squeeze(1).tolist()
        nxt = be.target(torch.tensor([prompt + [t] for t in firsts])).logits[:, -1].float()
        joint = {(t1, t2): float(p1[t1] * q) for t1, row in zip(firsts, law(nxt)) for t2, q in enumerate(row.tolist())
                 if q > 0}
        cold = {}  # the law at temperature 0.3: a test that cannot tell it apart would have no power
        c1 = warp(be.target(torch.tensor([prompt])).logits[0, -1].float(), 0.3, top_k=3).softmax(-1)
        for t1, row in zip(firsts, warp(nxt, 0.3, top_k=3).softmax(-1)):
            cold.update({(t1, t2): float(c1[t1] * q) for t2, q in enumerate(row.tolist()) if q > 0})
    sampling = Sampling(temperature=1.0, top_k=3)
    draws = 150
    reqs, greedy = [], []
    for i in range(draws):
        if i % 75 == 1:  # greedy requests among the sampled ones
            greedy.append(be.submit(Request(prompt=greedy_prompt, max_new_tokens=8)))
        reqs.append(be.submit(Request(prompt=prompt, max_new_tokens=2, seed=1000 + i, sampling=sampling)))
    until_idle(be)
    counts = Counter(tuple(r.out) for r in reqs)
    assert set(counts) <= set(joint), set(counts) - set(joint)  # only tokens the request's own top-k allows
    assert len(counts) >= 5
    assert sum(r.records[0].tree_size > 1 for r in reqs) > draws / 2  # most second tokens came from a verified tree
    assert chi_square_pvalue(counts, joint, draws) > 1e-3, counts
    assert chi_square_pvalue(counts, cold, draws) < 1e-3
    alone = Engine(config("batched.yaml")).generate_ids(greedy_prompt, max_new_tokens=8).token_ids
    assert greedy[0].out == greedy[1].out == alone


# -- 6. a long prompt joining while others decode ---------------------------------------------------------
def test_long_prompt_is_read_in_chunks_while_others_decode(greedy_reference):
    """With batch.prefill_rows 8, a prompt of 64 tokens arriving while two requests decode is read
    8 rows per step, the others decoding at every one of those steps; every output is greedy's, and
    the long request drafts and accepts as it does alone (the head followed its chunks, after the
    rows of the prefix it took from the cache). It also outgrows the lanes' reserved context (80
    positions), so it runs on caches of its own."""
    be = BatchEngine(config("eagle3.yaml", "batch.prefill_rows=8"), slots=3, context_length=80, log=lambda _: None)
    plans = []
    plan = be.scheduler.plan
    be.scheduler.plan = lambda running, waiting: plans.append(plan(running, waiting)) or plans[-1]
    (a_ids, a_ref), (b_ids, b_ref), (l_ids, l_ref) = (greedy_reference(t, 32) for t in (PROMPTS[0], PROMPTS[2], PROMPTS[3]))
    assert len(l_ids) > 40
    a, b = (be.submit(Request(prompt=p, max_new_tokens=32)) for p in (a_ids, b_ids))
    while not (a.status is b.status is Status.DECODE):
        be.step()
    start = len(plans)
    long = be.submit(Request(prompt=l_ids, max_new_tokens=32))
    until_idle(be)
    # its system prompt (the chat template's) is the one a's prompt opened with, kept once read: the
    # step that finds it plans again, from there (the first plan's chunk from 0 is not run)
    assert long.cached >= 16
    chunks = [(p, c) for p in plans[start:] for c in p.chunks if c.request is long and c.start >= long.cached]
    assert [c.start for _, c in chunks] == [long.cached] + [c.end for _, c in chunks[:-1]]  # contiguous, in order
    assert chunks[-1][1].end == len(l_ids) and chunks[-1][1].last
    for p, c in chunks:
        if p.decoders:  # others decoding: 8 rows at most
            assert c.end - c.start == min(8, len(l_ids) - c.start)
    assert sum(bool(p.decoders) for p, _ in chunks) >= 3  # read over several steps beside the decoders
    assert (a.out, b.out, long.out) == (a_ref, b_ref, l_ref)
    solo = Engine(config("eagle3.yaml")).generate_ids(l_ids, max_new_tokens=32)
    assert [x.accepted for x in drafted(long)] == [x.accepted for x in solo.records]


def test_a_prompt_read_over_plain_and_drafting_steps_reaches_the_head_in_order(greedy_reference):
    """A prompt read in 8-row chunks while steps alternate between plain and drafting (the budget's
    choice under load): a chunk of a drafting step waits behind the chunks plain steps left for the
    head, so at its first draft the request's head has every position, in order, as alone (before,
    such a chunk ran at once and the catch-up then wrote the earlier chunks over it)."""
    be = BatchEngine(config("batched.yaml", "batch.prefill_rows=8"), slots=2, costs=TYPICAL, context_length=96,
                     log=lambda _: None)
    flips = iter([False, True] * 200)

    def speculate(*args, **kwargs):
        be.budget.mode = next(flips)
        return be.budget.mode

    be.budget.speculate = speculate
    (a_ids, a_ref), (l_ids, l_ref) = (greedy_reference(t, 32) for t in (PROMPTS[0], PROMPTS[3]))
    a = be.submit(Request(prompt=a_ids, max_new_tokens=32))
    while a.status is not Status.DECODE:
        be.step()
    long = be.submit(Request(prompt=l_ids, max_new_tokens=32))
    chunks = 0
    while long.status is not Status.DECODE:
        be.step()
        chunks += 1
    assert chunks >= 4  # read over plain and drafting steps alike
    while not drafted(long):  # its first drafting step brings the head up to date
        be.step()
    rt, lane = long.lane.engine.runtime, long.lane
    assert rt.P == len(l_ids) + len(long.out) - 1 == lane.kv.length
    alone = Engine(config("batched.yaml")).runtime
    assert alone.prefill(l_ids + long.out[:-1], 32) == long.out[-1]
    torch.testing.assert_close(rt.root_state.reshape(-1), alone.root_state.reshape(-1), rtol=1e-4, atol=1e-4)
    until_idle(be)
    assert (a.out, long.out) == (a_ref, l_ref)


def test_an_exploring_step_drafts_for_one_request_in_eight_and_stays_lossless(engines, greedy_reference, monkeypatch):
    """Exploring (a speculative step among plain ones, to see what the head accepts now) drafts for
    one request in EXPLORE_GROUP: here 1 of 3, taking turns by lane; the others decode plainly in the
    same forward, their heads left behind. Steps alternate plain and exploring to the end, and every
    output is greedy's."""
    be = engines("batched-hybrid")
    refs = [greedy_reference(text, N) for text in TEXTS[:3]]
    reqs = [be.submit(Request(prompt=ids, max_new_tokens=N)) for ids, _ in refs]
    modes = iter([])

    def speculate(*args, **kwargs):
        be.budget.mode = be.budget.exploring = next(modes, False)
        return be.budget.mode

    monkeypatch.setattr(be.budget, "speculate", speculate)
    while not all(r.status is Status.DECODE for r in reqs):  # the prompts, then a plain step
        be.step()
    be.step()
    modes = iter([True, False] * 100)
    turns = []
    for _ in range(3):  # three exploring steps: each drafts for one request, each request in turn
        before = [len(drafted(r)) for r in reqs]
        be.step()
        now = [r for r, n in zip(reqs, before) if len(drafted(r)) > n]
        assert len(now) == 1 and not now[0].lane.pending  # its head caught up to draft
        assert all(r.lane.pending for r in reqs if r is not now[0])  # the others' still behind
        turns.append(now[0])
        be.step()  # plain
    assert sorted(r.rid for r in turns) == sorted(r.rid for r in reqs)
    until_idle(be)
    assert [r.out for r in reqs] == [ref for _, ref in refs]
