"""Policy ``post_draft`` and its path calibration: the verified subtree is the best one (brute force),
the level rule stops and narrows the beam where rows cost more than they bring, sources are valued
by their own fit, the fit recovers a known model, and the shipped config is lossless (real model)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptivespec.config import load_config
from adaptivespec.costmodel import (
    HEAD,
    CostModel,
    PathCalibration,
    expected_calibration_error,
    fit_logistic,
)
from adaptivespec.errors import ConfigError
from adaptivespec.fusion import fuse
from adaptivespec.params import structure
from adaptivespec.policies.post_draft import PostDraftParams, PostDraftPolicy
from adaptivespec.testing import draft_with_fake_drafter
from adaptivespec.analysis.post_draft_fit import capped, fit_by_depth, path_ok
from adaptivespec.types import CandidateTrie, TreeShape

ROOT = Path(__file__).parents[1]


def make_policy(tmp_path, *, token_ms=0.5, level_ms=0.5, head=(0.0, 1.0, 0.0), cont=0.6, source=None, **params):
    """A post_draft policy with a hand-set cost profile and a calibration ``sigmoid(a + b logp + c edge)`` at every depth."""
    cost = tmp_path / "cost.json"
    CostModel(fixed=20.0, per_draft_level=level_ms, per_draft_node=0.01, per_verified_token=token_ms, context_ref=0).save(cost)
    weights = {HEAD: np.tile(np.array(head, dtype=np.float64), (6, 1))}
    if source is not None:
        weights["retrieval"] = np.tile(np.array(source, dtype=np.float64), (8, 1))
    cal = tmp_path / "cal.json"
    PathCalibration(weights=weights, continuation=np.full(8, cont)).save(cal)
    return PostDraftPolicy(structure(PostDraftParams, {"profile": str(cost), "calibration": str(cal), **params}, "test", "policy"))


def recorded_draft(policy, seed=0, temperature=1.0):
    """Draft one tree, recording each level's scores and the beam the policy expanded."""
    levels = []
    select_level = policy.select_level

    def spy(scores, depth, shape, nodes):
        pool, beam = select_level(scores, depth, shape, nodes)
        levels.append((scores.clone(), beam.clone()))
        return pool, beam

    policy.select_level = spy
    try:
        tree = draft_with_fake_drafter(policy, seed=seed, temperature=temperature)
    finally:
        del policy.select_level
    return tree, levels


def pool_of(levels, k, head):
    """Every drafted node's (parent in the pool, value) rebuilt independently of the policy."""
    a, b, c = head
    parents, scores, values = [], [], []
    prev_idx = None
    for d, (s, beam) in enumerate(levels):
        n0 = len(scores)
        if d == 0:
            par = [-1] * s.shape[0]
        else:
            par = [prev_idx[int(i)] for i in prev_beam.repeat_interleave(k)]
        for j in range(s.shape[0]):
            ps = scores[par[j]] if par[j] >= 0 else 0.0
            pv = values[par[j]] if par[j] >= 0 else 1.0
            v = 1 / (1 + np.exp(-(a + b * float(s[j]) + c * (float(s[j]) - ps))))
            parents.append(par[j]), scores.append(float(s[j])), values.append(min(v, pv))
        prev_idx, prev_beam = list(range(n0, len(scores))), beam
    return parents, np.array(values)


