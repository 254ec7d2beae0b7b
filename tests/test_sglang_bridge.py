"""The served step's pure-torch pieces (adaptivespec.sglang's controller, load model, shapes, state bank
and verification) on CPU, with tensors laid out as SGLang 0.5.23 lays them out.

The SGLang-side reference code here (drafting a tree the way ``draft_forward`` /
``organize_draft_results`` do, linking it the way ``build_tree_kernel_efficient`` does, verifying it
the way ``verify_tree_greedy_func`` does) is written for this test from the kernels' semantics.
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from adaptivespec.costmodel import CostModel
from adaptivespec.errors import AdaptiveSpecError, ShapeNotInBankError
from adaptivespec.policies.static import StaticParams, StaticPolicy
from adaptivespec.sglang.controller import TripletController
from adaptivespec.sglang.load_model import LoadModel
from adaptivespec.sglang.shapes import kv_alloc_len_per_decode, sglang_shape, sglang_shape_problem
from adaptivespec.sglang.state_bank import ShapeStateBank
from adaptivespec.sglang.verification import parents_from_retrieve, retrieve_from_parents, wrap_verify
from adaptivespec.strategies import TreePolicy, Verifier
from adaptivespec.types import StepRecord, StepSignals, TreeShape, VerifyResult
from adaptivespec.verifiers.strict import StrictVerifier

WIDE, MID, DEEP = TreeShape(3, 4, 4), TreeShape(5, 2, 6), TreeShape(7, 1, 8)


class StubPolicy(TreePolicy):
    """Deep when the draft is confident, wide when not; back to MID after 2 zero-accept steps."""

    name = "stub"

    def __init__(self, params=None):
        super().__init__(params)
        self.seen: list[StepSignals] = []
        self.records: list[StepRecord] = []
        self.resets = 0
        self.zeros = 0

    def shapes(self):
        return (WIDE, MID, DEEP)

    def reset(self):
        self.resets += 1
        self.zeros = 0

    def next_shape(self, signals):
        self.seen.append(signals)
        if self.zeros >= 2:  # circuit breaker
            self.zeros = 0
            return MID
        return DEEP if signals.draft_top1_prob >= 0.8 else WIDE if signals.draft_top1_prob < 0.4 else MID

    def observe(self, record):
        self.records.append(record)
        self.zeros = self.zeros + 1 if record.accepted == 0 else 0

    def state(self):
        return {"zeros": self.zeros}


def probs(*top1: float, k: int = 4) -> torch.Tensor:
    """[bs, k] first-level draft probabilities, sorted, with the given top-1 values."""
    rows = [[p] + [(1 - p) / k] * (k - 1) for p in top1]
    return torch.tensor(rows)


# -- controller ----------------------------------------------------------------------------------
def test_triplet_follows_the_policy_and_feeds_it_records():
    policy = StubPolicy()
    records = []
    c = TripletController(policy, on_record=records.append)
    assert c.shapes == (WIDE, MID, DEEP)
    assert c.begin_step(probs(0.9)) == DEEP
    rec = c.observe([5])
    assert (rec.shape, rec.accepted, rec.new_tokens, rec.tree_size, rec.step) == (DEEP, 5, 6, 8, 0)
    top4 = float(probs(0.9)[0].topk(4).values.sum())
    assert rec.signals == StepSignals(step=0, draft_top1_prob=pytest.approx(0.9), draft_top4_prob=pytest.approx(top4),
                                      last_accepted=-1)
    assert rec.policy_state == {"zeros": 0} and records == [rec] and policy.records == [rec]
    assert c.begin_step(probs(0.1)) == WIDE
    assert policy.seen[-1].step == 1 and policy.seen[-1].last_accepted == 5


def test_static_policy_gives_its_shape_every_step():
    c = TripletController(StaticPolicy(StaticParams(nsteps=5, topk=4, ndt=8)))
    for p in (0.99, 0.01, 0.5):
        assert c.begin_step(probs(p)) == TreeShape(5, 4, 8)
        assert c.observe([1]).shape == TreeShape(5, 4, 8)


def test_circuit_breaker_of_the_policy_sees_zero_accept_steps():
    policy = StubPolicy()
    c = TripletController(policy)
    for _ in range(2):
        assert c.begin_step(probs(0.95)) == DEEP
        c.observe([0])
    assert c.begin_step(probs(0.95)) == MID  # the policy's breaker tripped
    assert [r.accepted for r in policy.records] == [0, 0]


def test_pending_steps_pair_with_accepts_in_launch_order():
    """Overlap scheduling: step t+1 begins before step t's accept lengths arrive."""
    c = TripletController(StubPolicy())
    c.begin_step(probs(0.9))
    c.begin_step(probs(0.1))
    c.note_promoted([2])
    first, second = c.observe([4]), c.observe([1])
    assert (first.shape, first.accepted, first.promoted) == (DEEP, 4, 0)
    assert (second.shape, second.accepted, second.promoted) == (WIDE, 1, 2)
    assert c.observe([3]) is None  # nothing pending


