"""Tree construction, strict verification and cache compaction on hand-built tensors (no model)."""

from __future__ import annotations

import pytest
import torch

from adaptivespec.policies.static import StaticPolicy, StaticParams
from adaptivespec.runtime import compact_cache
from adaptivespec.tree import accepted_path, ancestor_matrix, draft_tree, make_tree
from adaptivespec.types import TreeShape
from adaptivespec.verifiers.strict import StrictVerifier

V = 16


def one_hot_logits(top1: list[int], vocab: int = V) -> torch.Tensor:
    logits = torch.zeros(len(top1), vocab)
    logits[torch.arange(len(top1)), torch.tensor(top1)] = 5.0
    return logits


def test_ancestor_matrix_and_depth():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    anc = ancestor_matrix(parents, 3)
    assert anc[6].nonzero().squeeze(1).tolist() == [0, 1, 3, 6]
    assert anc[5].nonzero().squeeze(1).tolist() == [0, 2, 5]
    assert anc.diagonal().all()
    assert not anc[1, 2] and not anc[2, 1]
    tree = make_tree(torch.arange(7), parents)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]


def test_make_tree_rejects_bad_order():
    with pytest.raises(ValueError, match="topological"):
        make_tree(torch.arange(3), torch.tensor([-1, 2, 0]))


class FakeDrafter:
    """Expand function whose log-probs depend only on the input token; records its calls."""

    def __init__(self, vocab: int = V, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(200, vocab, generator=gen) * 3, -1)  # by target id
        self.calls: list[tuple[list[int], list[int], int]] = []

    def __call__(self, tokens, states, parent_slots, depth):
        self.calls.append((tokens.tolist(), parent_slots.tolist(), depth))
        return self.table[tokens], states + 1.0


def build(shape: TreeShape, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 100)
    root_logp = torch.log_softmax(torch.randn(V, generator=gen) * 3, -1)
    fake = FakeDrafter(seed=seed)
    tree = draft_tree(shape, torch.tensor(7), root_logp, torch.zeros(4), fake, lambda d: d + 100, StaticPolicy(StaticParams(nsteps=shape.nsteps, topk=shape.topk, ndt=shape.ndt)))
    return tree, fake, root_logp