def best_subtree_ratio(parents, values, base, per_row, cap, forced):
    best = 0.0
    n = len(parents)
    for mask in range(1 << n):
        chosen = [i for i in range(n) if mask >> i & 1]
        if len(chosen) > cap or forced not in chosen:
            continue
        if any(parents[i] >= 0 and not mask >> parents[i] & 1 for i in chosen):
            continue
        best = max(best, (1 + values[chosen].sum()) / (base + per_row * (len(chosen) + 1)))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_verified_subtree_is_the_best_ancestor_closed_one(tmp_path, seed):
    head = (1.0, 1.2, 0.3)
    pol = make_policy(tmp_path, token_ms=1.5, head=head, max_depth=3, topk=2, buckets=[4, 6, 8, 11], branch=False, lookahead=0,
                      level_ms=0.0)
    tree, levels = recorded_draft(pol, seed=seed, temperature=0.7)
    parents, values = pool_of(levels, 2, head)
    assert np.allclose(np.concatenate(pol._values), values, atol=1e-5)
    # the verified set: its nodes' values, closed under ancestors (every parent is kept, in topological order)
    kept_parents = tree.parents[1:].tolist()
    assert all(0 <= p < i + 1 for i, p in enumerate(kept_parents))
    got = (1 + (tree.size - 1 and float(np.sort(values)[::-1][: tree.size - 1].sum()))) / (
        pol._base_ms(len(levels) - 1, (len(levels) - 1) * 2) + pol._token_ms * tree.size)
    first = int(np.argmax(values[:2]))
    want = best_subtree_ratio(parents, values, pol._base_ms(len(levels) - 1, (len(levels) - 1) * 2), pol._token_ms, 10, first)
    assert got == pytest.approx(want, rel=1e-6)


def test_drafting_stops_at_once_where_no_row_can_pay_and_goes_deep_where_rows_are_cheap(tmp_path):
    pricey = make_policy(tmp_path, token_ms=200.0, level_ms=50.0)
    tree, levels = recorded_draft(pricey, temperature=0.5)
    assert len(levels) == 1 and levels[0][1].numel() == 0 and pricey.state()["stop"] == "cost"
    assert tree.size == 2  # the root's best child only (min_keep)
    cheap = make_policy(tmp_path, token_ms=0.01, level_ms=0.01, head=(4.0, 1.0, 0.0), cont=0.95)
    tree, levels = recorded_draft(cheap, temperature=0.3)
    assert len(levels) == 6 and cheap.state()["stop"] == "max_depth"
    assert tree.size > 10


def test_branching_expands_only_the_nodes_whose_children_could_pay(tmp_path):
    pol = make_policy(tmp_path, token_ms=2.0, level_ms=0.0, head=(0.5, 1.0, 0.0), cont=0.9)
    _, levels = recorded_draft(pol, temperature=1.0)
    widths = [beam.numel() for _, beam in levels]
    assert any(0 < w < 4 for w in widths), widths
    wide = make_policy(tmp_path, token_ms=2.0, level_ms=0.0, head=(0.5, 1.0, 0.0), cont=0.9, branch=False)
    _, full = recorded_draft(wide, temperature=1.0)
    assert all(beam.numel() in (0, 4) for _, beam in full)


def test_sources_are_valued_by_their_own_fit_in_the_fused_ranking(tmp_path):
    pol = make_policy(tmp_path, source=(1.0, 1.0))
    trie = CandidateTrie()
    a = trie.add(-1, 7, 0.5)
    trie.add(a, 8, 0.25)
    got = pol.fusion_source_scores("retrieval", trie)
    want = [1 / (1 + np.exp(-(1.0 + np.log(p / (1 - p))))) for p in (0.5, 0.25)]
    assert got == pytest.approx(want, rel=1e-6)
    assert pol.fusion_source_scores("grammar", trie) is None  # no fit: the source's own scores
    fused = fuse(3, 8, TreeShape(2, 2, 4), candidates=[trie], rules=pol, source_names=["retrieval"])
    assert fused.scores[1:] == pytest.approx(want, rel=1e-6)
    plain = fuse(3, 8, TreeShape(2, 2, 4), candidates=[trie], source_names=["retrieval"])
    assert plain.scores[1:] == pytest.approx([0.5, 0.25])


