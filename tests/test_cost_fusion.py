"""Policy ``cost_aware`` with candidate sources and its look-ahead level rule (no SmolLM).

Fusion: the head's nodes are ranked by the policy's calibrated values beside the sources' scores and
the fused tree is sized by the policy's budget rule (hand-built head trees and tries); policies
without the hook fuse exactly as before. Level rule: ``lookahead`` >= 1 drafts a level the myopic
rule stops at when the beam's continuation pays for its own verified tokens, and still stops when
it cannot.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from adaptivespec.fastpath.forced_path import ForcedPath
from adaptivespec.fusion import HEAD, fuse
from adaptivespec.policies.static import StaticParams, StaticPolicy
from adaptivespec.strategies import TreePolicy
from adaptivespec.tree import make_tree
from adaptivespec.types import TreeShape, VerifyResult

from test_cost_aware import make_policy, true_table
from test_fusion import paths_of, trie
from test_cuda_graphs import cost_aware_factory, one_thread, runtime, tiny  # noqa: F401  (fixtures)

ROOT = 100


def head(tokens, parents, logp, shape):
    return make_tree(torch.tensor(tokens), torch.tensor(parents), shape, torch.tensor(logp, dtype=torch.float32))


def spy(pol):
    """Record the ranking the policy's fusion_size sees."""
    seen = {}
    inner = pol.fusion_size

    def wrapped(ranking):
        seen["ranking"] = ranking
        return inner(ranking)

    pol.fusion_size = wrapped
    return seen


def brute_best_k(values, base, token, lo, hi):
    return max(range(lo, hi + 1), key=lambda k: ((1 + sum(values[:k])) / (base + token * (k + 1)), -k))


# -- fusion ranked and sized by the policy -------------------------------------------------------------
def test_a_high_value_retrieval_node_beats_a_low_value_head_node(tmp_path):
    pol = make_policy(tmp_path, token=0.001)  # verifying is nearly free: the budget cap binds
    shape = pol.shape
    h = head([ROOT, 1, 2], [-1, 0, 0], [0.0, -0.3, -0.02], shape)
    v1 = float(pol.calib.values(1, torch.tensor([-0.3]))[0])
    retrieved = 0.5 * (v1 + math.exp(-0.3))  # between node 1's calibrated value and its draft probability
    assert v1 < retrieved < math.exp(-0.3)
    t = trie({(7,): retrieved})
    plain = fuse(ROOT, 3, shape, h, candidates=[t])
    ranked = fuse(ROOT, 3, shape, h, candidates=[t], rules=pol)
    assert {p[-1] for p in paths_of(plain)[1:]} == {1, 2}  # by draft probability the head node stays
    assert {p[-1] for p in paths_of(ranked)[1:]} == {2, 7}  # by calibrated value the retrieved one wins
    assert ranked.origin[paths_of(ranked).index((7,))] == 2 and ranked.origin[paths_of(ranked).index((2,))] == HEAD


def fused_case():
    """A head tree (two levels) and a retrieval trie sharing one path with it."""
    shape = TreeShape(6, 4, 12)
    h = head([ROOT, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 1, 2], [0.0, -0.1, -1.2, -2.5, -0.4, -2.0, -1.6], shape)
    t = trie({(1,): 0.8, (1, 4): 0.7, (1, 4, 9): 0.6, (1, 4, 9, 10): 0.5, (8,): 0.2, (8, 11): 0.1,
              (1, 4, 9, 10, 12): 0.45, (1, 4, 9, 10, 12, 13): 0.4})
    return shape, h, t


@pytest.mark.parametrize("min_keep", [1, 2])
def test_fused_budget_is_the_policy_cost_rule_and_shrinks_with_the_token_cost(tmp_path, min_keep):
    sizes = []
    for token in (0.01, 0.5, 2.0, 8.0, 40.0):
        pol = make_policy(tmp_path, token=token, min_keep=min_keep)
        seen = spy(pol)
        shape, h, t = fused_case()
        budget = 10  # fewer rows than candidates: the cap binds when verifying is cheap
        fused = fuse(ROOT, budget, shape, h, candidates=[t], rules=pol)
        r = seen["ranking"]
        n = fused.tree.size
        # the best tokens/ms prefix of the fused ranking, the root's min_keep best children included
        lo = [i for i, f in enumerate(r.first_level) if f][min_keep - 1] + 1
        assert n - 1 == brute_best_k(r.scores, pol._base_ms(0, 0), token, lo, min(budget - 1, len(r.scores)))
        assert 1 + min_keep <= n <= budget and n - 1 >= lo  # the root's min_keep best children are in
        paths = paths_of(fused)
        assert all(p[:-1] in paths for p in paths[1:])  # ancestors kept
        assert pol.state()["budget"] == n and pol.state()["source_nodes"] == sum(o == 2 for o in fused.origin)
        sizes.append(n)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert len(r.scores) > budget - 1 and sizes[0] == budget  # nearly free tokens: up to the allowed budget


