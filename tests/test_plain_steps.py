"""Plain steps where no tree pays: the cost model's ``tree_step`` (two rows cost more than the line
through one row says: llama.cpp's switch of kernels), ``rank_by_value`` choosing the root alone,
``cost_aware`` with ``min_keep: 0`` and its plain streak (no model: hand-built costs and trees)."""

from __future__ import annotations

import pytest
import torch

from adaptivespec.costmodel import LOGP_EDGES, CostModel, rank_by_value, save_prior
from adaptivespec.errors import ConfigError
from adaptivespec.fastpath.costs import CostTable
from adaptivespec.params import structure
from adaptivespec.policies.cost_aware import CostAwareParams, CostAwarePolicy
from adaptivespec.testing import draft_with_fake_drafter
from adaptivespec.tree import make_tree
from adaptivespec.types import StepRecord, VerifyResult

# llama.cpp's shape, in ms (a Q8_0 file on a 2-vCPU EPYC): one row, then a jump at two, then ~2 ms a row
ROWS = (1, 2, 4, 8, 16)
SHORT = (8.8, 16.8, 20.8, 28.8, 44.8)
LONG = (12.0, 22.0, 26.0, 34.0, 50.0)
JUMPY = CostTable(rows=ROWS, verify_short=SHORT, verify_long=LONG, contexts=(128, 1024), per_request=0.0,
                  draft_rows=(1, 4), draft=(1.5, 1.5), machine={"cpu": "Test CPU", "target": "t"})


def test_a_jump_at_two_rows_is_the_tree_step_and_every_row_count_is_the_tables():
    m = CostModel.from_table(JUMPY, topk=4, rows=16)
    # from two rows on the line is 2 ms a row: at one row it says 14.8, the table 8.8 (short) / 20.0 vs 12.0 (long)
    assert m.tree_step == pytest.approx((6.0 + 8.0) / 2)
    for P, table in ((128, SHORT), (1024, LONG)):
        for n, ms in zip(ROWS, table):
            jump_error = 0.0 if n == 1 else (1.0 if P == 128 else -1.0)  # the two contexts' jumps, averaged
            assert m.step_ms(n, context=P) == pytest.approx(ms + 1.5 + jump_error)
    linear = CostTable(rows=(1, 16), verify_short=(8.0, 38.0), verify_long=(8.0, 38.0), contexts=(128, 1024),
                       per_request=0.0, draft_rows=(), draft=())
    assert CostModel.from_table(linear, topk=4, rows=16).tree_step == 0.0  # the torch runtime's: no jump


def test_tree_step_round_trips_and_older_profiles_load_without_it(tmp_path):
    m = CostModel.from_table(JUMPY, topk=4, rows=16)
    m.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").tree_step == pytest.approx(m.tree_step)
    CostModel(fixed=5.0, per_verified_token=1.0).save(tmp_path / "old.json")
    assert CostModel.load(tmp_path / "old.json").tree_step == 0.0


def test_the_root_alone_wins_when_the_jump_eats_what_a_node_adds():
    values = [0.7, 0.3, 0.1]
    # without a jump the best child pays (1.7 tokens / 12 ms > 1 / 10)
    _, k, _ = rank_by_value(values, base_ms=8.0, per_token_ms=2.0, min_keep=0)
    assert k >= 1
    # a 6 ms jump: 1.7 / 18 < 1 / 10, and no longer prefix pays it either
    _, k, rate = rank_by_value(values, base_ms=8.0, per_token_ms=2.0, min_keep=0, tree_ms=6.0)
    assert k == 0 and rate == pytest.approx(1 / 10)
    # a confident chain pays even the jump: (1 + 0.95 + 0.9 + 0.85) / (8 + 6 + 2 x 4) > 1 / 10
    _, k, _ = rank_by_value([0.95, 0.9, 0.85], base_ms=8.0, per_token_ms=2.0, min_keep=0, tree_ms=6.0)
    assert k == 3
    # min_keep 1 verifies a tree whatever it costs: its best one (2.0 / 20 ms beats 1.7 / 18)
    _, k, _ = rank_by_value(values, base_ms=8.0, per_token_ms=2.0, min_keep=1, tree_ms=6.0)
    assert k == 2