# -- the fit -------------------------------------------------------------------------------------
def test_logistic_fit_recovers_a_known_model_and_its_ece_is_small():
    rng = np.random.default_rng(0)
    X = np.stack([np.ones(20000), rng.uniform(-6, 0, 20000), rng.uniform(-3, 0, 20000)], -1)
    w = np.array([1.0, 0.8, 0.5])
    y = rng.random(20000) < 1 / (1 + np.exp(-X @ w))
    got = fit_logistic(X, y.astype(float), l2=0.1)
    assert got == pytest.approx(w, abs=0.1)
    ece, table = expected_calibration_error(1 / (1 + np.exp(-X @ got)), y)
    assert ece < 0.02 and sum(table["count"]) == 20000
    assert expected_calibration_error(np.full(1000, 0.9), np.zeros(1000))[0] == pytest.approx(0.9)
    depth = rng.integers(1, 4, 20000)
    rows = fit_by_depth(depth, X, y, 5, l2=0.1)
    assert rows.shape == (5, 3) and (rows[4] == rows[2]).all()  # unseen depths take the deepest fitted one


def test_path_labels_and_capped_values_follow_the_tree():
    parents = np.array([-1, 0, 0, 1, 3])
    assert path_ok(parents, np.array([1, 1, 0, 0, 1])).tolist() == [True, True, False, False, False]
    # rows without the root: node i + 1 of the tree; parent rows -1 for children of the root
    values, parent, depth = np.array([0.5, 0.4, 0.7, 0.9]), np.array([-1, -1, 0, 2]), np.array([1, 1, 2, 3])
    assert capped(values, parent, depth).tolist() == [0.5, 0.4, 0.5, 0.5]


def test_a_calibration_round_trips_and_a_bad_one_is_a_one_line_config_error(tmp_path):
    cal = PathCalibration(weights={HEAD: np.ones((6, 3))}, continuation=np.full(8, 0.5), meta={"prompts": 3})
    cal.save(tmp_path / "c.json")
    back = PathCalibration.load(tmp_path / "c.json")
    assert back.meta["prompts"] == 3 and (back.weights[HEAD] == 1).all()
    (tmp_path / "bad.json").write_text('{"weights": {}}')
    for value in (str(tmp_path / "bad.json"), str(tmp_path / "missing.json")):
        with pytest.raises((ConfigError, ValueError)) as err:
            PostDraftPolicy(load_config(ROOT / "configs" / "post-draft.yaml", [f"policy.calibration={value}"]).policy.params)
        assert len(str(err.value).splitlines()) == 1 and "calibration" in str(err.value)


def test_the_shipped_configs_load_with_the_shipped_calibration():
    for name in ("post-draft.yaml", "post-draft-hybrid.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        pol = PostDraftPolicy(cfg.policy.params)
        assert pol.shapes()[0] == TreeShape(6, 4, 24) and "retrieval" in pol.cal.weights
        assert pol.cal.meta.get("heldout_ece") is not None


@pytest.mark.model
def test_post_draft_yaml_is_lossless_on_the_real_head(greedy_reference):
    from adaptivespec.decode import Engine
    from shared_prompts import PROMPTS

    # (costs: profile: priced as shipped, not by whatever table a float32 run measured on this machine)
    engine = Engine(load_config(ROOT / "configs" / "post-draft.yaml", ["runtime.dtype=float32", "policy.costs=profile"]))
    sizes, levels, paths = set(), set(), []
    commit = engine.runtime.commit
    engine.runtime.commit = lambda tree, res, hidden: (paths.append(res.path), commit(tree, res, hidden))
    for text in PROMPTS[:3]:
        ids, ref = greedy_reference(text)
        res = engine.generate_ids(ids, max_new_tokens=48)
        assert res.token_ids == ref, text
        sizes |= {r.tree_size for r in res.records}
        levels |= {r.policy_state["levels"] for r in res.records}
    assert len(sizes) >= 3 and len(levels) >= 2  # the verified set and the depth really varied
    assert any(p != list(range(len(p))) for p in paths)  # accepted paths left the first-ranked branch