def test_head_values_are_the_policy_calibrated_values(tmp_path):
    pol = make_policy(tmp_path, token=0.01)
    seen = spy(pol)
    shape, h, t = fused_case()
    fuse(ROOT, 20, shape, h, candidates=[t], rules=pol)
    r = seen["ranking"]
    want = pol.calib.values(h.depth[1:], h.draft_logp[1:])  # monotone: no parent cap bites among them
    merged = {1: 0.8, 4: 0.7}  # head nodes the trie proposes too: the larger of the two scores
    got = {j: s for s, j in zip(r.scores, r.head_index) if j > 0}
    assert sorted(got) == list(range(1, h.size))
    for j, s in got.items():
        assert s == pytest.approx(max(float(want[j - 1]), merged.get(j, 0.0)))
    assert sum(j < 0 for j in r.head_index) == 6  # the trie's own nodes, with their scores


def test_fused_trees_take_the_smallest_bucket_or_the_drafting_shape_with_extra_rows(tmp_path):
    for token in (0.01, 2.0, 40.0):
        pol = make_policy(tmp_path, token=token, buckets=[4, 6, 8, 12])
        shape, h, t = fused_case()
        fused = fuse(ROOT, 16, pol.shape, h, candidates=[t], rules=pol)
        n = fused.tree.size
        if n <= 12:
            assert fused.tree.shape.ndt == min(b for b in (4, 6, 8, 12) if b >= n) and fused.tree.shape in pol.shapes()
        else:
            assert fused.tree.shape == pol.shape  # its executor has the extra verify rows


def test_fill_buckets_pads_fused_trees_to_their_bucket(tmp_path):
    pol = make_policy(tmp_path, token=8.0, buckets=[4, 8, 12], fill_buckets=True)
    shape, h, t = fused_case()
    fused = fuse(ROOT, 12, pol.shape, h, candidates=[t], rules=pol)
    assert fused.tree.size in (4, 8, 12) and fused.tree.size == fused.tree.shape.ndt


def random_case(rng):
    shape = TreeShape(4, 3, rng.randint(3, 10))
    n = rng.randint(1, 9)
    tokens, parents, logp = [ROOT], [-1], [0.0]
    for i in range(1, n):
        p = rng.randrange(i)
        tokens.append(rng.randint(1, 6)), parents.append(p), logp.append(logp[p] - rng.random() * 2)
    h = head(tokens, parents, logp, shape) if n > 1 or rng.random() < 0.5 else None
    tries = []
    for _ in range(rng.randint(0, 2)):
        paths = {}
        for _ in range(rng.randint(0, 6)):
            path = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
            s = 1.0
            for d in range(1, len(path) + 1):
                s *= rng.uniform(0.3, 1.0)
                paths.setdefault(path[:d], s)
        tries.append(trie(paths) if paths else None)
    return shape, h, tries


def test_policies_without_the_hook_fuse_byte_identically():
    rng = random.Random(5)
    rules = [TreePolicy(), StaticPolicy(StaticParams(nsteps=4, topk=3, ndt=6))]
    for _ in range(200):
        shape, h, tries = random_case(rng)
        budget = shape.ndt + rng.randint(0, 4)
        ref = fuse(ROOT, budget, shape, h, candidates=tries)
        for r in rules:
            got = fuse(ROOT, budget, shape, h, candidates=tries, rules=r)
            for f in ("tokens", "parents", "depth", "ancestors", "draft_logp"):
                assert torch.equal(getattr(got.tree, f), getattr(ref.tree, f)), f
            assert got.tree.shape == ref.tree.shape and got.origin == ref.origin and got.scores == ref.scores