@pytest.mark.parametrize("shape", [TreeShape(7, 1, 8), TreeShape(3, 4, 10), TreeShape(5, 3, 16), TreeShape(2, 2, 3)])
def test_draft_tree_structure(shape):
    tree, fake, _ = build(shape)
    n = tree.size
    assert n == shape.ndt
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    assert (tree.tokens[1:] >= 100).all()  # draft ids mapped to target ids
    assert (tree.parents[1:] < torch.arange(1, n)).all()  # topological
    assert (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()
    assert int(tree.depth.max()) <= shape.nsteps
    # cumulative scores never increase along a path, and siblings carry distinct tokens
    assert (tree.draft_logp[1:] <= tree.draft_logp[tree.parents[1:]] + 1e-6).all()
    for p in set(tree.parents[1:].tolist()):
        kids = tree.tokens[1:][tree.parents[1:] == p]
        assert kids.unique().numel() == kids.numel()
    # the drafter ran nsteps-1 levels, each with a beam of at most topk nodes
    assert [c[2] for c in fake.calls] == list(range(1, min(shape.nsteps, len(fake.calls) + 1)))
    assert all(len(c[0]) <= shape.topk for c in fake.calls)


def test_draft_tree_keeps_the_best_candidates():
    """The kept set is the ndt-1 best of all pooled candidates (EAGLE-2's reranking)."""
    shape = TreeShape(3, 3, 8)
    tree, fake, root_logp = build(shape, seed=3)
    # recompute every pooled candidate's score independently (beam search by hand)
    top = torch.topk(root_logp, 3)
    beam = [(float(v), int(i) + 100) for v, i in zip(top.values, top.indices)]
    scores = [b[0] for b in beam]
    for _depth in range(2, 4):
        cand = []
        for score, token in beam:
            t = torch.topk(fake.table[token], 3)
            cand += [(score + float(v), int(i) + 100) for v, i in zip(t.values, t.indices)]
        scores += [c[0] for c in cand]
        beam = sorted(cand, reverse=True)[:3]
    best = sorted(scores, reverse=True)[: shape.ndt - 1]
    assert sorted(tree.draft_logp[1:].tolist(), reverse=True) == pytest.approx(best, abs=1e-5)


def test_drafter_slots_point_to_beam_parents():
    tree, fake, _ = build(TreeShape(4, 2, 8), seed=1)
    # depth-1 nodes are children of the root (slot -1); deeper nodes point at slots of earlier calls
    assert fake.calls[0][1] == [-1, -1]
    expanded = len(fake.calls[0][0])
    for tokens, slots, depth in fake.calls[1:]:
        assert all(0 <= s < expanded for s in slots)
        expanded += len(tokens)


def test_strict_accepts_the_matching_path():
    #        0(root)
    #      /    \
    #    1:a     2:b
    #    |        |
    #    3:c     4:d
    tokens = torch.tensor([9, 1, 2, 3, 4])
    tree = make_tree(tokens, torch.tensor([-1, 0, 0, 1, 2]))
    # target: after root -> 2 (node 2 matches), after node 2 -> 4 (node 4 matches), after node 4 -> 7
    top1 = [2, 0, 4, 0, 7]
    res = StrictVerifier().verify(tree, one_hot_logits(top1))
    assert res.path == [0, 2, 4]
    assert res.tokens == [2, 4, 7]
    assert res.accepted == 2 and res.promoted == 0


def test_strict_rejects_everything_and_emits_bonus():
    tree = make_tree(torch.tensor([9, 1, 2]), torch.tensor([-1, 0, 1]))
    res = StrictVerifier().verify(tree, one_hot_logits([5, 0, 0]))
    assert res.path == [0] and res.tokens == [5]


def test_strict_stops_at_first_mismatch_even_if_deeper_matches():
    tree = make_tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 1, 2]))
    # node 1 matches, node 2 does not (target wants 6), node 3 would match its parent's top1
    res = StrictVerifier().verify(tree, one_hot_logits([1, 6, 3, 8]))
    assert res.path == [0, 1] and res.tokens == [1, 6]


def test_accepted_path_picks_deepest_valid():
    tree = make_tree(torch.arange(5), torch.tensor([-1, 0, 1, 0, 3]))
    ok = torch.tensor([True, True, False, True, True])
    assert int(accepted_path(tree, ok)) == 4


def test_compact_cache_keeps_accepted_rows():
    from transformers import DynamicCache

    cache = DynamicCache()
    start, n = 5, 6
    keys = torch.arange(start + n, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 3).clone()
    for layer in range(2):
        cache.update(keys.clone() + 100 * layer, keys.clone() - 100 * layer, layer)
    path = [0, 2, 5]
    compact_cache(cache, start, path, torch.tensor(path), n)
    for layer in range(2):
        k = cache.layers[layer].keys[0, 0, :, 0]
        assert k.tolist() == [float(v) + 100 * layer for v in [0, 1, 2, 3, 4, 5, 7, 10]]
        assert cache.layers[layer].values[0, 1, :, 2].tolist() == [float(v) - 100 * layer for v in [0, 1, 2, 3, 4, 5, 7, 10]]


def test_compact_cache_chain_needs_no_copy():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.arange(8.0).view(1, 1, 8, 1), torch.arange(8.0).view(1, 1, 8, 1), 0)
    compact_cache(cache, 4, [0, 1], torch.tensor([0, 1]), 4)
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_tree_shape_validation():
    with pytest.raises(ValueError, match="ndt - 1 = 9"):
        TreeShape(2, 2, 10)  # only 2 + 4 = 6 candidates
    with pytest.raises(ValueError, match="positive"):
        TreeShape(0, 1, 2)
    assert TreeShape(3, 4, 4).max_nodes == 4 + 2 * 16
