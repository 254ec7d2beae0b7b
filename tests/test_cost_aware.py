"""Policy ``cost_aware`` and its pieces: the cost-model fit, the calibration map, the level (stop)
rule and the budget rule on hand-built trees, the bank bounds and the circuit breaker (no model)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from adaptivespec.params import structure
from adaptivespec.costmodel import LOGP_EDGES, CalibrationMap, CostModel, rank_by_value, save_prior
from adaptivespec.errors import AdaptiveSpecError, ConfigError
from adaptivespec.policies.cost_aware import CostAwareParams, CostAwarePolicy
from adaptivespec.testing import draft_with_fake_drafter
from adaptivespec.tree import make_tree
from adaptivespec.types import StepRecord, TreeShape, VerifyResult

BINS = len(LOGP_EDGES) + 1
CENTRES = [-0.02] + [(a + b) / 2 for a, b in zip(LOGP_EDGES, LOGP_EDGES[1:])] + [-9.0]  # one log-prob per bin


# -- cost model ----------------------------------------------------------------------------------
def test_cost_model_fit_recovers_synthetic_coefficients_and_round_trips(tmp_path):
    true = dict(fixed=50.0, per_context=0.004, per_draft_level=1.8, per_draft_node=0.07, per_verified_token=1.4)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k, ndt in itertools.product((1, 3, 5, 7), (1, 2, 4, 8), (3, 8, 16, 24)):
        for P in (100, 400, 900):
            L, E = n - 1, (n - 1) * k
            t = true["fixed"] + true["per_context"] * P + true["per_draft_level"] * L + true["per_draft_node"] * E + true["per_verified_token"] * ndt
            rows.append((P, L, E, ndt, t * (1 + 0.01 * float(torch.randn(1, generator=gen)))))
    model = CostModel.fit(rows, command="test")
    for key, value in true.items():
        assert getattr(model, key) == pytest.approx(value, rel=0.1, abs=0.02), key
    assert model.meta["fit"]["mean_abs_rel_error"] < 0.02 and model.meta["fit"]["steps"] == len(rows)
    model.save(tmp_path / "p.json")
    back = CostModel.load(tmp_path / "p.json")
    assert back.step_ms(8, 3, 12, 500) == pytest.approx(model.step_ms(8, 3, 12, 500))
    assert back.meta["command"] == "test"


def test_cost_model_terms_no_row_varies_are_zero_and_bad_input_is_refused(tmp_path):
    model = CostModel.fit([(100, 2, 8, n, 10.0 + 2.0 * n) for n in (3, 5, 9)])
    assert model.per_verified_token == pytest.approx(2.0) and model.per_draft_level == 0.0 and model.per_context == 0.0
    with pytest.raises(AdaptiveSpecError, match="at least 2"):
        CostModel.fit([(1, 1, 1, 2, 3.0)])
    (tmp_path / "bad.json").write_text('{"coefficients_ms": {"fixed": -1}}')
    with pytest.raises(ValueError, match="fixed > 0"):
        CostModel.load(tmp_path / "bad.json")


def test_cost_model_fits_the_per_row_growth_with_context_and_old_profiles_load_without_it(tmp_path):
    # each verified row attends over the context: 0.3 ms + 0.0002 ms per committed position
    rows = [(P, 2, 8, n, 30.0 + 0.002 * P + 1.5 * 2 + (0.3 + 0.0002 * P) * n)
            for P in (256, 1024, 2048, 4096) for n in (1, 4, 8, 16, 32)]
    model = CostModel.fit(rows)
    assert model.per_verified_token == pytest.approx(0.3, rel=0.05)
    assert model.per_verified_token_context == pytest.approx(0.0002, rel=0.05)
    assert model.token_ms(4096) == pytest.approx(0.3 + 0.0002 * 4096, rel=0.02)
    assert model.step_ms(16, 2, 8, 4096) == pytest.approx(rows[-2][4], rel=0.01)
    # one context length: the product term would only re-express the per-row cost, so it stays 0
    flat = CostModel.fit([r for r in rows if r[0] == 1024])
    assert flat.per_verified_token_context == 0.0
    assert flat.token_ms(1024) == pytest.approx(0.3 + 0.0002 * 1024, rel=0.05)
    (tmp_path / "old.json").write_text(json.dumps({"coefficients_ms": {"fixed": 30.0, "per_verified_token": 1.0}}))
    old = CostModel.load(tmp_path / "old.json")
    assert old.per_verified_token_context == 0.0 and old.token_ms(4096) == 1.0


def test_cost_aware_verifies_fewer_rows_where_rows_cost_more(tmp_path):
    from adaptivespec.types import StepSignals

    cost = tmp_path / "ctx.json"
    CostModel(fixed=30.0, per_draft_level=0.5, per_verified_token=0.2, per_verified_token_context=0.002,
              context_ref=0).save(cost)
    pr = tmp_path / "prior.json"
    save_prior(pr, true_table(8), torch.ones_like(true_table(8)), shrink=0)
    pol = CostAwarePolicy(structure(CostAwareParams, {"profile": str(cost), "prior": str(pr), "prior_weight": 1e6},
                                    "test", "policy"))
    values = torch.tensor([0.9, 0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.2, 0.15, 0.1, 0.05])
    kept = {}
    for P in (128, 4096):
        pol.next_shape(StepSignals(step=0, draft_top1_prob=0.9, last_accepted=1, context=P))
        _, kept[P], _ = rank_by_value(values.numpy(), base_ms=pol._base_ms(1, 4), per_token_ms=pol._token_ms,
                                      min_keep=1, max_keep=11)
    assert pol._token_ms == pytest.approx(0.2 + 0.002 * 4096)
    assert kept[4096] < kept[128]


# -- calibration map ---------------------------------------------------------------------------------
def true_table(depths: int) -> torch.Tensor:
    """A monotone acceptance table: likelier bins and shallower depths accept more."""
    bins = torch.linspace(0.9, 0.05, BINS)
    return torch.stack([bins * 0.85**d for d in range(depths + 1)])


def test_calibration_map_converges_on_a_synthetic_stream():
    depths = 4
    truth = true_table(depths)
    cal = CalibrationMap(torch.full((depths + 1, BINS), 0.5), prior_weight=8.0, decay=1.0)
    gen = torch.Generator().manual_seed(1)
    centres = torch.tensor(CENTRES)
    for _ in range(400):
        d = torch.randint(1, depths + 1, (64,), generator=gen)
        b = torch.randint(0, BINS, (64,), generator=gen)
        hit = torch.rand(64, generator=gen) < truth[d, b]
        cal.update(d, centres[b], hit)
    got = torch.from_numpy(cal.table()[1:])
    assert (got - truth[1:].double()).abs().max() < 0.06
    rel = cal.reliability()
    assert rel["nodes"] == 400 * 64 and sum(rel["count"]) == rel["nodes"]
    late = CalibrationMap(torch.full((depths + 1, BINS), 0.5), prior_weight=8.0, decay=1.0)
    assert rel["ece"] is not None and late.reliability()["ece"] is None


def test_calibration_values_are_monotone_so_children_never_beat_parents():
    noisy = torch.rand(6, BINS, generator=torch.Generator().manual_seed(2))
    cal = CalibrationMap(noisy, prior_weight=1.0)
    t = torch.from_numpy(cal.table())
    assert (t[1:, :-1] >= t[1:, 1:]).all()  # likelier bin >= less likely
    assert (t[1:-1] >= t[2:]).all()  # shallower >= deeper


def test_observe_tree_counts_verified_and_accepted_nodes(tmp_path):
    pol = make_policy(tmp_path)
    # root; depth 1: nodes 1, 2; depth 2: node 3 under 1
    tree = make_tree(torch.tensor([9, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]), draft_logp=torch.tensor([0.0, -0.02, -1.2, -0.2]))
    pol.observe_tree(tree, VerifyResult(path=[0, 1, 3], tokens=[5, 7, 8]))
    cal = pol.calib
    cells = cal.cells(torch.tensor([1, 1, 2]), torch.tensor([-0.02, -1.2, -0.2]))
    assert cal.n.ravel()[cells].tolist() == [1.0, 1.0, 1.0]
    assert cal.acc.ravel()[cells].tolist() == [1.0, 0.0, 1.0]
    assert cal.n.sum() == 3 and cal.acc.sum() == 2


# -- hand-built policies -------------------------------------------------------------------------------
def make_policy(tmp_path, *, level=1.0, node=0.0, token=1.0, fixed=50.0, prior=None, **params) -> CostAwarePolicy:
    cost = tmp_path / "cost.json"
    CostModel(fixed=fixed, per_draft_level=level, per_draft_node=node, per_verified_token=token, context_ref=0).save(cost)
    table = true_table(8) if prior is None else prior
    pr = tmp_path / "prior.json"
    save_prior(pr, table, torch.ones_like(table), shrink=0)
    params = {"profile": str(cost), "prior": str(pr), "prior_weight": 1e6, **params}
    return CostAwarePolicy(structure(CostAwareParams, params, "test", "policy"))


def level_one(pol: CostAwarePolicy, scores: list[float]):
    return pol.select_level(torch.tensor(scores), 1, pol.shape, 0)


def test_next_level_is_drafted_when_it_pays_and_not_when_it_does_not(tmp_path):
    confident = [-0.02, -2.5, -3.5, -5.0]
    # cheap levels: expected tokens from the next level exceed its price
    pool, beam = level_one(make_policy(tmp_path, level=0.5, token=0.5), confident)
    assert pool is None and beam.numel() == 4
    # an expensive level (as long as a whole step) does not pay
    pol = make_policy(tmp_path, level=60.0, token=0.5)
    _, beam = level_one(pol, confident)
    assert beam.numel() == 0 and pol.state()["stop"] == "cost"
    # the same cheap level with an unlikely draft: nothing worth drafting below it
    _, beam = level_one(make_policy(tmp_path, level=0.5, token=0.5, prior=true_table(8) * 0.02), [-8.0] * 4)
    assert beam.numel() == 0


def brute_best_k(values: list[float], base: float, token: float, lo: int, hi: int) -> int:
    vs = sorted(values, reverse=True)
    return max(range(lo, hi + 1), key=lambda k: ((1 + sum(vs[:k])) / (base + token * (k + 1)), -k))


@pytest.mark.parametrize("token", [0.05, 0.5, 2.0, 6.0])
def test_budget_is_the_best_tokens_per_ms_prefix(tmp_path, token):
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        v = torch.rand(30, generator=gen) ** 2
        order, k, rate = rank_by_value(v, base_ms=50.0, per_token_ms=token, min_keep=1, max_keep=11)
        assert k == brute_best_k(v.tolist(), 50.0, token, 1, 11)
        assert 1 <= k <= 11 and sorted(order[:k].tolist()) == sorted(torch.topk(v, k).indices.tolist())
        assert rate == pytest.approx((1 + float(v[order[:k]].sum())) / (50.0 + token * (k + 1)), rel=1e-5)


def test_budget_keeps_forced_candidates_and_ancestors(tmp_path):
    v = torch.tensor([0.9, 0.05, 0.8, 0.85, 0.01])
    forced = torch.tensor([False, True, False, False, False])
    order, k, _ = rank_by_value(v, base_ms=1.0, per_token_ms=5.0, min_keep=1, forced=forced)
    assert k >= 1 and int(order[0]) == 1  # the forced candidate comes first however low its value
    # candidate 3 is a child of 1 (low value): with ancestors, its value is capped by its parent's
    parents = torch.tensor([-1, -1, 0, 1, 2])
    anc = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        j = p
        while j >= 0:
            anc[i, j] = True
            j = int(parents[j])
    for token in (0.01, 0.3, 1.0):
        order, k, _ = rank_by_value(v, base_ms=2.0, per_token_ms=token, ancestors=anc)
        kept = set(order[:k].tolist())
        assert all(p in kept for i in kept for p in [int(parents[i])] if p >= 0), (token, kept)


def test_select_final_keeps_roots_best_and_is_ancestor_closed_on_a_hand_built_tree(tmp_path):
    # depth 1: four root children; depth 2: children of the best two (scores cumulative)
    pol = make_policy(tmp_path, level=0.1, token=4.0, min_keep=2)
    s1 = torch.tensor([-0.02, -2.5, -3.2, -6.0])
    pool1, beam = pol.select_level(s1, 1, pol.shape, 0)
    assert beam.numel() > 0
    s2 = torch.tensor([-0.1, -3.0, -4.0, -7.0, -2.6, -5.0, -6.0, -8.0, -3.3, -5.0, -9.0, -9.5, -6.1, -7.0, -8.0, -9.0])
    pol._values.append(pol.calib.values(2, s2)), pol._levels.append(16)  # as select_level(depth=2) would
    kept = pol.select_final(torch.cat([s1, s2]), pol.shape)
    kept_set = set(kept.tolist())
    assert {0, 1} <= kept_set  # the root's two best children, the second one despite its low value
    parent_of = {4 + j: j // 4 for j in range(16)}  # pool index of depth-2 node -> its depth-1 parent
    assert all(parent_of[i] in kept_set for i in kept_set if i >= 4)
    assert pol.state()["budget"] == len(kept_set) + 1


@pytest.mark.parametrize("temperature", [0.05, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("costs", [dict(level=0.1, token=0.1), dict(level=2.0, token=1.4), dict(level=40.0, token=8.0)])
def test_trees_stay_inside_the_bank_and_ancestor_closed(tmp_path, temperature, costs):
    pol = make_policy(tmp_path, buckets=[3, 5, 9], max_depth=5, topk=3, **costs)
    for seed in range(4):
        tree = draft_with_fake_drafter(pol, pol.shape, seed=seed, temperature=temperature)
        assert 2 <= tree.size <= 9
        assert tree.shape in pol.shapes() and tree.size <= tree.shape.ndt
        assert tree.shape.ndt == min(b for b in (3, 5, 9) if b >= tree.size)  # the smallest bucket
        # ancestor-closed: every node's depth is its parent's + 1 (a dropped parent would re-attach to the root)
        d = tree.depth
        assert (d[1:] == d[tree.parents[1:]] + 1).all()
        assert bool((tree.draft_logp[1:] <= tree.draft_logp[tree.parents[1:]] + 1e-6).all())


def test_fill_buckets_pads_with_next_best_nodes(tmp_path):
    pol = make_policy(tmp_path, buckets=[4, 8], level=0.1, token=30.0, fill_buckets=True)
    tree = draft_with_fake_drafter(pol, pol.shape, seed=0, temperature=0.3)
    assert tree.size in (4, 8)


def test_circuit_breaker_forces_a_full_tree(tmp_path):
    pol = make_policy(tmp_path, level=500.0, token=0.5, breaker_steps=3, buckets=[3, 6], max_depth=4, topk=2)
    small = draft_with_fake_drafter(pol, pol.shape, seed=0)
    assert int(small.depth.max()) == 1  # levels far too expensive: depth 1 only
    rec = StepRecord(step=0, shape=pol.shape, tree_size=small.size, accepted=0, promoted=0, new_tokens=1,
                     draft_ms=0.0, verify_ms=0.0, other_ms=0.0)
    for i in range(3):
        assert not pol.state()["breaker_tripped"]
        pol.observe(rec)
    assert pol.state()["breaker_tripped"]
    full = draft_with_fake_drafter(pol, pol.shape, seed=0)
    assert full.size == 6 and int(full.depth.max()) > 1 and pol.state()["stop"] in ("breaker", "max_depth")
    pol.observe(rec)
    assert int(draft_with_fake_drafter(pol, pol.shape, seed=0).depth.max()) == 1  # one probe, then back


def test_state_reports_decisions_and_reliability(tmp_path):
    pol = make_policy(tmp_path, trace_every=2)
    tree = draft_with_fake_drafter(pol, pol.shape, seed=0, temperature=0.2)
    st = pol.state()
    assert st["levels"] == len(st["level_widths"]) >= 1 and st["budget"] == tree.size
    assert st["expected_tokens"] >= 1.0 and "reliability" in st
    json.dumps(st)


def test_bad_params_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.buckets"):
        structure(CostAwareParams, {"buckets": [1, 4]}, "f.yaml", "policy")
    with pytest.raises(ConfigError, match=r"policy\.profile.*not found"):
        structure(CostAwareParams, {"profile": str(tmp_path / "none.json")}, "f.yaml", "policy")
    with pytest.raises(ConfigError, match=r"policy\.buckets"):
        structure(CostAwareParams, {"buckets": [40], "max_depth": 2, "topk": 2}, "f.yaml", "policy")


def test_shipped_defaults_load():
    pol = CostAwarePolicy()
    assert pol.cost.fixed > 0 and pol.cost.meta["command"].startswith("adaptivespec calibrate")
    assert pol.cost.meta["fit"]["mean_abs_rel_error"] < 0.1  # the shipped profile is a calibrate run, and fits
    assert pol.shape in pol.shapes() and max(s.ndt for s in pol.shapes()) == max(pol.params.buckets)


def test_plot_trace_draws_the_decisions(tmp_path):
    from adaptivespec.trace import plot_trace

    pol = make_policy(tmp_path, trace_every=1)
    lines = []
    for step in range(6):
        tree = draft_with_fake_drafter(pol, pol.shape, seed=step, temperature=0.3)
        pol.observe_tree(tree, VerifyResult(path=[0, 1], tokens=[1, 2]))
        rec = StepRecord(step=step, shape=pol.shape, tree_size=tree.size, accepted=1, promoted=0, new_tokens=2,
                         draft_ms=1.0, verify_ms=2.0, other_ms=0.5, policy_state=pol.state())
        lines.append(json.dumps({"id": "a", **rec.to_dict()}))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert json.loads(lines[-1])["policy_state"]["reliability"]["nodes"] > 0
    plot_trace(trace, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- calibrate ----------------------------------------------------------------------------------------
def test_calibrate_step_rows_track_context_and_skip_the_first_step():
    from adaptivespec.calibrate import step_rows

    s = TreeShape(4, 2, 6)
    recs = [StepRecord(step=i, shape=s, tree_size=6, accepted=a, promoted=0, new_tokens=a + 1, draft_ms=1.0,
                       verify_ms=2.0, other_ms=0.5) for i, a in enumerate([2, 0, 3])]
    assert step_rows(10, recs) == [(13, 3, 6, 6, 3.5), (14, 3, 6, 6, 3.5)]


def test_calibrate_refuses_a_bad_shape_in_one_line(capsys):
    from adaptivespec.cli import main

    assert main(["calibrate", "--config", "configs/eagle3.yaml", "--shapes", "2,2,40"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--shapes" in err and "2,2,40" in err


def test_continuation_rate_counts_accepted_nodes_with_verified_children(tmp_path):
    pol = make_policy(tmp_path, decay=1.0)
    n0, a0 = pol._cont_n.copy(), pol._cont_a.copy()
    # root -> 1 -> 3 (chain accepted to depth 2), 2 is a sibling of 1 with no children
    tree = make_tree(torch.tensor([9, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]), draft_logp=torch.tensor([0.0, -0.1, -2.0, -0.3]))
    pol.observe_tree(tree, VerifyResult(path=[0, 1, 3], tokens=[5, 7, 8]))
    # depth 1 (root had children, path went on), depth 2 (node 1 had a child, path went on); node 3 has none
    assert (pol._cont_n - n0).tolist()[:4] == [0, 1, 1, 0]
    assert (pol._cont_a - a0).tolist()[:4] == [0, 1, 1, 0]
    pol.observe_tree(tree, VerifyResult(path=[0, 1], tokens=[5, 8]))  # stopped at 1 although 3 was verified
    assert (pol._cont_n - n0).tolist()[:4] == [0, 2, 2, 0]
    assert (pol._cont_a - a0).tolist()[:4] == [0, 2, 1, 0]


@pytest.mark.parametrize("explore", [0.0, 1.0])
def test_a_level_stopped_on_old_evidence_is_tried_again_only_with_explore(tmp_path, explore):
    """The trap of 2026-12-02: a continuation rate measured low on one kind of prompt stops the level
    rule from drafting that depth, so the rate never sees new evidence. With ``explore`` the bound
    widens as the old evidence decays and the level is drafted again; with 0 it never is."""
    scores = [-0.02, -6.0, -7.0, -8.0]
    pol = make_policy(tmp_path, level=4.0, token=6.0, lookahead=1, decay=0.9, explore=explore)
    pol._cont_n[2], pol._cont_a[2] = 100.0, 20.0  # depth 1 -> 2 went on 20% of 100 times
    _, beam = level_one(pol, scores)
    assert beam.numel() == 0 and pol.state()["stop"] == "cost"
    # 40 steps whose trees stop at depth 1: no evidence about depth 2, the counts decay
    shallow = make_tree(torch.tensor([9, 5]), torch.tensor([-1, 0]), draft_logp=torch.tensor([0.0, -0.02]))
    for _ in range(40):
        pol.observe_tree(shallow, VerifyResult(path=[0, 1], tokens=[5, 8]))
    assert pol.continuation()[2] == pytest.approx(0.2)  # the point estimate has not moved
    _, beam = level_one(pol, scores)
    assert beam.numel() == (4 if explore else 0)


@pytest.mark.parametrize("cont_prior", [0.0, 4.0])
def test_a_level_stopped_on_old_evidence_returns_toward_the_prior_only_with_cont_prior(tmp_path, cont_prior):
    """The same trap, the other way out: with ``cont_prior`` pseudo-observations of 1/2 that do not
    decay, the decayed old evidence weighs less and less against them, so the point estimate drifts
    back toward 1/2 and the level is drafted again; with 0 the ratio (and the stop) stays."""
    scores = [-0.02, -6.0, -7.0, -8.0]
    pol = make_policy(tmp_path, level=4.0, token=6.0, lookahead=1, decay=0.9, cont_prior=cont_prior)
    pol._cont_n[2], pol._cont_a[2] = 100.0, 20.0
    _, beam = level_one(pol, scores)
    assert beam.numel() == 0 and pol.state()["stop"] == "cost"
    assert pol.continuation()[2] == pytest.approx((20.0 + 0.5 * cont_prior) / (100.0 + cont_prior))
    shallow = make_tree(torch.tensor([9, 5]), torch.tensor([-1, 0]), draft_logp=torch.tensor([0.0, -0.02]))
    for _ in range(40):
        pol.observe_tree(shallow, VerifyResult(path=[0, 1], tokens=[5, 8]))
    n, a = 100.0 * 0.9**40, 20.0 * 0.9**40
    assert pol.continuation()[2] == pytest.approx((a + 0.5 * cont_prior) / (n + cont_prior))
    _, beam = level_one(pol, scores)
    assert beam.numel() == (4 if cont_prior else 0)


def test_cont_prior_rejects_a_negative_weight(tmp_path):
    with pytest.raises(ValueError, match="got -1"):
        make_policy(tmp_path, cont_prior=-1)