def test_load_aware_controller_shrinks_the_tree_as_the_batch_grows():
    traced = []
    c = TripletController(StubPolicy(), verify_budget=16, on_trace=lambda r, bs, gap: traced.append((r.shape, bs, r.policy_state)))
    floor = TreeShape(1, 1, 2)  # one draft step, one drafted token, the bank's smallest topk
    assert c.shapes == (floor, WIDE, MID, DEEP)
    assert c.begin_step(probs(0.9)) == DEEP  # bs 1: 8 rows fit 16
    assert c.begin_step(probs(0.9, 0.9)) == DEEP  # bs 2: 16 rows
    assert c.begin_step(probs(0.9, 0.9, 0.9)) == WIDE  # bs 3: the largest shape with 3 * ndt <= 16 (4)
    assert c.begin_step(probs(*[0.9] * 8)) == floor  # bs 8: 16 rows allow ndt 2 only
    assert c.begin_step(probs(*[0.9] * 9)) == floor  # nothing fits: the smallest
    for bs in (1, 2, 3, 8, 9):
        c.observe([0] * bs)
    assert [bs for _, bs, _ in traced] == [1, 2, 3, 8, 9]
    assert [s.get("load_capped_from") for _, _, s in traced] == [None, None, str(DEEP), str(DEEP), str(DEEP)]
    # the policy sees the shape that ran
    assert [r.shape for r in c.policy.records] == [DEEP, DEEP, WIDE, floor, floor]
    # no budget: the policy's shape at any batch size
    free = TripletController(StubPolicy())
    assert free.shapes == (WIDE, MID, DEEP) and free.begin_step(probs(*[0.9] * 8)) == DEEP
    with pytest.raises(AdaptiveSpecError, match="verify_budget: expected at least 2"):
        TripletController(StubPolicy(), verify_budget=1)


def test_load_model_shrinks_the_tree_when_rows_cost_more_than_they_return():
    # a step: 20 ms fixed + 2 ms per verified row; every shape accepts 1.5 drafted tokens per request
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0))
    for shape in (WIDE, MID, DEEP, TreeShape(1, 1, 2)):
        load.observe(shape, 1.5)
    floor = TreeShape(1, 1, 2)
    shapes = (floor, WIDE, MID, DEEP)
    assert load.choose(DEEP, 1, shapes) == DEEP  # batch 1: the policy's shape, always
    # batch 2: DEEP 2*2.5/(20+32) ms < floor 2*2.5/(20+8): the same tokens for fewer rows
    assert load.choose(DEEP, 2, shapes) == floor
    assert load.tokens_per_s(floor, 2) == pytest.approx(1e3 * 5 / 28)
    # deeper trees that return more keep their place while rows are cheap
    cheap = LoadModel(CostModel(fixed=20.0, per_verified_token=0.5))
    for shape, acc in ((floor, 0.6), (WIDE, 1.5), (MID, 2.2), (DEEP, 3.5)):
        cheap.observe(shape, acc)
    assert cheap.choose(DEEP, 4, shapes) == DEEP
    # ... until the batch makes them expensive: at 64 requests DEEP's 512 rows cost 256 ms
    assert cheap.choose(DEEP, 64, shapes) == floor
    # never a larger tree than the policy's
    assert cheap.choose(WIDE, 4, shapes) in (WIDE, floor)
    # an unseen shape is expected to accept the running average, at most its depth
    fresh = LoadModel(CostModel(fixed=20.0))
    fresh.observe(DEEP, 3.0)
    assert fresh.accepted(MID) == 3.0 and fresh.accepted(floor) == 1.0
    with pytest.raises(AdaptiveSpecError, match="decay"):
        LoadModel(CostModel(fixed=20.0), decay=1.5)


def test_controller_with_a_load_model_runs_the_cheaper_shape_and_learns_from_what_ran():
    traced = []
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0))
    c = TripletController(StubPolicy(), load=load, on_trace=lambda r, bs, gap: traced.append((r.shape, bs, r.policy_state)))
    floor = TreeShape(1, 1, 2)
    assert floor in c.shapes  # the floor joins the bank
    assert c.begin_step(probs(0.9)) == DEEP  # batch 1: the policy's shape
    c.observe([2])
    # batch 3: DEEP's 24 rows cost more than they return; WIDE (unseen: expected to accept DEEP's 2)
    # gives 9 tokens in 44 ms, the floor 6 in 32 ms
    assert c.begin_step(probs(0.9, 0.9, 0.9)) == WIDE
    c.observe([1, 1, 1])
    assert load.accepted(DEEP) == 2.0 and load.accepted(WIDE) == 1.0
    assert traced[1][2]["load_capped_from"] == str(DEEP)
    assert all(r.verify_ms >= 0 for r in c.policy.records)  # each step's host time is recorded
    # the time between steps is known only while the batch stays the same
    gaps = []
    g = TripletController(StubPolicy(), on_trace=lambda r, bs, gap: gaps.append(gap))
    for ids in (["a"], ["a"], ["a", "b"], ["a", "b"]):
        g.begin_step(probs(*[0.5] * len(ids)), ids)
        g.observe([1] * len(ids))
    assert gaps[0] is None and gaps[1] >= 0 and gaps[2] is None and gaps[3] >= 0


