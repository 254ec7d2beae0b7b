"""The batch engine's pure parts, no embedded model: the scheduler's plans, the row budget's goodput
rule on hand-made scores (worked numbers), its calibration, the cost table, padded row counts,
subtrees, and the packed forwards checked part by part against the same pieces run alone (a tiny
random float32 Llama built here)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from adaptivespec.batch import CostTable, Request, RowBudget, Scheduler, Status
from adaptivespec.batch.budget import Calibration
from adaptivespec.fastpath.batched import (DraftKV, DraftPart, Part, bound, layer_pieces, packed_draft_step, packed_forward,
                                           padded_rows)
from adaptivespec.tree import make_tree, subtree


# -- Scheduler.plan --------------------------------------------------------------------------------
def req(n: int, status: Status = Status.WAITING, prefilled: int = 0, cancelled: bool = False) -> Request:
    """A request for the planner, on a stand-in lane whose runtime holds its computed positions (``P``:
    what ``Request.prefilled`` reads)."""
    r = Request(prompt=list(range(n)), max_new_tokens=8)
    r.lane = SimpleNamespace(engine=SimpleNamespace(runtime=SimpleNamespace(P=0)), index=0)
    r.status, r.prefilled, r.cancelled = status, prefilled, cancelled
    return r


def spans(plan):
    return [(c.request, c.start, c.end) for c in plan.chunks]


def test_waiting_requests_join_free_slots_first_in_first_out():
    s = Scheduler(2, prefill_rows=4, prefill_chunk=16, max_rows=64)
    a, b, c = req(20), req(10), req(5)
    plan = s.plan([], [a, b, c])
    assert plan.joins == (a, b) and plan.leaves == () and plan.decoders == ()
    # nobody decodes: each prompt reads up to prefill_chunk rows, in arrival order
    assert spans(plan) == [(a, 0, 16), (b, 0, 10)]
    assert [ch.last for ch in plan.chunks] == [False, True]
    assert plan.rows == 26 and not plan.idle
    # a slot that stays taken takes no newcomer
    a.status, a.prefilled = Status.PREFILL, 16
    b.status, b.prefilled = Status.DECODE, 10
    plan = s.plan([a, b], [c])
    assert plan.joins == () and plan.decoders == (b,)
    assert spans(plan) == [(a, 16, 20)] and plan.chunks[0].last
    assert plan.rows == 4 + 1


def test_prompt_rows_are_capped_while_others_decode():
    s = Scheduler(3, prefill_rows=4, prefill_chunk=16, max_rows=64)
    d, p, w = req(6, Status.DECODE, 6), req(20, Status.PREFILL, 3), req(9)
    plan = s.plan([d, p], [w])
    assert plan.joins == (w,) and plan.decoders == (d,)
    # 4 prompt rows in all while d decodes: p's next chunk takes them, w (joined) waits for a later step
    assert spans(plan) == [(p, 3, 7)]
    assert plan.rows == 5
    w.status = Status.PREFILL  # as the engine's join does
    # the long prompt is read over several steps, each chunk starting where the last ended
    starts = []
    while p.prefilled < len(p.prompt):
        plan = s.plan([d, p, w], [])
        c = plan.chunks[0]
        assert c.request is p and c.start == p.prefilled and c.end - c.start == min(4, 20 - c.start)
        starts.append(c.start)
        p.prefilled = c.end
    assert starts == [3, 7, 11, 15, 19]
    p.status = Status.DECODE
    assert spans(s.plan([d, p, w], [])) == [(w, 0, 4)]


def test_max_rows_bounds_prompt_rows_with_and_without_decoders():
    s = Scheduler(8, prefill_rows=4, prefill_chunk=0, max_rows=6)  # prefill_chunk 0: max_rows per prompt
    decoders = [req(3, Status.DECODE, 3) for _ in range(4)]
    p = req(10, Status.PREFILL)
    plan = s.plan([*decoders, p], [])
    assert spans(plan) == [(p, 0, 2)] and plan.rows == 6  # 6 rows in all: 4 roots + 2 prompt rows
    # nobody decoding: up to max_rows, the second prompt gets what is left
    q = req(10)
    plan = s.plan([p], [q])
    assert spans(plan) == [(p, 0, 6)] and plan.joins == (q,)
    q.status, p.prefilled = Status.PREFILL, 6
    assert spans(s.plan([p, q], [])) == [(p, 6, 10), (q, 0, 2)]
    # more decoders than max_rows: no prompt rows at all
    crowd = [req(3, Status.DECODE, 3) for _ in range(7)]
    assert s.plan([*crowd, p], []).chunks == ()


def test_prompt_rows_may_be_a_function_of_the_step():
    """``prefill_rows`` as a function: asked with the decoders' root rows, the first prompt's tokens
    already read and the number of prompts being read, only when someone decodes."""
    asked = []
    s = Scheduler(4, prefill_rows=lambda base, past, prompts: asked.append((base, past, prompts)) or 5,
                  prefill_chunk=16, max_rows=64)
    d, p = req(6, Status.DECODE, 6), req(20, Status.PREFILL, 3)
    assert spans(s.plan([d, p], [])) == [(p, 3, 8)] and asked == [(1, 3, 1)]
    w = req(9)
    assert spans(s.plan([d, p], [w])) == [(p, 3, 8)] and asked[-1] == (1, 3, 2)  # the joining prompt counts
    q = req(30)
    assert spans(s.plan([], [q])) == [(q, 0, 16)] and len(asked) == 2  # nobody decodes: prefill_chunk


def test_chunk_rows_keep_the_step_within_the_stall_factor():
    """prompt_chunk_rows (batch.prefill_rows 0) on a hand-made table: verify(r) = 9 + r ms at no
    context, twice the slope's worth more at 1000 keys (10 + r - 1 more). Three roots cost 12 ms:
    within 3x (36 ms), 24 prompt rows at no context (12 + 24 = 36), 8 when the chunk reads 1000 keys
    (8 rows: 20 * (1 + 8/11) = 34.5; 16 rows: 28 * (1 + 16/19) = 51.6 > 36); three prompts being
    read: within 1 + 2 * 3 = 7x (84 ms), 72 rows (12 + 72 = 84)."""
    from adaptivespec.batch.budget import PREFILL_ROWS_UNMEASURED, prompt_chunk_rows

    costs = CostTable(rows=(1, 101), verify_short=(10.0, 110.0), verify_long=(20.0, 220.0), contexts=(0, 1000),
                      per_request=0.0, draft_rows=(), draft=())

    def rows(base, past=0, stall=3.0, max_rows=512, table=costs, prompts=1):
        return prompt_chunk_rows(table, max_rows, stall, base, past, prompts)

    assert rows(3) == 24
    assert rows(3, prompts=3) == 72  # each further prompt being read may stall the step by as much again
    assert rows(3, past=1000) == 8
    assert rows(3, stall=1.1) == 8  # at least 8, even past the stall
    assert rows(3, stall=100.0, max_rows=40) == 40  # never beyond max_rows
    assert rows(3, table=None) == PREFILL_ROWS_UNMEASURED


def test_cancelled_requests_leave_and_free_their_slots():
    s = Scheduler(2, prefill_rows=4, prefill_chunk=16, max_rows=64)
    gone = req(5, Status.DECODE, 5, cancelled=True)
    stay = req(5, Status.DECODE, 5)
    dropped, nxt = req(5, cancelled=True), req(7)
    plan = s.plan([gone, stay], [dropped, nxt])
    assert set(plan.leaves) == {gone, dropped}
    assert plan.joins == (nxt,)  # the cancelled one's slot, taken this step; the cancelled waiter never joins
    assert plan.decoders == (stay,)
    assert spans(plan) == [(nxt, 0, 4)]
    assert s.plan([], []).idle


# -- the cost table ---------------------------------------------------------------------------------
def table(**kw) -> CostTable:
    base = dict(rows=(1, 8, 16), verify_short=(10.0, 12.0, 16.0), verify_long=(20.0, 22.0, 26.0), contexts=(128, 1024),
                per_request=0.5, draft_rows=(1, 9), draft=(1.0, 3.0), machine={"cpu": "test"})
    base.update(kw)
    return CostTable(**base)


def test_cost_table_interpolates_and_extrapolates():
    t = table()
    assert t.verify(1, 128) == pytest.approx(10.0)
    assert t.verify(4, 128) == pytest.approx(10 + 3 * 2 / 7)  # between measured rows
    assert t.verify(24, 128) == pytest.approx(16 + 8 * 0.5)  # beyond the last: the last segment's slope
    assert t.verify(8, 576) == pytest.approx(17.0)  # half way between the two contexts
    assert t.verify(8, 2048, requests=3) == pytest.approx(12 + (2048 - 128) / 896 * 10 + 2 * 0.5)  # extrapolated context
    assert t.verify(8, 128, requests=1) == t.verify(8, 128, requests=0) == pytest.approx(12.0)
    arr = t.verify([1, 4, 24], 128)
    assert arr.tolist() == pytest.approx([10.0, 10 + 6 / 7, 20.0])
    assert t.draft_level(5) == pytest.approx(2.0) and t.draft_level(13) == pytest.approx(4.0)
    assert table(draft_rows=(), draft=()).draft_level(8) == 0.0


def test_cost_table_round_trips_through_json():
    t = table()
    back = CostTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    assert t.to_dict()["version"] >= 1
    assert isinstance(back.rows, tuple) and isinstance(back.contexts, tuple)
    assert "verify" in t.summary()


# -- the goodput rule ---------------------------------------------------------------------------------
def linear(ms_per_row: float, fixed: float = 10.0) -> CostTable:
    """verify(r) = fixed + ms_per_row * (r - 1) at any context, nothing per request, no draft cost."""
    top = fixed + ms_per_row * 100
    return CostTable(rows=(1, 101), verify_short=(fixed, top), verify_long=(fixed, top), contexts=(128, 1024),
                     per_request=0.0, draft_rows=(), draft=())


def choose(budget, scores, depths, base_rows=2, **kw):
    kw = {"decoders": len(scores), "requests": len(scores), "context": 128.0, "draft_ms": 0.0, **kw}
    return budget.choose([torch.tensor(s) for s in scores], [torch.tensor(d) for d in depths], base_rows=base_rows, **kw)


SCORES = [[1.0, 0.9, 0.5, 0.2], [1.0, 0.8, 0.05]]  # request 0: a chain; request 1: two children of the root
DEPTHS = [[0, 1, 2, 3], [0, 1, 1]]


def test_goodput_rule_worked_example():
    """Ranking 0.9, 0.8, 0.5, 0.2, 0.05; 2 root rows; verify(r) = 10 + (r - 1) ms, so B rows cost 11 + B:
    rates 2/11, 2.9/12, 3.7/13, 4.2/14 = 0.300, 4.4/15 = 0.293, 4.45/16: B* = 3."""
    c = choose(RowBudget(linear(1.0), max_rows=512), SCORES, DEPTHS)
    assert c.rows == 3
    assert [k.tolist() for k in c.keep] == [[0, 1, 2], [0, 1]]
    assert c.expected_tokens == pytest.approx(4.2) and c.step_ms == pytest.approx(14.0)
    # the draft's cost counts in the denominator: 10 ms of drafting make the 4th node pay
    # (4.2/24 = 0.1750 < 4.4/25 = 0.1760 > 4.45/26 = 0.1712)
    c = choose(RowBudget(linear(1.0), max_rows=512), SCORES, DEPTHS, draft_ms=10.0)
    assert c.rows == 4 and [k.tolist() for k in c.keep] == [[0, 1, 2, 3], [0, 1]]
    assert c.step_ms == pytest.approx(25.0)
    # rows are priced as the forward runs them, padded to the bucket: 40 rows already spent (prompt
    # chunks) run 40 rows alone (49 ms) and 48 with any drafted row (57 ms), so every node up to the
    # bucket's end rides along: 4.45/57 = 0.078 against 2/49 = 0.041
    c = choose(RowBudget(linear(1.0), max_rows=512), SCORES, DEPTHS, base_rows=40)
    assert c.rows == 5 and c.step_ms == pytest.approx(57.0)


def test_steep_rows_cut_every_tree_to_its_root_and_flat_rows_keep_everything():
    steep = choose(RowBudget(linear(1e4), max_rows=512), SCORES, DEPTHS)
    assert steep.rows == 0 and [k.tolist() for k in steep.keep] == [[0], [0]]
    assert steep.expected_tokens == pytest.approx(2.0)
    flat = choose(RowBudget(linear(0.0), max_rows=512), SCORES, DEPTHS)
    assert flat.rows == 5 and [k.tolist() for k in flat.keep] == [[0, 1, 2, 3], [0, 1, 2]]
    # max_rows bounds the rows: 2 roots + at most 2 drafted
    capped = choose(RowBudget(linear(0.0), max_rows=4), SCORES, DEPTHS)
    assert capped.rows == 2 and [k.tolist() for k in capped.keep] == [[0, 1], [0, 1]]


def speculating(tau: float, base_rows: int, decoders: int = 4, **kw) -> RowBudget:
    """A budget over verify(r) = 10 + (r - 1) ms that expects ``tau`` tokens per request from a
    speculative step of 2 draft rows per request, 4 ms dearer in overhead; asked about one step."""
    b = RowBudget(linear(1.0), max_rows=512)
    b.tau, b.rows_per_request, b.overhead = tau, 2.0, {True: 4.0, False: 0.0}
    for k, v in kw.items():
        setattr(b, k, v)
    b.speculate(decoders, base_rows, 128.0, decoders + (base_rows > decoders))
    return b


def test_drafting_is_weighed_by_what_it_adds_against_plain_steps():
    """4 decoders, 8 draft rows. Without prompt rows: a plain step is verify(4) = 13 ms for 4 tokens
    (0.308/ms); a speculative one verify(16) + 4 = 29 ms (12 rows padded to 16). tau 3: 12/29 = 0.414
    drafts; tau 1.5: 6/29 = 0.207 does not. With 36 prompt rows beside them (40 rows: 49 ms; 48 with
    the drafts: 61 ms), the old step-rate rule drafted at tau 1.5 (6/61 = 0.098 > 4/49 = 0.082, the
    prompt's rows make the drafts look cheap); what drafting adds, 2 tokens for 12 ms (0.167), buys
    less than those 12 ms of plain steps (0.308): plain. At tau 3 it adds 8 for 12 ms: drafts."""
    assert speculating(3.0, 4).mode and not speculating(1.5, 4).mode
    assert speculating(3.0, 40).mode and not speculating(1.5, 40).mode
    spec, plain = RowBudget.predicted_rates(speculating(1.5, 40), 4, 40, 128.0, 5)
    assert spec == pytest.approx(2 / 12) and plain == pytest.approx(4 / 13)


def test_the_heads_rows_to_run_first_are_a_cost_of_drafting():
    """As above, tau 3 without prompt rows: drafting adds 8 tokens for 16 ms (0.5/ms against 0.308)
    and drafts. If the heads must first run 200 rows (prompts just read, or rows plain steps left
    them behind on; one head pass over them: 0.1 ms a row, 20 ms), it adds 8 for 36 ms (0.222): plain."""
    costs = attrs.evolve(linear(1.0), draft_rows=(1, 101), draft=(0.1, 10.1))
    b = RowBudget(costs, max_rows=512)
    b.tau, b.rows_per_request, b.overhead = 3.0, 2.0, {True: 4.0, False: 0.0}
    assert b.speculate(4, 4, 128.0, 4)
    spec, plain = b.predicted_rates(4, 4, 128.0, 4, head_rows=200)
    assert spec == pytest.approx(8 / 36) and plain == pytest.approx(4 / 13)
    assert not b.speculate(4, 4, 128.0, 4, head_rows=200)


def test_beside_prompt_rows_a_node_must_pay_what_its_rows_buy_in_plain_steps():
    """2 decoders and 46 prompt rows: 48 rows, 57 ms; any drafted row makes it 56 rows, 65 ms. Nodes
    of S 0.3, 0.25, 0.2, 0.1, 0.05 bring 0.9 tokens for those 8 ms (0.11/ms), where plain steps of
    the 2 decoders make 2 / verify(2) = 2/11 = 0.18/ms: none is verified. The step's own rate, its
    prompt rows in it, verified them all (2.9/65 = 0.045 against 2/57 = 0.035). Without prompt rows
    the same nodes pay (2.3/12 = 0.192 against 2/11 = 0.182 for the first) and the goodput rule keeps them."""
    low = [[1.0, 0.3, 0.2, 0.1], [1.0, 0.25, 0.05]]
    c = choose(RowBudget(linear(1.0), max_rows=512), low, DEPTHS, base_rows=48, requests=3)
    assert c.rows == 0 and [k.tolist() for k in c.keep] == [[0], [0]]
    assert choose(RowBudget(linear(1.0), max_rows=512), low, DEPTHS).rows > 0
    # nodes that pay beside the prompt rows still go: S 0.9 and 0.8 bring 1.7 for 8 ms (0.21/ms)
    c = choose(RowBudget(linear(1.0), max_rows=512), [[1.0, 0.9, 0.2, 0.1], [1.0, 0.8, 0.05]], DEPTHS, base_rows=48,
               requests=3)
    assert c.rows == 5  # the bucket's other rows ride along, free


def test_exploring_steps_wait_for_a_step_without_prompt_rows_and_joins_scale_the_backoff():
    b = speculating(1.5, 40, plain_run=50, explore_every=8)  # due to explore, but prompts are read
    assert not b.mode and not b.exploring
    b.speculate(4, 4, 128.0, 4)  # the next step decodes only: it explores
    assert b.mode and b.exploring
    b.explore_every = 128
    b.joined(running=8)  # one newcomer among 8: the backoff shrinks to 8 x 8, not to 8
    assert b.explore_every == 64
    b.joined(running=1)
    assert b.explore_every == 8
    b.joined(running=16)  # never grows on a join
    assert b.explore_every == 8


def test_an_exploring_step_that_drafted_for_some_teaches_tau_from_them_and_not_the_overhead():
    """16 decoders, 2 of them drafted (8 rows) and emitted 3 + 2 tokens, the other 14 one each: tau
    moves towards 2.5 (not 19 / 16), the rows per request towards 4, and the speculative overhead
    stays (the step drafted for 2 of 16: its cost is a part of a whole speculative step's). A whole
    speculative step, or a plain one, does move its mode's overhead."""
    b = speculating(1.5, 16, decoders=16, plain_run=50, explore_every=8)
    assert b.mode and b.exploring
    b.step_done(seconds_ms=60.0, rows=24, context=128.0, requests=16, decoders=16, tokens=19, draft_rows=8,
                drafting=2, drafted_tokens=5, smoothing=0.5)
    assert b.tau == pytest.approx(1.5 + 0.5 * (2.5 - 1.5)) and b.rows_per_request == pytest.approx(3.0)
    assert b.overhead == {True: 4.0, False: 0.0}
    b.mode, b.exploring = True, False
    b.step_done(seconds_ms=60.0, rows=32, context=128.0, requests=16, decoders=16, tokens=48, draft_rows=16,
                smoothing=0.5)  # every decoder drafted: verify(32) = 41 ms, 19 over; 3 tokens each
    assert b.overhead[True] == pytest.approx(4.0 + 0.5 * (19.0 - 4.0)) and b.tau == pytest.approx(2.0 + 0.5 * (3 - 2.0))


def test_the_heads_catching_up_after_plain_steps_is_not_learned_as_the_speculative_overhead():
    """A speculative step after plain ones also runs the rows the heads skipped: 60 ms, 15 of them
    the catch-up. The mode's overhead learns the other 45 (verify(32) = 41 ms: 4 over), as it
    would from a step in a run of speculative ones."""
    b = speculating(1.5, 16, decoders=16)
    b.mode, b.exploring, b.overhead = True, False, {True: 4.0, False: 0.0}
    b.step_done(seconds_ms=60.0, rows=32, context=128.0, requests=16, decoders=16, tokens=48, draft_rows=16,
                switch_ms=15.0, smoothing=0.5)
    assert b.overhead[True] == pytest.approx(4.0)
    b.step_done(seconds_ms=60.0, rows=32, context=128.0, requests=16, decoders=16, tokens=48, draft_rows=16,
                smoothing=0.5)
    assert b.overhead[True] == pytest.approx(4.0 + 0.5 * 15.0)


def random_tree(g: torch.Generator, n: int):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = torch.randint(0, 100, (n,), generator=g)
    logp = torch.zeros(n)
    for i in range(1, n):  # cumulative draft log-probability: never above the parent's
        logp[i] = logp[parents[i]] + torch.log(torch.rand((), generator=g).clamp(min=1e-3))
    return make_tree(tokens, torch.tensor(parents), draft_logp=logp)


def test_every_chosen_prefix_is_closed_under_ancestors():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        trees = [random_tree(g, int(torch.randint(1, 14, (1,), generator=g))) for _ in range(3)]
        budget = RowBudget(linear(float(torch.rand((), generator=g)) * 0.5), max_rows=512)
        est = [budget.estimates(t, None) for t in trees]
        for t, (p, kind, s) in zip(trees, est):
            assert s[0] == 1.0 and bool((s[1:] <= s[t.parents[1:]]).all())  # capped by the parent's
        c = budget.choose([e[2] for e in est], [t.depth for t in trees], base_rows=3, decoders=3, requests=3,
                          context=128.0, draft_ms=0.0)
        assert sum(k.shape[0] - 1 for k in c.keep) == c.rows
        for t, keep in zip(trees, c.keep):
            kept = set(keep.tolist())
            assert keep[0] == 0 and keep.tolist() == sorted(kept)
            assert all(int(t.parents[i]) in kept for i in kept if i), (trial, keep)
            sub = subtree(t, keep)  # a valid tree of its own
            assert sub.parents[0] == -1 and bool((sub.parents[1:] < torch.arange(1, sub.size)).all())


def test_source_only_nodes_are_calibrated_apart():
    budget = RowBudget(linear(1.0), max_rows=512)
    t = make_tree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), draft_logp=torch.log(torch.tensor([1.0, 0.75, 0.75])))
    budget.calibration.observe(torch.tensor([0.75] * 4), torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    p, kind, s = budget.estimates(t, torch.tensor([False, False, True]))
    assert kind.tolist() == [0, 0, 1]
    assert s.tolist() == pytest.approx([1.0, 0.75, 16 * 0.75 / 20])


# -- calibration ------------------------------------------------------------------------------------
def test_calibration_starts_at_the_estimate_and_learns_per_bin_and_kind():
    c = Calibration(bins=10, prior=16.0)
    p = torch.tensor([0.05, 0.75, 1.0])
    assert c(p, torch.zeros(3, dtype=torch.long)).tolist() == pytest.approx(p.tolist())
    # 4 head nodes estimated 0.75 (bin 7), one accepted: (1 + 16 * 0.75) / (4 + 16) = 0.65
    c.observe(torch.tensor([0.75, 0.72, 0.78, 0.71]), torch.zeros(4, dtype=torch.long),
              torch.tensor([True, False, False, False]))
    assert float(c(torch.tensor([0.75]), torch.tensor([0]))) == pytest.approx(0.65)
    assert float(c(torch.tensor([0.71]), torch.tensor([0]))) == pytest.approx((1 + 16 * 0.71) / 20)
    assert float(c(torch.tensor([0.75]), torch.tensor([1]))) == pytest.approx(0.75)  # the other kind: untouched
    assert float(c(torch.tensor([0.45]), torch.tensor([0]))) == pytest.approx(0.45)  # another bin: untouched
    c.observe(torch.tensor([1.0]), torch.tensor([1]), torch.tensor([True]))  # p = 1 lands in the last bin
    assert c.seen[1, 9] == 1 and c.accepted[1, 9] == 1


def test_row_budget_observes_only_the_verified_nodes():
    budget = RowBudget(linear(1.0), max_rows=512)
    p = torch.tensor([1.0, 0.95, 0.35, 0.32, 0.15])
    kind = torch.tensor([0, 0, 0, 1, 0])
    keep = torch.tensor([0, 2, 3])  # node 1 and node 4 were cut by the budget
    budget.observe(p, kind, keep, path=[0, 1])  # the verified tree's node 1 (= node 2) was accepted
    c = budget.calibration
    assert c.seen.sum() == 2 and c.accepted.sum() == 1
    assert c.seen[0, 3] == 1 and c.accepted[0, 3] == 1  # node 2: p 0.35, head, accepted
    assert c.seen[1, 3] == 1 and c.accepted[1, 3] == 0  # node 3: p 0.32, source only, rejected
    budget.observe(p, kind, torch.tensor([0]), path=[0])  # the root alone: nothing to learn
    assert c.seen.sum() == 2


# -- padded rows and subtrees ---------------------------------------------------------------------------
@pytest.mark.parametrize("rows,padded", [(1, 1), (7, 7), (8, 8), (9, 16), (63, 64), (64, 64), (65, 96), (96, 96),
                                         (97, 128), (500, 512)])
def test_padded_rows(rows, padded):
    assert padded_rows(rows) == padded
    assert padded_rows(np.array([rows, rows])).tolist() == [padded, padded]  # as the row budget prices them


def test_subtree_worked_example():
    # 0 -> 1, 2 ; 1 -> 3 ; 2 -> 4   keep [0, 2, 4]: the chain 0 -> 2 -> 4
    t = make_tree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, 1, 2]),
                  draft_logp=torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4]))
    s = subtree(t, torch.tensor([0, 2, 4]))
    assert s.tokens.tolist() == [10, 12, 14]
    assert s.parents.tolist() == [-1, 0, 1]
    assert s.depth.tolist() == [0, 1, 2]
    assert s.ancestors.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert s.draft_logp.tolist() == pytest.approx([0.0, -0.2, -0.4])
    assert s.shape == t.shape and s.size == 3
    s = subtree(t, torch.tensor([0, 1, 2, 3]))  # a sibling subtree: 3 stays under 1
    assert s.parents.tolist() == [-1, 0, 0, 1] and s.depth.tolist() == [0, 1, 1, 2]