def test_a_fused_tree_teaches_the_map_from_its_head_nodes_only(tmp_path):
    pol = make_policy(tmp_path, token=0.01, decay=1.0)
    shape, h, t = fused_case()
    fused = fuse(ROOT, 16, shape, h, candidates=[t], rules=pol)
    paths = paths_of(fused)
    accepted = [(), (1,), (1, 4), (1, 4, 9)]  # the path leaves the head's tree at 9 (retrieval only)
    n0, c0 = pol.calib.n.copy(), pol._cont_n.copy()
    pol.observe_tree(fused.tree, VerifyResult(path=[paths.index(p) for p in accepted], tokens=[1, 4, 9, 3]))
    head_paths = paths_of(fuse(ROOT, 99, shape, h))  # the head's own nodes, in its order
    kept = [paths_of(fuse(ROOT, 99, shape, h)).index(p) for p in paths[1:] if p in head_paths]
    cells = pol.calib.cells(h.depth[kept], h.draft_logp[kept])
    want = np.zeros_like(n0).ravel()
    np.add.at(want, cells, 1.0)
    assert np.array_equal((pol.calib.n - n0).ravel(), want)  # only head nodes, at their own log-probs
    acc = np.zeros_like(want)
    np.add.at(acc, pol.calib.cells(h.depth[[1, 4]], h.draft_logp[[1, 4]]), 1.0)
    assert np.array_equal(pol.calib.acc.ravel(), acc)
    assert (pol._cont_n - c0).sum() == 2  # root and node 1 had verified head children; 4's are not in the head


# -- the look-ahead level rule ---------------------------------------------------------------------------
def level_one(pol, scores):
    return pol.select_level(torch.tensor(scores), 1, pol.shape, 0)


@pytest.fixture
def concentrated(tmp_path):
    """One likely first token, three unlikely ones; verified tokens dear, drafter levels cheap."""

    def make(**kw):
        return make_policy(tmp_path, level=0.5, token=6.0, **kw)

    return make, [-0.02, -6.0, -7.0, -8.0]


def test_lookahead_expands_where_the_myopic_rule_stops(concentrated):
    make, scores = concentrated
    myopic, ahead = make(lookahead=0, explore=0.0), make(lookahead=2, explore=0.0)  # the rules at the point estimate
    _, beam = level_one(myopic, scores)
    assert beam.numel() == 0 and myopic.state()["stop"] == "cost"  # 4 children priced as verified
    _, beam = level_one(ahead, scores)
    assert beam.numel() == 4 and ahead.state()["level_margin"][0] > 0  # the likely child pays alone


def test_lookahead_still_stops_when_the_deeper_value_cannot_pay(concentrated, tmp_path):
    make, scores = concentrated
    pol = make(lookahead=3)
    pol._cont_a[:] = 0.01 * pol._cont_n  # drafts are almost never continued
    _, beam = level_one(pol, scores)
    assert beam.numel() == 0 and pol.state()["stop"] == "cost"
    expensive = make_policy(tmp_path, level=60.0, token=0.5, lookahead=3)  # a level costs a whole step
    _, beam = level_one(expensive, scores)
    assert beam.numel() == 0
    unlikely = make_policy(tmp_path, level=0.5, token=0.5, lookahead=3, prior=true_table(8) * 0.02)
    _, beam = level_one(unlikely, [-8.0] * 4)
    assert beam.numel() == 0


def test_lookahead_counts_the_levels_that_pay_up_to_the_remaining_depth(concentrated):
    make, scores = concentrated
    margins = {}
    for L in (1, 2, 4):
        pol = make(lookahead=L)
        pol._cont_a[:] = 0.95 * pol._cont_n  # drafts usually go on: deeper levels pay too
        level_one(pol, scores)
        margins[L] = pol.state()["level_margin"][0]
    assert margins[1] < margins[2] < margins[4]
    # one level left before max_depth: looking further ahead changes nothing
    last = {}
    for L in (1, 4):
        pol = make(lookahead=L, max_depth=2)
        pol._cont_a[:] = 0.95 * pol._cont_n
        level_one(pol, scores)
        last[L] = pol.state()["level_margin"][0]
    assert last[1] == last[4]