def _fell_to(load: LoadModel, shapes, first: float, now: float) -> None:
    """Every shape accepted ``first`` once, then ``now`` until its moving average is about ``now``."""
    for shape in shapes:
        load.observe(shape, first)
        for _ in range(60):
            load.observe(shape, now)


def test_load_model_drafts_nothing_when_one_row_per_request_gives_more():
    from adaptivespec.sglang.shapes import NO_DRAFT

    floor = TreeShape(1, 1, 2)
    shapes = (floor, WIDE, MID, DEEP)
    # 20 ms fixed + 2 ms per row; drafts accept 0.2 tokens: at batch 8 the floor's 16 rows give
    # 8 * 1.2 tokens in 52 ms, no drafting 8 tokens in 36 ms
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), probe_every=3)
    for shape in shapes:
        load.observe(shape, 0.2)
    assert load.choose(DEEP, 8, shapes) == floor  # not offered: the bank's floor
    assert load.choose(DEEP, 8, shapes, undrafted=True) is NO_DRAFT
    assert load.tokens_per_s(NO_DRAFT, 8) == pytest.approx(1e3 * 8 / 36) and load.accepted(NO_DRAFT) == 0.0
    assert load.choose(DEEP, 1, shapes, undrafted=True) == DEEP  # batch 1: the policy's shape, always
    # drafting pays when it is accepted: the tree stays
    good = LoadModel(CostModel(fixed=20.0, per_verified_token=0.5))
    for shape, acc in ((floor, 0.8), (WIDE, 1.5), (MID, 2.2), (DEEP, 3.5)):
        good.observe(shape, acc)
    assert good.choose(DEEP, 8, shapes, undrafted=True) == DEEP
    # acceptance is learned only by drafting: every probe_every-th no-draft choice drafts once,
    # while the probe at the best acceptance it has had (0.5 at first, 0.2 now) would beat no drafting
    # (at batch 8 the floor: 12 tokens in 52 ms, no drafting 8 in 36 ms)
    probe = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), probe_every=3, probe_share=1.0)
    _fell_to(probe, shapes, 0.5, 0.2)
    picks = [probe.choose(DEEP, 8, shapes, undrafted=True) for _ in range(8)]
    assert picks == [NO_DRAFT] * 3 + [floor] + [NO_DRAFT] * 3 + [floor]  # probes at the cheapest tree
    # ... and no more often than their modelled cost allows: a probe (52 ms) at most 10% of the
    # undrafted run's time (36 ms a step) waits for 15 undrafted steps, not 3
    paced = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), probe_every=3, probe_share=0.1)
    _fell_to(paced, shapes, 0.5, 0.2)
    picks = [paced.choose(DEEP, 8, shapes, undrafted=True) for _ in range(32)]
    assert picks == ([NO_DRAFT] * 15 + [floor]) * 2
    # ... and never where it cannot change the choice: the floor at its best (0.5: 24 tokens in
    # 84 ms at batch 16) loses to no drafting (16 in 52 ms); nor when 0.2 is all it ever had
    assert [probe.choose(DEEP, 16, shapes, undrafted=True) for _ in range(12)] == [NO_DRAFT] * 12
    never = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), probe_every=3, probe_share=1.0)
    for shape in shapes:
        never.observe(shape, 0.2)
    assert [never.choose(DEEP, 8, shapes, undrafted=True) for _ in range(12)] == [NO_DRAFT] * 12
    assert never.settled  # nothing to learn: every step after it skips the draft-extend
    with pytest.raises(AdaptiveSpecError, match="probe_share"):
        LoadModel(CostModel(fixed=20.0), probe_share=0.0)
    load.observe(NO_DRAFT, 0.0)  # ignored: nothing was drafted
    assert load.accepted(floor) == pytest.approx(0.2)


def test_a_settled_no_draft_choice_skips_the_draft_extend_except_before_a_probe():
    from adaptivespec.sglang.shapes import NO_DRAFT

    floor = TreeShape(1, 1, 2)
    shapes = (floor, WIDE, MID, DEEP)
    # batch 8: no drafting 8 tokens in 36 ms (222/s); the floor 8 * 1.2 in 52 ms (185/s): 1.2x
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), probe_every=3, probe_share=1.0, settle_margin=1.1)
    _fell_to(load, shapes, 0.5, 0.2)
    picks = []
    for _ in range(8):
        picks.append((load.choose(DEEP, 8, shapes, undrafted=True), load.settled))
    # settled while no probe is due next; the step before a probe keeps its draft-extend (warm roots)
    assert picks == [(NO_DRAFT, True), (NO_DRAFT, True), (NO_DRAFT, False), (floor, False)] * 2
    # a margin the choice does not clear: undrafted, not settled
    close = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), settle_margin=1.5)
    for shape in shapes:
        close.observe(shape, 0.2)
    assert close.choose(DEEP, 8, shapes, undrafted=True) is NO_DRAFT and not close.settled
    # a drafted choice never is
    assert load.choose(DEEP, 1, shapes, undrafted=True) == DEEP and not load.settled
    with pytest.raises(AdaptiveSpecError, match="settle_margin"):
        LoadModel(CostModel(fixed=20.0), settle_margin=0.9)

    # the controller passes it to the worker and the trace, and forgets it at the next step
    traced = []
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=4.0))
    c = TripletController(StubPolicy(), load=load, undrafted=True,
                          on_trace=lambda r, bs, gap: traced.append(r.policy_state))
    assert c.begin_step(probs(0.9)) == DEEP and not c.skip_draft_extend
    c.observe([0])
    assert c.begin_step(probs(*[0.9] * 8)) is NO_DRAFT and c.skip_draft_extend
    c.observe([0] * 8)
    assert traced[-1]["draft_extend"] == "skipped"
    assert c.begin_step(torch.zeros(0, 4)) is None and not c.skip_draft_extend  # an idle batch