def policy(tmp_path, *, tree_step: float, **params) -> CostAwarePolicy:
    cost = tmp_path / "cost.json"
    CostModel(fixed=8.0, per_draft_level=1.5, per_verified_token=2.0, tree_step=tree_step, context_ref=0).save(cost)
    bins = torch.linspace(0.9, 0.05, len(LOGP_EDGES) + 1)
    table = torch.stack([bins * 0.85**d for d in range(9)])
    prior = tmp_path / "prior.json"
    save_prior(prior, table, torch.ones_like(table), shrink=0)
    p = {"profile": str(cost), "prior": str(prior), "prior_weight": 1e6, "min_keep": 0, **params}
    return CostAwarePolicy(structure(CostAwareParams, p, "test", "policy"))


def test_min_keep_0_verifies_the_root_alone_only_where_nothing_pays(tmp_path):
    dear = policy(tmp_path, tree_step=40.0)
    tree = draft_with_fake_drafter(dear, dear.shape, seed=1, temperature=0.05)  # confident drafts
    assert tree.size == 1 and dear.state()["budget"] == 1
    cheap = policy(tmp_path, tree_step=0.0)
    assert draft_with_fake_drafter(cheap, cheap.shape, seed=1, temperature=0.05).size > 1
    with pytest.raises(ConfigError, match="min_keep"):
        structure(CostAwareParams, {"min_keep": -1}, "test", "policy")


def root_alone() -> tuple:
    return make_tree(torch.tensor([7]), torch.tensor([-1])), VerifyResult(path=[0], tokens=[8])


def plain_steps(pol: CostAwarePolicy) -> int:
    n = 0
    while pol.plain_next():
        n += 1
    return n


def test_the_plain_streak_doubles_up_to_its_cap_and_a_tree_ends_it(tmp_path):
    pol = policy(tmp_path, tree_step=40.0, plain_streak=4)
    assert plain_steps(pol) == 0  # nothing decided yet: the first step drafts
    runs = []
    for _ in range(4):
        pol.observe_tree(*root_alone())
        runs.append(plain_steps(pol))
    assert runs == [1, 2, 4, 4]
    tree = make_tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 1]), draft_logp=torch.tensor([0.0, -0.1, -0.2]))
    pol.observe_tree(tree, VerifyResult(path=[0, 1], tokens=[8, 3]))
    pol.observe_tree(*root_alone())
    assert plain_steps(pol) == 1  # the tree reset the streak
    pol.reset()
    assert plain_steps(pol) == 0
    off = policy(tmp_path, tree_step=40.0, plain_streak=0)
    off.observe_tree(*root_alone())
    assert plain_steps(off) == 0


def test_steps_that_verified_the_root_alone_do_not_trip_the_breaker(tmp_path):
    pol = policy(tmp_path, tree_step=40.0, breaker_steps=2)
    plain = StepRecord(step=0, shape=pol.shape, tree_size=1, accepted=0, promoted=0, new_tokens=1,
                       draft_ms=0.0, verify_ms=0.0, other_ms=0.0)
    for _ in range(5):
        pol.observe(plain)
    assert not pol.state()["breaker_tripped"] and pol.state()["zero_streak"] == 0


def test_drafted_steps_slower_than_priced_teach_the_policy_to_go_plain(tmp_path):
    pol = policy(tmp_path, tree_step=0.0)
    assert draft_with_fake_drafter(pol, pol.shape, seed=2, temperature=0.3).size > 1  # priced alone, a tree pays
    slow = StepRecord(step=0, shape=pol.shape, tree_size=3, accepted=1, promoted=0, new_tokens=2,
                      draft_ms=2 * pol._priced, verify_ms=0.0, other_ms=0.0)  # every drafted step takes twice its price
    for _ in range(40):
        pol.observe(slow)
    assert pol.state()["tree_overhead_ms"] == pytest.approx(slow.draft_ms / 2, rel=0.05)
    assert draft_with_fake_drafter(pol, pol.shape, seed=2, temperature=0.3).size == 1
    for _ in range(60):  # root-alone steps: the overhead fades until a tree is tried again
        pol.observe_tree(*root_alone())
    assert pol.state()["tree_overhead_ms"] < 0.01 * slow.draft_ms
    assert draft_with_fake_drafter(pol, pol.shape, seed=2, temperature=0.3).size > 1