def test_lookahead_trees_stay_inside_the_bank(tmp_path):
    from adaptivespec.testing import draft_with_fake_drafter

    for L in (0, 1, 3):
        for costs in (dict(level=0.1, token=0.1), dict(level=2.0, token=1.4), dict(level=40.0, token=8.0)):
            pol = make_policy(tmp_path, buckets=[3, 5, 9], max_depth=5, topk=3, lookahead=L, **costs)
            for seed in range(3):
                tree = draft_with_fake_drafter(pol, pol.shape, seed=seed, temperature=0.5)
                assert 2 <= tree.size <= 9 and tree.shape in pol.shapes()
                assert (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()


# -- the static (CUDA-graph) path verifies fused cost-aware trees through their buckets ---------------------
def test_static_path_verifies_fused_trees_through_their_buckets(tiny, one_thread, tmp_path):  # noqa: F811
    make = cost_aware_factory(tmp_path, per_verified_token=2.0)
    prompt = list(range(3, 40))
    runs = {}
    for static in (False, True):
        policy, verifier = make(), ForcedPath()
        rt = runtime(*tiny, static, shapes=policy.shapes())
        policy.reset()
        rt.prefill(prompt, max_new_tokens=64)
        out = []
        for step in range(8):
            shape = policy.next_shape(None)
            tree = rt.draft(shape, policy)
            root = int(rt.root)
            t = trie({(root % 200 + 1,): 0.9, (root % 200 + 1, 7): 0.8, (root % 200 + 1, 7, 8): 0.3 + 0.05 * step})
            fused = fuse(root, shape.ndt, shape, tree, candidates=[t], device=rt.device, rules=policy)
            logits, hidden = rt.verify_forward(fused.tree)
            result = verifier.verify(fused.tree, logits)
            policy.observe_tree(fused.tree, result)
            out.append((fused.tree.tokens.tolist(), fused.tree.shape, logits.clone(), result.tokens))
            rt.commit(fused.tree, result, hidden)
        runs[static] = out
    for (tok_e, shape_e, logits_e, res_e), (tok_s, shape_s, logits_s, res_s) in zip(runs[False], runs[True]):
        assert tok_e == tok_s and shape_e == shape_s and res_e == res_s
        assert (logits_e - logits_s).abs().max() < 1e-4
    sizes = {len(t) for t, *_ in runs[True]}
    assert all(len(t) <= s.ndt and s.ndt == min(b for b in (3, 5, 9) if b >= len(t)) for t, s, *_ in runs[True])
    assert max(sizes) <= 9


def test_the_breaker_probe_verifies_every_fused_candidate_the_bank_holds(tmp_path):
    from adaptivespec.testing import draft_with_fake_drafter
    from adaptivespec.types import StepRecord

    pol = make_policy(tmp_path, level=500.0, token=30.0, breaker_steps=2, buckets=[3, 6], max_depth=4, topk=2)
    t = trie({(901,): 0.3, (901, 902): 0.2, (903,): 0.1})
    sizes = []
    for step in range(4):
        tree = draft_with_fake_drafter(pol, pol.shape, seed=0)
        fused = fuse(int(tree.tokens[0]), pol.shape.ndt + 2, pol.shape, tree, candidates=[t], rules=pol)
        sizes.append(fused.tree.size)
        pol.observe(StepRecord(step=step, shape=pol.shape, tree_size=fused.tree.size, accepted=0, promoted=0,
                               new_tokens=1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0))
    # expensive tokens: small fused trees, except the probe after two zero-accept steps (the whole budget)
    assert sizes[0] < 8 and sizes[1] < 8 and sizes[2] == 8 and sizes[3] < 8


def test_plot_trace_draws_the_source_nodes_of_fused_trees(tmp_path):
    import json

    from adaptivespec.trace import plot_trace
    from adaptivespec.types import StepRecord

    pol = make_policy(tmp_path, token=0.01)
    lines = []
    for step in range(4):
        shape, h, t = fused_case()
        fused = fuse(ROOT, 12, shape, h, candidates=[t], rules=pol)
        pol.observe_tree(fused.tree, VerifyResult(path=[0, 1], tokens=[1, 2]))
        rec = StepRecord(step=step, shape=fused.tree.shape, tree_size=fused.tree.size, accepted=1, promoted=0,
                         new_tokens=2, draft_ms=1.0, verify_ms=2.0, other_ms=0.5, policy_state=pol.state())
        lines.append(json.dumps({"id": "a", **rec.to_dict()}))
    assert all(json.loads(x)["policy_state"]["source_nodes"] > 0 for x in lines)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    plot_trace(trace, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