def test_requests_admitted_while_settled_skip_the_heads_prefill_unless_the_live_batch_disagrees():
    from adaptivespec.sglang.shapes import NO_DRAFT

    floor = TreeShape(1, 1, 2)
    shapes = (floor, WIDE, MID, DEEP)
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=2.0))
    for shape in shapes:
        load.observe(shape, 0.2)
    # batch 8: no drafting 222 tok/s vs the floor's 185 (1.2x, clears 1.1); batch 2: 2 rows cost little
    assert load.would_settle(8, shapes) and not load.would_settle(2, shapes) and not load.would_settle(1, shapes)
    assert not LoadModel(CostModel(fixed=20.0, per_verified_token=2.0), settle_margin=1.5).would_settle(8, shapes)
    before = (load.settled, load._undrafted_in_a_row, load._undrafted_ms)
    load.would_settle(8, shapes)
    assert (load.settled, load._undrafted_in_a_row, load._undrafted_ms) == before  # asking changes nothing

    c = TripletController(StubPolicy(), load=LoadModel(CostModel(fixed=20.0, per_verified_token=4.0)), undrafted=True)
    assert not c.skip_prefill_extend(9)  # no decode step yet: nothing settled
    c.begin_step(probs(0.9))
    c.observe([0])
    assert c.begin_step(probs(*[0.9] * 8)) is NO_DRAFT and c.skip_draft_extend
    assert c.skip_prefill_extend(9)
    # the flag is the last decode step's: a server gone idle that admits one request drafts for it
    assert not c.skip_prefill_extend(1)
    c.observe([0] * 8)
    c.skip_settled_extend = False  # $ADAPTIVESPEC_SGLANG_SKIP_EXTEND=0
    assert c.begin_step(probs(*[0.9] * 8)) is NO_DRAFT and not c.skip_draft_extend and not c.skip_prefill_extend(9)
    assert not TripletController(StubPolicy()).skip_prefill_extend(9)  # no load model


def test_the_settled_profile_drafts_nothing_from_two_requests_on(tmp_path):
    from adaptivespec.sglang.load_model import write_settled_profile
    from adaptivespec.sglang.shapes import NO_DRAFT

    write_settled_profile(tmp_path / "settled.json")
    load = LoadModel(CostModel.load(tmp_path / "settled.json"))
    shapes = (TreeShape(1, 1, 2), WIDE, MID, DEEP)
    for shape in shapes:
        load.observe(shape, float(shape.nsteps))  # even accepting every drafted token
    assert load.choose(DEEP, 1, shapes, undrafted=True) == DEEP
    assert all(load.would_settle(bs, shapes) for bs in (2, 8, 64))
    picks = [load.choose(DEEP, 2, shapes, undrafted=True) for _ in range(40)]
    assert picks == [NO_DRAFT] * 40 and load.settled  # and no probe can change that


def test_controller_runs_undrafted_steps_without_feeding_the_policy():
    from adaptivespec.sglang.shapes import NO_DRAFT

    traced = []
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=4.0))
    c = TripletController(StubPolicy(), load=load, undrafted=True,
                          on_trace=lambda r, bs, gap: traced.append((r.shape, r.tree_size, r.policy_state)))
    assert c.begin_step(probs(0.9)) == DEEP
    c.observe([0])
    assert c.begin_step(probs(*[0.9] * 8)) is NO_DRAFT  # nothing accepted, rows expensive
    record = c.observe([0] * 8)
    assert record.shape is None and record.tree_size == 1 and record.new_tokens == 1
    assert traced[-1][2]["undrafted"] == "load"
    assert [r.shape for r in c.policy.records] == [DEEP]  # the policy saw only its own step
    # a verify budget that not even the floor fits: no drafting, when allowed
    b = TripletController(StubPolicy(), verify_budget=4, undrafted=True)
    assert b.begin_step(probs(*[0.9] * 3)) is NO_DRAFT
    assert TripletController(StubPolicy(), verify_budget=4).begin_step(probs(*[0.9] * 3)) == TreeShape(1, 1, 2)


def test_shapes_deeper_than_their_tree_run_at_the_depth_the_tree_can_hold():
    # (6, 4, 4) verifies 3 drafted nodes: they lie within 3 levels; SGLang 0.5.23 crashes drafting 6
    assert sglang_shape(TreeShape(6, 4, 4)) == TreeShape(3, 4, 4)
    assert sglang_shape(TreeShape(6, 4, 12)) == TreeShape(6, 4, 12)
    assert sglang_shape(TreeShape(6, 1, 4)) == TreeShape(3, 1, 4) and sglang_shape_problem(TreeShape(3, 1, 4)) is None

    class Shallow(StubPolicy):
        def shapes(self):
            return (TreeShape(6, 4, 4), TreeShape(6, 4, 12))

        def next_shape(self, signals):
            return TreeShape(6, 4, 4)

    c = TripletController(Shallow())
    assert c.shapes == (TreeShape(3, 4, 4), TreeShape(6, 4, 12))
    assert c.begin_step(probs(0.9)) == TreeShape(3, 4, 4)


