"""Policy ``talon``: the budget, the mu gate, the best-first cap, and losslessness on the real model."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
import torch

from adaptivespec.config import load_config, structure
from adaptivespec.errors import ConfigError
from adaptivespec.testing import draft_with_fake_drafter, registered
from adaptivespec.types import TreeShape
from adaptivespec_talon import TalonParams, TalonPolicy


def policy(**params) -> TalonPolicy:
    return TalonPolicy(TalonParams(**params))


def level(pol: TalonPolicy, probs, depth: int = 2, nodes_so_far: int = 10):
    """select_level on path probabilities given in linear space; returns (pool, beam) as lists."""
    scores = torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    pool, beam = pol.select_level(scores, depth, pol.shape, nodes_so_far)
    return pool.tolist(), beam.tolist()


# -- registration and parameters ------------------------------------------------------------------
def test_registered_by_the_plugin_distribution():
    entry = registered("policy", "talon")
    assert entry.cls is TalonPolicy
    assert entry.provider == "adaptivespec-talon"
    assert entry.lossless


def test_paper_defaults_and_the_one_bounding_shape():
    p = TalonParams()
    assert (p.budget, p.mu, p.topk, p.max_depth) == (60, 0.03, 10, 10)
    assert TalonPolicy().shapes() == (TreeShape(10, 10, 61),)
    assert policy(budget=20, topk=4, max_depth=6).next_shape(None) == TreeShape(6, 4, 21)


@pytest.mark.parametrize(
    "raw, key, words",
    [
        ({"mu": 0.0}, "policy.mu", "expected a number in (0, 1], got 0.0"),
        ({"mu": 1.5}, "policy.mu", "expected a number in (0, 1], got 1.5"),
        ({"budget": 0}, "policy.budget", "expected a positive integer, got 0"),
        ({"topk": 12, "budget": 8}, "policy.topk", "expected at most budget (8), got 12"),
        ({"max_depth": 1, "budget": 20, "topk": 4}, "policy.budget", "got 20"),
        ({"budget": 60, "topk": 2, "max_depth": 5}, "policy.budget", "expected at most topk + (max_depth - 1) * topk^2 = 18"),
        ({"nu": 0.1}, "policy.nu", "unknown key"),
    ],
)
def test_yaml_errors_name_the_key_and_what_was_expected(raw, key, words):
    with pytest.raises(ConfigError) as err:
        structure(TalonParams, raw, "talon.yaml", "policy")
    assert f"talon.yaml: {key}: " in str(err.value)
    assert words in str(err.value)


# -- the mu gate on hand-built level scores ----------------------------------------------------------
def test_gate_keeps_candidates_at_or_above_mu_times_the_best_best_first():
    pol = policy(mu=0.1)
    best = 0.4
    probs = [0.01, best, 0.1 * best, 0.1 * best * 0.99, 0.2, 0.05, 0.003]
    pool, beam = level(pol, probs)
    assert pool == [1, 4, 5, 2]  # 0.4, 0.2, 0.05, exactly 0.04; not 0.0396, 0.01, 0.003
    assert beam == pool  # kept candidates are verified and expanded


@pytest.mark.parametrize("mu", [0.01, 0.03, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("offset", [0.0, -3.7, -11.2])  # deeper layers: smaller path probabilities
def test_gate_boundary_is_inclusive_whatever_the_scale(mu, offset):
    pol = policy(mu=mu)
    scores = torch.tensor([offset, offset + math.log(mu), offset + math.log(mu) - 1e-3])
    pool, _ = pol.select_level(scores, 3, pol.shape, 10)
    assert pool.tolist() == [0, 1]


def test_mu_one_keeps_only_the_best_and_its_ties():
    pool, _ = level(policy(mu=1.0), [0.3, 0.1, 0.3, 0.2])
    assert sorted(pool) == [0, 2]


def test_first_layer_is_the_roots_top_k_without_gate():
    pol = policy(mu=0.5, topk=4, budget=20, max_depth=6)
    pool, beam = level(pol, [0.97, 0.01, 0.02, 0.005], depth=1, nodes_so_far=0)
    assert pool == [0, 2, 1, 3] and beam == pool  # 0.01 < 0.5 * 0.97, kept anyway at layer 1


# -- the budget cap ------------------------------------------------------------------------------------
def test_cap_keeps_the_best_within_the_remaining_budget_and_stops_expanding():
    pol = policy(budget=12, topk=4, mu=0.01, max_depth=6)
    probs = [0.05, 0.3, 0.02, 0.2, 0.25, 0.1]  # all pass the gate
    pool, beam = level(pol, probs, nodes_so_far=9)  # 3 nodes left
    assert pool == [1, 4, 3]
    assert beam == []  # the budget is spent: nothing is expanded, drafting stops


def test_below_the_cap_everything_passing_is_kept_and_expanded():
    pol = policy(budget=12, topk=4, mu=0.5, max_depth=6)
    pool, beam = level(pol, [0.05, 0.3, 0.02, 0.2, 0.25, 0.1], nodes_so_far=4)
    assert pool == [1, 4, 3] and beam == pool  # 0.1 < 0.5 * 0.3


def test_select_final_keeps_the_whole_pool():
    pol = TalonPolicy()
    scores = torch.tensor([-0.1, -5.0, -0.3, -9.0, -2.0])
    assert pol.select_final(scores, pol.shape).tolist() == [0, 1, 2, 3, 4]


# -- whole trees (seeded fake drafter) ----------------------------------------------------------------
CONFIGS = [dict(), dict(budget=20, topk=4, max_depth=6), dict(budget=8, topk=2, max_depth=4, mu=0.5), dict(budget=30, topk=3, mu=0.2)]


@pytest.mark.parametrize("params", CONFIGS)
@pytest.mark.parametrize("temperature", [0.05, 0.3, 1.0, 4.0])
@pytest.mark.parametrize("seed", range(4))
def test_node_count_never_exceeds_the_budget_and_reaches_it_unless_depth_caps(params, temperature, seed):
    pol = policy(**params)
    p = pol.params
    tree = draft_with_fake_drafter(pol, vocab=48, seed=seed, temperature=temperature)
    widths = pol.state()["level_widths"]
    drafted = tree.size - 1
    assert drafted <= p.budget
    assert sum(widths) == drafted and len(widths) == int(tree.depth.max())
    assert widths[0] == p.topk  # layer 1: the root's top-K
    assert drafted == p.budget or len(widths) == p.max_depth
    assert tree.size <= pol.shape.ndt and int(tree.depth.max()) <= pol.shape.nsteps


@pytest.mark.parametrize("seed", range(3))
def test_trees_are_topological_and_scores_fall_along_paths(seed):
    pol = policy(budget=30, topk=3, mu=0.05)
    tree = draft_with_fake_drafter(pol, vocab=32, seed=seed, temperature=0.5)
    idx = torch.arange(1, tree.size)
    assert bool((tree.parents[1:] < idx).all())
    assert torch.equal(tree.depth[1:], tree.depth[tree.parents[1:]] + 1)
    assert bool((tree.draft_logp[1:] <= tree.draft_logp[tree.parents[1:]]).all())


def test_confident_drafts_grow_deep_and_narrow_uncertain_ones_shallow_and_wide():
    deep, wide = [], []
    for seed in range(5):
        pol = TalonPolicy()
        draft_with_fake_drafter(pol, vocab=64, seed=seed, temperature=0.05)
        deep.append(pol.state()["level_widths"])
        draft_with_fake_drafter(pol, vocab=64, seed=seed, temperature=4.0)
        wide.append(pol.state()["level_widths"])
    assert min(len(w) for w in deep) > max(len(w) for w in wide)
    assert max(max(w[1:]) for w in deep) < min(max(w[1:]) for w in wide)
    assert all(sum(w) == 60 for w in wide)  # the same budget, spent in fewer layers


# -- the shipped config and losslessness on the real model -------------------------------------------------------------------------
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "talon.yaml"


@pytest.mark.skipif(not CONFIG.is_file(), reason="configs/talon.yaml is not beside this plugin")
def test_shipped_config_is_the_paper_setting_with_the_budget_tuned_for_this_cpu():
    config = load_config(CONFIG)
    assert config.policy.name == "talon" and config.verifier.name == "strict"
    assert attrs.evolve(config.policy.params, budget=TalonParams().budget) == TalonParams()
    assert config.policy.params.budget >= config.policy.params.topk


PROMPTS = ["What is 12 times 7? Answer briefly.", "Write a Python function that returns the factorial of n."]


@pytest.mark.model
@pytest.mark.parametrize(
    "params", [[], ["policy.budget=16", "policy.topk=3", "policy.max_depth=7", "policy.mu=0.1"]], ids=["paper", "small"]
)
def test_talon_with_strict_is_lossless(assert_lossless, params):
    results = assert_lossless(["policy.name=talon", "verifier.name=strict", *params], PROMPTS, max_new_tokens=32, oracle=True)
    budget = TalonParams().budget if not params else 16
    records = [r for res in results for r in res.records]
    assert all(r.tree_size <= budget + 1 for r in records)
    assert sum(r.accepted for r in records) > len(records)  # the oracle head is accepted: paths were kept
