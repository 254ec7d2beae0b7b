"""Fusion of the head's tree and candidate tries on hand-built cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from adaptivespec.fusion import HEAD, fuse
from adaptivespec.types import CandidateTrie
from adaptivespec.tree import make_tree
from adaptivespec.types import TreeShape

SHAPE = TreeShape(3, 2, 6)
ROOT = 100


def head_tree():
    # root -> 1 (0.6) -> 2 (0.3) -> 3 (0.1); root -> 4 (0.3) -> 5 (0.2)
    tokens = [ROOT, 1, 4, 2, 5, 3]
    parents = [-1, 0, 0, 1, 2, 3]
    probs = [1.0, 0.6, 0.3, 0.3, 0.2, 0.1]
    return make_tree(tokens, parents, SHAPE, torch.tensor([math.log(p) for p in probs]))


def trie(paths_scores):
    """A CandidateTrie from {token path: score}, paths listed parents first."""
    t = CandidateTrie(total=1)
    index = {(): -1}
    for path, s in paths_scores.items():
        index[path] = t.add(index[path[:-1]], path[-1], s, match=3)
    return t


def paths_of(fused):
    tokens, parents = fused.tree.tokens.tolist(), fused.tree.parents.tolist()
    out = [()]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + (tokens[i],))
    return out


def check_tree(fused):
    """Topological, ancestor matrix and depths equal to the paths' prefix relation."""
    tree, paths = fused.tree, paths_of(fused)
    n = tree.size
    assert tree.tokens[0] == ROOT and tree.parents[0] == -1
    assert all(p < i for i, p in enumerate(tree.parents.tolist()[1:], 1))
    want = [[paths[i][: len(paths[j])] == paths[j] for j in range(n)] for i in range(n)]
    assert tree.ancestors.tolist() == want
    assert tree.depth.tolist() == [len(p) for p in paths]
    assert len(set(paths)) == n  # every token path once: shared prefixes merged
    ref = make_tree(tree.tokens, tree.parents)  # the project's own mask builder agrees
    assert torch.equal(ref.ancestors, tree.ancestors)


def test_shared_prefixes_are_merged_once_and_marked_with_both_origins():
    cand = trie({(1,): 0.9, (1, 2): 0.8, (1, 2, 7): 0.7, (1, 2, 7, 8): 0.6})
    fused = fuse(ROOT, 32, SHAPE, head_tree(), candidates=[cand])
    check_tree(fused)
    paths = paths_of(fused)
    assert sorted(paths[1:]) == sorted([(1,), (4,), (1, 2), (4, 5), (1, 2, 3), (1, 2, 7), (1, 2, 7, 8)])
    origin = dict(zip(paths, fused.origin))
    both = HEAD | 2
    assert origin[(1,)] == origin[(1, 2)] == both
    assert origin[(4,)] == origin[(4, 5)] == origin[(1, 2, 3)] == HEAD
    assert origin[(1, 2, 7)] == origin[(1, 2, 7, 8)] == 2
    score = dict(zip(paths, fused.scores))
    assert score[(1,)] == pytest.approx(0.9) and score[(1, 2, 3)] == pytest.approx(0.1)  # max of the two
    assert fused.tree.draft_logp[1:].exp().tolist() == pytest.approx(fused.scores[1:])


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 6, 9])
def test_budget_respected_ancestors_closed_best_scores_kept(budget):
    cand = trie({(9,): 0.5, (9, 8): 0.45, (9, 8, 7): 0.4, (1,): 0.2, (1, 6): 0.15})
    full = fuse(ROOT, 100, SHAPE, head_tree(), candidates=[cand])
    fused = fuse(ROOT, budget, SHAPE, head_tree(), candidates=[cand])
    check_tree(fused)
    assert fused.tree.size == min(budget, full.tree.size)
    kept = set(paths_of(fused))
    assert all(p[:-1] in kept for p in kept if p)  # ancestors closed
    all_scores = dict(zip(paths_of(full), full.scores))
    dropped = [s for p, s in all_scores.items() if p not in kept]
    if dropped and len(kept) > 1:
        assert min(all_scores[p] for p in kept if p) >= max(dropped)


def test_a_child_never_outranks_its_parent():
    # a retrieval child scored above its head-only parent's score is capped by it: kept only with it
    cand = trie({(4,): 0.05, (4, 6): 0.9})
    fused = fuse(ROOT, 3, SHAPE, head_tree(), candidates=[cand])
    assert set(paths_of(fused)) == {(), (1,), (4,)}  # 1: 0.6, 4: 0.3; (4, 6) capped at 0.3, later index
    fused = fuse(ROOT, 4, SHAPE, head_tree(), candidates=[cand])
    assert set(paths_of(fused)) == {(), (1,), (4,), (1, 2)}  # ties at 0.3: earlier node first


def test_random_trees_against_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        def rand_paths(k, bias):
            paths = {}
            for _ in range(k):
                p = tuple(rng.randrange(4) for _ in range(rng.randint(1, 4)))
                for d in range(1, len(p) + 1):
                    paths.setdefault(p[:d], bias * 0.9 ** d * rng.random())
            return dict(sorted(paths.items(), key=lambda kv: len(kv[0])))
        tries = [trie(rand_paths(rng.randint(0, 4), 1.0)) for _ in range(2)]
        budget = rng.randint(1, 12)
        fused = fuse(ROOT, budget, SHAPE, head_tree() if rng.random() < 0.7 else None, candidates=tries)
        check_tree(fused)
        assert fused.tree.size <= budget
        for k, t in enumerate(tries):  # a kept node from source k is one of its paths
            mine = set(t.paths())
            for p, o in zip(paths_of(fused), fused.origin):
                assert bool(o >> (k + 1) & 1) == (p in mine)


def test_head_alone_root_alone_and_accepted_counts():
    head = head_tree()
    same = fuse(ROOT, 6, SHAPE, head)
    assert torch.equal(same.tree.tokens, head.tokens) and torch.equal(same.tree.ancestors, head.ancestors)
    root = fuse(ROOT, 8, SHAPE)
    assert root.tree.size == 1 and root.tree.tokens.tolist() == [ROOT]
    cand = trie({(1,): 0.9, (1, 2): 0.8, (1, 2, 7): 0.7})
    fused = fuse(ROOT, 32, SHAPE, head, candidates=[None, cand])  # source 0 had nothing
    paths = paths_of(fused)
    path = [0, paths.index((1,)), paths.index((1, 2)), paths.index((1, 2, 7))]
    assert fused.accepted_by(path, ["head", "a", "b"]) == {"head": 2, "a": 0, "b": 3}