def test_new_request_resets_the_policy_and_drops_stale_steps():
    policy = StubPolicy()
    c = TripletController(policy)
    c.begin_step(probs(0.9), request_ids=["a"])
    c.observe([3])
    c.begin_step(probs(0.9), request_ids=["a"])  # in flight when the request finishes
    assert policy.resets == 0
    c.begin_step(probs(0.1), request_ids=["b"])
    assert policy.resets == 1 and policy.seen[-1].step == 0 and policy.seen[-1].last_accepted == -1
    assert c.observe([7]) is None  # request a's last step: not fed to the reset policy
    rec = c.observe([2])
    assert (rec.step, rec.shape, rec.accepted) == (0, WIDE, 2)
    c.begin_step(probs(0.5), request_ids=["b", "c"])  # c joins b: same sequence for the policy
    assert policy.resets == 1


@pytest.mark.parametrize(("reduce", "top1", "accepted"), [("mean", 0.5, 2), ("min", 0.2, 0), ("max", 0.9, 5)])
def test_batch_reduction(reduce, top1, accepted):
    policy = StubPolicy()
    c = TripletController(policy, batch_reduce=reduce)
    c.begin_step(probs(0.2, 0.4, 0.9))
    assert policy.seen[-1].draft_top1_prob == pytest.approx(top1)
    assert c.observe([0, 2, 5]).accepted == accepted


def test_idle_batches_neither_choose_nor_observe():
    policy = StubPolicy()
    c = TripletController(policy)
    assert c.begin_step(torch.empty(0, 4)) is None
    assert c.observe([]) is None
    assert policy.seen == [] and policy.records == []


def test_undeclared_shape_and_unrunnable_shapes_are_refused():
    class Liar(StubPolicy):
        def next_shape(self, signals):
            return TreeShape(4, 2, 5)

    with pytest.raises(ShapeNotInBankError, match=r"\(4,2,5\).*\(3,4,4\), \(5,2,6\), \(7,1,8\)"):
        TripletController(Liar()).begin_step(probs(0.5))

    # a chain of 3 cannot fill 6 slots (TreeShape refuses it; SGLang's topk=1 path says why)
    assert "ndt == nsteps + 1" in sglang_shape_problem(types.SimpleNamespace(nsteps=3, topk=1, ndt=6))
    with pytest.raises(AdaptiveSpecError, match="batch_reduce"):
        TripletController(StubPolicy(), batch_reduce="median")
    assert sglang_shape_problem(DEEP) is None and sglang_shape_problem(WIDE) is None


# -- bank ----------------------------------------------------------------------------------------
def test_bank_builds_every_shape_and_names_captured_keys_when_one_is_missing():
    bank = ShapeStateBank([DEEP, WIDE, MID, WIDE])
    assert bank.shapes == (WIDE, MID, DEEP)
    live = object()
    bank.register(DEEP, live)
    built = bank.build_missing(lambda s: f"graphs{s}")
    assert built == [WIDE, MID] and bank.keys() == (WIDE, MID, DEEP) and len(bank) == 3
    assert bank.get(DEEP) is live and bank.get(MID) == "graphs(5,2,6)"
    with pytest.raises(ShapeNotInBankError, match=r"\(4,2,5\); captured shapes: \(3,4,4\), \(5,2,6\), \(7,1,8\)"):
        bank.get(TreeShape(4, 2, 5))
    with pytest.raises(ShapeNotInBankError, match="not one of this bank's shapes"):
        bank.register(TreeShape(4, 2, 5), None)


def test_bank_lookup_error_lists_shapes_not_built_yet():
    bank = ShapeStateBank([WIDE, DEEP])
    bank.register(WIDE, 1)
    with pytest.raises(ShapeNotInBankError, match=r"captured shapes: \(3,4,4\); declared but not built: \(7,1,8\)"):
        bank.get(DEEP)


def test_bank_max_shape_and_kv_reservation():
    bank = ShapeStateBank([WIDE, MID, DEEP])
    assert bank.max_shape() == TreeShape(7, 4, 8) and bank.max_topk() == 4
    # page 1: max(nsteps * topk, largest ndt) over the shapes = max(12, 10, 7, 8)
    assert bank.kv_alloc_len_per_decode(1) == 12
    # page 16, topk > 1: whole pages per branch: (15 + 3 + 15) // 16 = 2 pages * 16 * 4 branches
    assert kv_alloc_len_per_decode(WIDE, 16, 8) == 128 and kv_alloc_len_per_decode(DEEP, 16, 8) == 8
    assert bank.kv_alloc_len_per_decode(16) == 128
    with pytest.raises(AdaptiveSpecError):
        ShapeStateBank([])