# -- packed forwards against each part alone -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """A random float32 Llama (2 layers, grouped-query attention) and a random EAGLE-3 head for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaptivespec.drafter import Eagle3Drafter

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval().float()
    head = Eagle3Drafter.random_init(model, draft_vocab_size=40, seed=3).eval()
    return model, head


def tree_mask(past: int, tree, dtype=torch.float32) -> torch.Tensor:
    """Additive [1, 1, n, past + n] mask of a verify tree after ``past`` committed keys."""
    n = tree.size
    m = torch.zeros(1, 1, n, past + n, dtype=dtype)
    m[0, 0, :, past:].masked_fill_(~tree.ancestors, float("-inf"))
    return m


@torch.inference_mode()
def test_packed_forward_equals_each_part_alone(tiny):
    from adaptivespec.fastpath.kvcache import buffered_cache

    model, _ = tiny
    pieces = layer_pieces(model)
    pasts = {"tree": list(range(3, 9)), "plain": list(range(20, 27)), "chunk": [], "later": list(range(40, 45))}
    tree = make_tree(torch.tensor([8, 30, 31, 32, 33]), torch.tensor([-1, 0, 0, 1, 2]))
    rows = {"tree": tree.tokens, "plain": torch.tensor([50]), "chunk": torch.tensor([60, 61, 62]),
            "later": torch.tensor([70, 71, 72, 73])}

    def caches():
        out = {}
        for name, ids in pasts.items():
            c = buffered_cache(model.config, 64, dtype=torch.float32, device="cpu")
            if ids:
                t = torch.tensor(ids)
                packed_forward(pieces, t, torch.arange(len(ids)), [Part(cache=c, rows=len(ids))], torch.tensor([0]))
            out[name] = c
        return out

    def inputs(name):
        past = len(pasts[name])
        if name == "tree":
            return rows[name], past + tree.depth, tree_mask(past, tree)
        return rows[name], past + torch.arange(rows[name].shape[0]), None

    # all four parts in one forward, padded to 24 rows
    packed = caches()
    names = list(rows)
    ids = torch.cat([inputs(n)[0] for n in names])
    pos = torch.cat([inputs(n)[1] for n in names])
    R = ids.shape[0]
    ids, pos = torch.cat([ids, torch.zeros(24 - R, dtype=torch.long)]), torch.cat([pos, torch.zeros(24 - R, dtype=torch.long)])
    parts = [Part(cache=packed[n], rows=rows[n].shape[0], mask=inputs(n)[2]) for n in names]
    logits, hidden = packed_forward(pieces, ids, pos, parts, torch.arange(R), hidden=True)
    assert len(hidden) == model.config.num_hidden_layers + 1 and hidden[0].shape == (1, 24, 64)
    # each part alone, on its own copy of the same caches
    alone = caches()
    start = 0
    for n in names:
        i, p, m = inputs(n)
        k = i.shape[0]
        ref, ref_hidden = packed_forward(pieces, i, p, [Part(cache=alone[n], rows=k, mask=m)], torch.arange(k), hidden=True)
        torch.testing.assert_close(logits[start:start + k], ref, rtol=1e-5, atol=1e-5)
        for h, rh in zip(hidden, ref_hidden):
            torch.testing.assert_close(h[0, start:start + k], rh[0], rtol=1e-5, atol=1e-5)
        # each part's keys went to its own cache, nothing from the padded rows
        assert packed[n].get_seq_length() == alone[n].get_seq_length() == len(pasts[n]) + k
        for lp, la in zip(packed[n].layers, alone[n].layers):
            torch.testing.assert_close(lp.keys, la.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lp.values, la.values, rtol=1e-5, atol=1e-5)
        start += k
    # and the pieces are the model's own: the chunk and the plain row equal transformers' forward
    whole = model(torch.tensor([rows["chunk"].tolist()])).logits[0]
    torch.testing.assert_close(logits[6:9], whole, rtol=1e-5, atol=1e-5)
    whole = model(torch.tensor([pasts["plain"] + [50]])).logits[0, -1]
    torch.testing.assert_close(logits[5], whole, rtol=1e-5, atol=1e-5)
    # a tree node reads its own path only: node 4 (path 0 -> 2 -> 4) as a plain sequence
    whole = model(torch.tensor([pasts["tree"] + [8, 31, 33]])).logits[0, -1]
    torch.testing.assert_close(logits[4], whole, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_packed_draft_step_equals_eagle3_step_per_part(tiny):
    model, head = tiny
    H = head.config.hidden_size
    g = torch.Generator().manual_seed(2)
    pasts = {"a": 5, "b": 3, "fresh": 0, "level": 6}
    new = {"a": 1, "b": 2, "fresh": 4, "level": 3}
    fill = {n: (torch.randint(0, 97, (k,), generator=g), torch.randn(k, H, generator=g)) for n, k in pasts.items()}
    rows = {n: (torch.randint(0, 97, (k,), generator=g), torch.randn(k, H, generator=g)) for n, k in new.items()}

    def masks(name):
        if name != "level":
            return None  # causal over the new rows
        past, k = pasts[name], new[name]
        m = torch.zeros(1, 1, k, past + k)
        m[0, 0, :, past:] = torch.full((k, k), float("-inf")).fill_diagonal_(0.0)  # a tree level: each node sees itself
        return m

    def kvs():
        out = {}
        for n, past in pasts.items():
            kv = DraftKV()
            with bound(head, kv) as d:
                d.reset_cache(capacity=32)
                if past:
                    d.step(fill[n][0], fill[n][1], torch.arange(past), None)
            out[n] = kv
        return out

    names = list(pasts)
    saved = (head._k, head._v, head.length)
    packed = kvs()
    out = packed_draft_step(head, torch.cat([rows[n][0] for n in names]), torch.cat([rows[n][1] for n in names]),
                            torch.cat([pasts[n] + torch.arange(new[n]) for n in names]),
                            [DraftPart(kv=packed[n], rows=new[n], mask=masks(n)) for n in names])
    assert out.shape == (sum(new.values()), H)
    alone = kvs()
    start = 0
    for n in names:
        with bound(head, alone[n]) as d:
            ref = d.step(rows[n][0], rows[n][1], pasts[n] + torch.arange(new[n]), masks(n))
        torch.testing.assert_close(out[start:start + new[n]], ref, rtol=1e-5, atol=1e-5)
        assert packed[n].length == alone[n].length == pasts[n] + new[n]
        L = alone[n].length
        torch.testing.assert_close(packed[n].k[:, :, :L], alone[n].k[:, :, :L], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[n].v[:, :, :L], alone[n].v[:, :, :L], rtol=1e-5, atol=1e-5)
        start += new[n]
    # the head's own cache (unbound) was left as it was
    assert (head._k, head._v, head.length) == saved


@torch.inference_mode()
def test_slab_forward_equals_the_forward_over_separate_caches(tiny):
    """Parts whose caches are slots of one KVSlab attend in one call for all (SlabStep); a long chunk
    in the slab and a part outside it attend alone: the same logits, hidden states and caches as the
    packed forward over separate caches (itself checked against each part alone above)."""
    from adaptivespec.fastpath.batched import SLAB_MAX_ROWS, KVSlab
    from adaptivespec.fastpath.kvcache import buffered_cache

    model, _ = tiny
    pieces = layer_pieces(model)
    g = torch.Generator().manual_seed(4)
    tree = make_tree(torch.tensor([8, 30, 31, 32, 33]), torch.tensor([-1, 0, 0, 1, 2]))
    # name: (slot or None, past tokens, new rows)
    spec = {"tree": (2, 6, tree.tokens), "plain": (0, 7, torch.tensor([50])),
            "chunk": (3, 0, torch.randint(0, 97, (SLAB_MAX_ROWS + 8,), generator=g)),  # too long: attends alone
            "later": (None, 5, torch.tensor([70, 71, 72, 73])),  # a cache outside the slab
            "fresh": (1, 0, torch.tensor([5, 6, 7]))}
    pasts = {n: torch.randint(0, 97, (k,), generator=g) for n, (_, k, _) in spec.items()}

    def caches(slab):
        out = {}
        for n, (slot, k, _) in spec.items():
            if slab is not None and slot is not None:
                c = buffered_cache(model.config, slab.capacity)
                slab.bind(slot, c)
            else:
                c = buffered_cache(model.config, 96, dtype=torch.float32, device="cpu")
            if k:
                packed_forward(pieces, pasts[n], torch.arange(k), [Part(cache=c, rows=k)], torch.tensor([0]))
            out[n] = c
        return out

    def run(slab):
        cs = caches(slab)
        ids, pos, parts = [], [], []
        for n, (slot, k, new) in spec.items():
            ids.append(new)
            if n == "tree":
                pos.append(k + tree.depth)
                mask = tree_mask(k, tree)
            else:
                pos.append(k + torch.arange(new.shape[0]))
                mask = None
            parts.append(Part(cache=cs[n], rows=new.shape[0], mask=mask, slot=slot if slab is not None else None))
        ids, pos = torch.cat(ids), torch.cat(pos)
        R = ids.shape[0]
        pad = padded_rows(R) - R
        ids, pos = torch.cat([ids, torch.zeros(pad, dtype=torch.long)]), torch.cat([pos, torch.zeros(pad, dtype=torch.long)])
        logits, hidden = packed_forward(pieces, ids, pos, parts, torch.arange(R), hidden=True, slab=slab)
        return logits, hidden, cs

    slab = KVSlab(model.config, 4, 96, torch.float32, "cpu")
    logits, hidden, cs = run(slab)
    ref_logits, ref_hidden, ref_cs = run(None)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for h, rh in zip(hidden, ref_hidden):
        torch.testing.assert_close(h, rh, rtol=1e-5, atol=1e-5)
    for n, (slot, k, new) in spec.items():
        assert cs[n].get_seq_length() == ref_cs[n].get_seq_length() == k + new.shape[0], n
        assert slot is None or slab.holds(slot, cs[n])
        for layer, ref in zip(cs[n].layers, ref_cs[n].layers):
            torch.testing.assert_close(layer.keys, ref.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values, ref.values, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def slab_attention(sgl=None, kernel=None):
    """The slab's shared attention over two layers for one-row parts, trees (additive and bool masks)
    and causal chunks at different pasts (a 16-row prompt chunk over 140 keys the widest), an idle
    slot between, padded rows at the end: (outputs [R, H * D], the slab, the members' rows)."""
    from types import SimpleNamespace

    from adaptivespec.fastpath.batched import KVSlab, SlabStep

    heads, kv_heads, D, cap = 8, 2, 64, 160
    cfg = SimpleNamespace(num_key_value_heads=kv_heads, head_dim=D, hidden_size=heads * D, num_attention_heads=heads,
                          num_hidden_layers=2)
    tree = make_tree(torch.tensor([8, 30, 31, 32, 33]), torch.tensor([-1, 0, 0, 1, 2]))
    g = torch.Generator().manual_seed(7)
    # (slot, past, rows, mask kind); slot 4 stays idle
    spec = [(0, 37, 1, None), (3, 120, 1, None), (1, 64, 5, "additive"), (5, 9, 5, "bool"), (2, 80, 3, "causal"),
            (6, 0, 1, None), (7, 140, 16, "causal")]  # the last: a prompt chunk over a long past, the widest
    parts, starts, pasts, start = [], [], [], 0
    for slot, past, rows, kind in spec:
        mask = None
        if kind == "additive":
            mask = tree_mask(past, tree, torch.bfloat16)
        elif kind == "bool":
            mask = torch.cat([torch.ones(1, 1, rows, past, dtype=torch.bool), tree.ancestors[None, None]], -1)
        parts.append(Part(cache=None, rows=rows, mask=mask, slot=slot))
        starts.append(start), pasts.append(past)
        start += rows
    R = start + 3  # padded rows at the end
    q = torch.randn(R, heads, D, generator=g).bfloat16()
    k = torch.randn(R, kv_heads, D, generator=g).bfloat16()
    v = torch.randn(R, kv_heads, D, generator=g).bfloat16()
    slab = KVSlab(cfg, 8, cap, torch.bfloat16, "cpu")
    for t in (*slab.k, *slab.v):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).bfloat16())
    step = SlabStep(slab, parts, starts, pasts, heads, torch.bfloat16, "cpu", sgl, kernel)
    assert (step.kernels is not None) == (sgl is not None and kernel is None)
    assert (step.kernel is not None) == (kernel is not None)
    attn = torch.zeros(R, heads * D, dtype=torch.bfloat16)
    for i in range(2):
        step.attend(i, q, k, v, attn, None)
    return attn, slab, start


