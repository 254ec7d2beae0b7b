"""adaptivespec.analysis.shape_oracle: acceptance per shape read off one full tree, and the schedule maths."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml

from adaptivespec.tree import ancestor_matrix
from adaptivespec.types import DraftTree, TreeShape

from adaptivespec.analysis import shape_oracle as oracle_mod
from adaptivespec.training import counterfactual


def full_tree() -> DraftTree:
    # root 0; depth 1: 1 (tok 5, -0.1), 2 (tok 6, -0.5); depth 2: 3 under 1 (tok 7, -0.3), 4 under 2
    # (tok 8, -0.9); depth 3: 5 under 3 (tok 9, -0.6)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    return DraftTree(tokens=torch.tensor([1, 5, 6, 7, 8, 9]), parents=parents, depth=torch.tensor([0, 1, 1, 2, 2, 3]),
                     ancestors=ancestor_matrix(parents, 3), draft_logp=torch.tensor([0.0, -0.1, -0.5, -0.3, -0.9, -0.6]),
                     shape=TreeShape(3, 2, 6))


@pytest.mark.parametrize("cont, expected", [
    ([5, 7, 9], {(1, 2, 3): 1, (2, 2, 3): 2, (3, 2, 4): 2, (3, 2, 5): 3, (3, 2, 6): 3}),
    # the second branch is kept only when ndt leaves room for it, and its child later still
    ([6, 8, 0], {(1, 2, 3): 1, (2, 2, 3): 0, (2, 2, 4): 1, (2, 2, 5): 2, (3, 2, 5): 1, (3, 2, 6): 2}),
    ([4, 4, 4], {(3, 2, 6): 0}),
    ([5], {(3, 2, 6): 1}),  # the continuation ends before the tree does
])
def test_accepted_length_of_every_sub_shape(cont, expected):
    shapes = [TreeShape(*s) for s in expected]
    got = counterfactual.accepted_for_shapes(full_tree(), torch.tensor(cont), shapes)
    assert {(s.nsteps, s.topk, s.ndt): a for s, a in got.items()} == expected


def test_static_schedule_and_oracle_against_brute_force():
    a, b = TreeShape(1, 1, 2), TreeShape(4, 1, 5)
    times = {a: 1.0, b: 3.0}
    gen = torch.Generator().manual_seed(0)
    acc = [{a: int(torch.randint(0, 2, (1,), generator=gen)), b: int(torch.randint(0, 5, (1,), generator=gen))} for _ in range(9)]
    # static: walk the positions with one shape
    i, t = 0, 0.0
    while i < len(acc):
        t, i = t + times[b], i + acc[i][b] + 1
    assert oracle_mod.simulate(lambda i: b, acc, times) == pytest.approx(t)
    # oracle: the best of every schedule (choice per step, at most 9 steps)
    best = float("inf")
    for choice in itertools.product((a, b), repeat=9):
        i, t, k = 0, 0.0, 0
        while i < len(acc):
            s = choice[k]
            t, i, k = t + times[s], i + acc[i][s] + 1, k + 1
        best = min(best, t)
    assert oracle_mod.oracle(acc, times, [a, b]) == pytest.approx(best)
    assert best <= min(oracle_mod.simulate(lambda i, s=s: s, acc, times) for s in (a, b))


def test_policy_replay_of_a_static_config_walks_like_its_shape():
    policy = yaml.safe_load((Path(__file__).parents[1] / "configs" / "eagle3.yaml").read_text())["policy"]
    shape = TreeShape(policy["nsteps"], policy["topk"], policy["ndt"])  # eagle3.yaml's, whatever it is
    acc = [{shape: a} for a in (0, 3, 1, 0, 4, 2, 0, 0, 1)]
    times = {shape: 2.0}
    expected = oracle_mod.simulate(lambda i: shape, acc, times)
    assert expected == 2.0 * 4  # steps at positions 0, 1, 5, 8 (accepting 0, 3, 2, 1)
    got = oracle_mod.simulate_policy(str(Path(__file__).parents[1] / "configs" / "eagle3.yaml"), [acc], [[0.5] * 9], times)
    assert got == pytest.approx(expected)


def test_policy_replay_refuses_policies_with_their_own_level_rules():
    pytest.importorskip("adaptivespec_talon")
    with pytest.raises(SystemExit, match="own level rules"):
        oracle_mod.simulate_policy(str(Path(__file__).parents[1] / "configs" / "talon.yaml"), [], [], {})


def _cost_aware_config(tmp_path, level_ms: float) -> str:
    from adaptivespec.costmodel import CostModel, save_prior

    CostModel(fixed=50.0, per_draft_level=level_ms, per_verified_token=0.1, context_ref=0).save(tmp_path / "c.json")
    high = torch.full((4, 12), 0.95)
    save_prior(tmp_path / "p.json", high, torch.ones_like(high), shrink=0)
    cfg = tmp_path / "cost.yaml"
    cfg.write_text(f"policy:\n  name: cost_aware\n  max_depth: 3\n  topk: 2\n  buckets: [3, 6]\n"
                   f"  profile: {tmp_path / 'c.json'}\n  prior: {tmp_path / 'p.json'}\n  prior_weight: 1000000.0\n")
    return str(cfg)


@pytest.mark.parametrize("level_ms, depth, steps", [(0.01, 3, 2), (500.0, 1, 4)])
def test_in_step_replay_of_cost_aware_on_full_trees(tmp_path, level_ms, depth, steps):
    # every position's full tree is full_tree() and the continuation is always 5, 7, 9: the whole
    # tree accepts 3 tokens; with levels too expensive to draft, depth 1 accepts 1
    record = counterfactual.tree_record(full_tree(), torch.tensor([5, 7, 9]))
    cfg = _cost_aware_config(tmp_path, level_ms)
    assert oracle_mod.in_step_policy(cfg)
    coef = [0.05, 0.001, 0.0, 0.0001]
    got = oracle_mod.replay_in_step(cfg, {2: [[record] * 8]}, [[0.5] * 8], coef)
    assert got["steps"] == steps and got["mean_levels"] == depth
    assert got["accept_length"] == 8 / steps
    n = got["mean_verified"]
    assert got["seconds"] == pytest.approx(steps * oracle_mod.tree_cost(coef, depth, 2, n))