# -- SGLang-side reference: draft, link and greedily verify trees ----------------------------------
def sglang_draft(bs: int, shape: TreeShape, vocab: int, gen: torch.Generator):
    """Draft trees as EAGLE's draft_forward + organize_draft_results do, from random draft
    distributions. Returns (parent_list [bs, *], top_scores_index [bs, ndt-1], draft_tokens)."""
    k = shape.topk

    def topk_probs(rows: int):
        p = torch.rand(rows, vocab, generator=gen).pow(4).softmax(-1)
        return torch.topk(p, k, dim=-1)

    p0, t0 = topk_probs(bs)
    score_levels, token_levels = [p0.unsqueeze(1)], [t0]
    parent_levels = [torch.arange(-1, k).expand(bs, -1)]
    beam = p0  # cumulative probability of the beam expanded next
    for i in range(1, shape.nsteps):
        p, t = topk_probs(bs * k)
        expanded = beam.unsqueeze(2) * p.view(bs, k, k)  # [bs, beam, children]
        beam, chosen = torch.topk(expanded.flatten(1), k, dim=-1)
        score_levels.append(expanded)
        token_levels.append(t.view(bs, k * k))
        parent_levels.append(chosen + k * k * (i - 1) + k)  # the chosen nodes' positions
    scores = torch.cat([s.flatten(1) for s in score_levels], dim=1)
    tokens = torch.cat(token_levels, dim=1)
    top = torch.sort(torch.topk(scores, shape.ndt - 1, dim=-1).indices).values
    parent_list = torch.cat(parent_levels[:-1], dim=1) if shape.nsteps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list, top, torch.gather(tokens, 1, top)


def sglang_link(parent_list: torch.Tensor, top: torch.Tensor, topk: int, ndt: int):
    """retrieve_index / next_token / next_sibling as build_tree_kernel_efficient writes them."""
    bs = top.shape[0]
    index = torch.arange(bs * ndt).view(bs, ndt)
    next_token = torch.full((bs, ndt), -1, dtype=torch.long)
    next_sibling = torch.full((bs, ndt), -1, dtype=torch.long)
    for b in range(bs):
        for i in range(ndt - 1, 0, -1):
            parent_slot = int(top[b, i - 1]) // topk
            if parent_slot == 0:
                pos = 0
            else:
                hits = (top[b] == parent_list[b, parent_slot]).nonzero()
                if len(hits) == 0:
                    continue
                pos = int(hits[0]) + 1
            first = int(next_token[b, pos])
            next_token[b, pos] = i
            if first != -1:
                next_sibling[b, i] = first
    return index, next_token, next_sibling


def sglang_verify_greedy(candidates, index, next_token, next_sibling, target_predict, width):
    """verify_tree_greedy_func: walk the first-child / next-sibling lists, accept the child that
    equals the target's token at the last accepted node."""
    bs, ndt = candidates.shape
    flat_target = target_predict.flatten()
    predict = torch.zeros(bs * ndt, dtype=torch.int32)
    accept_index = torch.full((bs, width), -1, dtype=torch.int32)
    accept_lens = torch.zeros(bs, dtype=torch.int32)
    for b in range(bs):
        last = int(index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, width):
            cur = int(next_token[b, cur])
            want = int(flat_target[last])
            while cur != -1 and int(candidates[b, cur]) != want:
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
            predict[last] = want
            accepted += 1
            last = int(index[b, cur])
            accept_index[b, accepted] = last
        predict[last] = int(flat_target[last])
        accept_lens[b] = accepted + 1
    return predict, accept_index, accept_lens


def target_logits(candidates, next_token, next_sibling, vocab, gen, p_follow=0.8):
    """[bs*ndt, V] logits whose argmax usually is one of the node's children (deep accepts)."""
    bs, ndt = candidates.shape
    logits = torch.randn(bs * ndt, vocab, generator=gen) * 0.1
    for b in range(bs):
        for i in range(ndt):
            kids, c = [], int(next_token[b, i])
            while c != -1:
                kids.append(int(candidates[b, c]))
                c = int(next_sibling[b, c])
            follow = kids and float(torch.rand(1, generator=gen)) < p_follow
            pick = kids[int(torch.randint(len(kids), (1,), generator=gen))] if follow else int(torch.randint(vocab, (1,), generator=gen))
            logits[b * ndt + i, pick] = 5.0
    return logits