def test_slab_attention_by_sglang_kernels_equals_sdpa():
    """Where SGLang's CPU kernels are installed (bfloat16), the slab's shared attention runs them
    (one-row members in ``decode_attention_cpu``, trees and short chunks in ``extend_attention_cpu``
    padded to the widest): the same outputs and slab contents as the folded SDPA call."""
    from adaptivespec.fastpath.prepack import sgl_ops

    sgl = sgl_ops()
    if sgl is None or not hasattr(sgl, "extend_attention_cpu"):
        pytest.skip("SGLang's CPU kernels are not installed here (scripts/install_sglang_cpu.sh)")
    (got, slab, start), (want, ref, _) = slab_attention(sgl), slab_attention()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert got[start:].abs().sum() == 0  # padded rows untouched
    for a, b in zip((*slab.k, *slab.v), (*ref.k, *ref.v)):
        assert torch.equal(a, b)  # every member's keys and values written where SDPA's path writes them


def test_slab_attention_by_the_bf16_kernel_equals_sdpa():
    """With the bf16 attention kernel (AVX512-BF16 CPUs) every member attends over its own slot in one
    ``attend_slab`` call: the folded SDPA call's outputs to bf16 rounding, the same slab contents."""
    from adaptivespec.fastpath.native import attention_ops, attention_why_not

    kernel = attention_ops()
    if kernel is None:
        pytest.skip(f"no bf16 attention kernel here: {attention_why_not()}")
    (got, slab, start), (want, ref, _) = slab_attention(kernel=kernel), slab_attention()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
    assert got[start:].abs().sum() == 0  # padded rows untouched
    for a, b in zip((*slab.k, *slab.v), (*ref.k, *ref.v)):
        assert torch.equal(a, b)