def sglang_case(bs, shape, seed, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    parent_list, top, draft_tokens = sglang_draft(bs, shape, vocab, gen)
    index, next_token, next_sibling = sglang_link(parent_list, top, shape.topk, shape.ndt)
    root = torch.randint(vocab, (bs, 1), generator=gen)
    candidates = torch.cat([root, draft_tokens], dim=1)
    logits = target_logits(candidates, next_token, next_sibling, vocab, gen)
    return candidates, index, next_token, next_sibling, logits


SHAPES = [WIDE, MID, DEEP, TreeShape(4, 3, 10), TreeShape(1, 4, 5), TreeShape(2, 2, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bs", [1, 3])
def test_strict_verifier_through_wrap_matches_sglang_greedy(shape, bs):
    depths = []
    for seed in range(12):
        candidates, index, next_token, next_sibling, logits = sglang_case(bs, shape, seed)
        out = wrap_verify(
            StrictVerifier(), candidates=candidates, retrieve_index=index, retrieve_next_token=next_token,
            retrieve_next_sibling=next_sibling, logits=logits, spec_steps=shape.nsteps, topk=shape.topk,
        )
        target = logits.argmax(-1).view(bs, shape.ndt)
        ref_predict, ref_index, ref_lens = sglang_verify_greedy(candidates, index, next_token, next_sibling, target, shape.nsteps + 1)
        assert torch.equal(out.predict, ref_predict)
        assert torch.equal(out.accept_index, ref_index)
        assert torch.equal(out.accept_lens, ref_lens)
        assert out.promoted == (0,) * bs and list(out.accepted) == (ref_lens - 1).tolist()
        depths += out.accepted
    assert max(depths) >= (3 if shape == DEEP else 1)  # accepted deep enough to mean something


def test_outputs_have_eagle_sample_layout():
    shape, bs = MID, 2
    candidates, index, next_token, next_sibling, logits = sglang_case(bs, shape, seed=3)
    out = wrap_verify(StrictVerifier(), candidates=candidates, retrieve_index=index, retrieve_next_token=next_token,
                      retrieve_next_sibling=next_sibling, logits=logits, spec_steps=shape.nsteps, topk=shape.topk)
    assert out.predict.dtype == out.accept_index.dtype == out.accept_lens.dtype == torch.int32
    assert out.predict.shape == (bs * shape.ndt,) and out.accept_index.shape == (bs, shape.nsteps + 1)
    assert out.accept_lens.shape == (bs,) and torch.equal(out.num_correct_drafts, out.accept_lens - 1)
    for b in range(bs):
        n = int(out.accept_lens[b])
        row = out.accept_index[b]
        assert int(row[0]) == b * shape.ndt and (row[n:] == -1).all() and (row[:n] >= b * shape.ndt).all()
        emitted = out.predict[row[:n].long()]  # what run_eagle_verify commits: predict[accept_index]
        nodes = (row[1:n] - b * shape.ndt).long()
        assert torch.equal(emitted[:-1], candidates[b, nodes].int())  # accepted drafts, then the bonus
        assert int(emitted[-1]) == int(logits[row[n - 1]].argmax())


class FirstChild(Verifier):
    """Lossy test verifier: always accepts the root's first child, then stops."""

    name = "first-child"
    lossless = False

    def verify(self, tree, logits):
        child = int((tree.parents == 0).nonzero()[0])
        greedy = int(logits[0].argmax())
        promoted = int(int(tree.tokens[child]) != greedy)
        return VerifyResult(path=[0, child], tokens=[int(tree.tokens[child]), int(logits[child].argmax())], promoted=promoted)


def test_lossy_verifier_writes_promoted_tokens_where_sglang_reads_them():
    # root 0 -> children 1 (token 11), 2 (token 12); 1 -> 3 (token 13)
    parents = torch.tensor([[-1, 0, 0, 1]])
    index, next_token, next_sibling = retrieve_from_parents(parents)
    candidates = torch.tensor([[7, 11, 12, 13]])
    logits = torch.zeros(4, 20)
    logits[0, 12] = 1.0  # the target prefers 12: 11 is promoted
    logits[1, 5] = 1.0  # bonus after node 1
    out = wrap_verify(FirstChild(), candidates=candidates, retrieve_index=index, retrieve_next_token=next_token,
                      retrieve_next_sibling=next_sibling, logits=logits, spec_steps=2, topk=2)
    assert out.accept_index.tolist() == [[0, 1, -1]] and out.accept_lens.tolist() == [2]
    assert out.predict.tolist() == [11, 5, 0, 0] and out.promoted == (1,) and out.accepted == (1,)


def test_nodes_without_a_parent_link_are_never_accepted():
    # node 2's parent was not selected (the kernel left it unlinked); its child 3 neither
    candidates = torch.tensor([[7, 11, 12, 13]])
    index = torch.arange(4).view(1, 4)
    next_token = torch.tensor([[1, -1, 3, -1]])
    next_sibling = torch.full((1, 4), -1)
    logits = torch.zeros(4, 20)
    logits[0, 12] = 1.0  # would match orphan 2
    out = wrap_verify(StrictVerifier(), candidates=candidates, retrieve_index=index, retrieve_next_token=next_token,
                      retrieve_next_sibling=next_sibling, logits=logits, spec_steps=2, topk=2)
    assert out.accept_lens.tolist() == [1] and out.predict.tolist() == [12, 0, 0, 0]


def test_retrieve_layout_round_trip_and_argument_checks():
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4]])
    index, next_token, next_sibling = retrieve_from_parents(parents)
    assert next_token[0].tolist() == [1, 4, 6, -1, 7, -1, -1, -1]
    assert next_sibling[0].tolist() == [-1, 2, 3, -1, 5, -1, -1, -1]
    assert parents_from_retrieve(next_token[0].tolist(), next_sibling[0].tolist()) == parents[0].tolist()
    with pytest.raises(ValueError, match="expected 8 rows"):
        wrap_verify(StrictVerifier(), candidates=torch.zeros(1, 8, dtype=torch.long), retrieve_index=index,
                    retrieve_next_token=next_token, retrieve_next_sibling=next_sibling, logits=torch.zeros(7, 4),
                    spec_steps=3, topk=3)


def test_a_merged_step_records_the_width_it_verified():
    c = TripletController(StubPolicy())
    assert c.begin_step(probs(0.9, 0.9)) == DEEP
    c.note_sources({"head": 2, "retrieval": 5}, width=16)
    record = c.observe([4, 3])
    assert record.tree_size == 16 and record.shape == DEEP
    c.begin_step(probs(0.9))  # an unmerged step: the shape's rows, all the head's
    assert c.observe([1]).tree_size == DEEP.ndt


def test_a_merged_step_exports_its_width_and_the_accepted_tokens_of_each_proposer():
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="prometheus_client comes with sglang (scripts/install_sglang_cpu.sh)")
    from adaptivespec.sglang.metrics import SpecMetrics, parse_metrics
    reg = prometheus_client.CollectorRegistry()
    metrics = SpecMetrics(reg)
    metrics.declare_sources(["head", "retrieval"])
    c = TripletController(StubPolicy(), metrics=metrics)
    c.begin_step(probs(0.9, 0.9))
    c.note_sources({"head": 2, "retrieval": 5}, width=16)
    c.observe([4, 3])
    series = parse_metrics(prometheus_client.generate_latest(reg).decode())
    assert series['adaptivespec_accepted_tokens_total{source="retrieval"}'] == 5
    assert series['adaptivespec_accepted_tokens_total{source="head"}'] == 2
    assert series["adaptivespec_verify_rows_per_step_sum"] == 32  # 2 requests x 16 rows


def test_load_model_prices_the_rows_a_merged_tree_really_verified():
    load = LoadModel(CostModel(fixed=20.0, per_verified_token=1.0))
    load.observe(DEEP, 2.0)
    assert load.rows(DEEP) == DEEP.ndt and load.step_ms(DEEP, 2) == pytest.approx(20 + 2 * DEEP.ndt)
    load.observe(DEEP, 2.0, rows=16)  # the draft stage added 8 rows: the moving average moves toward 16
    assert DEEP.ndt < load.rows(DEEP) < 16
    assert load.step_ms(DEEP, 2) == pytest.approx(20 + 2 * load.rows(DEEP))


def test_the_roots_entropy_is_measured_in_draft_extend_only_and_reaches_the_policy():
    """SGLang hands over the root's top-k only: the draft-extend's distributions are measured (the
    EAGLE module's ``renorm_draft_probs`` wrapped) and the step's signals carry their entropy."""
    from adaptivespec.sglang import root_entropy

    dist = torch.tensor([[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]])
    module = types.SimpleNamespace(renorm_draft_probs=lambda logits, *a: dist)
    root_entropy.keep_root_entropy(module)
    root_entropy.keep_root_entropy(module)  # once: not wrapped twice
    module.renorm_draft_probs(None)  # a draft level's call: not measured
    assert root_entropy.take(2) is None
    with root_entropy.measuring(True):
        assert module.renorm_draft_probs(None) is dist
    h = root_entropy.take(2)
    assert h.tolist() == pytest.approx([1.5 * math.log(2), 0.0])
    assert root_entropy.take(2) is None  # used once
    with root_entropy.measuring(True):
        module.renorm_draft_probs(None)
    assert root_entropy.take(3) is None  # not this batch's rows
    c = TripletController(StubPolicy())  # batch signals: the mean over requests
    c.begin_step(probs(0.9, 0.5), entropy=h)
    rec = c.observe([1, 1])
    assert rec.signals.draft_entropy == pytest.approx(0.75 * math.log(2))  # the batch's mean
    c.begin_step(probs(0.9))
    assert c.observe([1]).signals.draft_entropy == 0.0  # not measured: unknown


def test_the_trace_records_what_the_policy_saw_at_the_root(tmp_path):
    from adaptivespec.sglang.trace import StepTrace

    trace = StepTrace(tmp_path / "steps.jsonl")
    c = TripletController(StubPolicy(), on_trace=trace.write)
    c.begin_step(probs(0.9), entropy=torch.tensor([0.25]))
    c.observe([2])
    line = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])
    assert line["shape"] == [DEEP.nsteps, DEEP.topk, DEEP.ndt] and line["accepted"] == 2
    assert line["signals"]["p1"] == pytest.approx(0.9) and line["signals"]["entropy"] == pytest.approx(0.25)
    assert line["signals"]["top4"] >= line["signals"]["p1"]


def test_on_a_cpu_the_compiled_top_k_selection_runs_uncompiled(monkeypatch):
    from adaptivespec.sglang.uncompiled import ENV, run_uncompiled

    def later(x):
        return x + 1

    module = types.SimpleNamespace(_select_top_k_tokens_later=torch.compile(later, dynamic=True))
    monkeypatch.setenv(ENV, "1")
    assert run_uncompiled(module) == [] and module._select_top_k_tokens_later is not later  # kept compiled
    monkeypatch.delenv(ENV)
    assert run_uncompiled(module) == ["_select_top_k_tokens_later"] and module._select_top_k_tokens_later is later
    assert run_uncompiled(module) == []  # already plain
