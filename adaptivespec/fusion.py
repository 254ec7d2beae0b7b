"""Fusion: the head's beam tree and candidate tries merged into one verify tree under a budget.

A pure function of its inputs (no model, no runtime state), so any policy can reuse it with its
own scores. Nodes with the same token below the same parent are one node (a shared prefix is
verified once); every node carries a score, the estimated probability that the target accepts
the path to it, and the ``budget - 1`` best nodes are kept beside the root. A node's score is
capped by its parent's, so the kept set is closed under ancestors (ties: earlier node first).
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch

from adaptivespec.fusion_rules import FusionRanking
from adaptivespec.types import CandidateTrie, DraftTree, TreeShape

HEAD = 1
"""Origin bit of the head's nodes; candidate source ``k`` (0-based) has bit ``2 << k``."""


@attrs.define(eq=False, kw_only=True)
class FusedTree:
    """A verify tree and, for every node, which proposers put it forward."""

    tree: DraftTree
    origin: list[int]
    """Per node: bit 0 (``HEAD``) the head, bit ``k + 1`` candidate source ``k``; the root 0."""
    scores: list[float]
    """Per node: the score it was ranked by (the root ``inf``)."""

    def accepted_by(self, path: Sequence[int], names: Sequence[str]) -> dict[str, int]:
        """Accepted nodes of ``path`` (root first) each proposer put forward; ``names[0]`` is
        the head's, ``names[k + 1]`` source ``k``'s. A node proposed by two counts for both."""
        out = {n: 0 for n in names}
        for i in path[1:]:
            for b, n in enumerate(names):
                if self.origin[i] >> b & 1:
                    out[n] += 1
        return out


def tree_tensors(tokens: list[int], parents: list[int], logp: list[float], shape: TreeShape, device=None) -> DraftTree:
    """A :class:`DraftTree` from Python lists in topological order (small trees: built on the host)."""
    n = len(tokens)
    depth = [0] * n
    anc = [[False] * n for _ in range(n)]
    for i in range(n):
        p = parents[i]
        if p >= 0:
            depth[i] = depth[p] + 1
            anc[i][:] = anc[p]
        anc[i][i] = True
    kw = dict(device=device)
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, **kw),
        parents=torch.tensor(parents, dtype=torch.long, **kw),
        depth=torch.tensor(depth, dtype=torch.long, **kw),
        ancestors=torch.tensor(anc, dtype=torch.bool, **kw),
        draft_logp=torch.tensor(logp, dtype=torch.float32, **kw),
        shape=shape,
    )


def fuse(
    root_token: int,
    budget: int,
    shape: TreeShape,
    head: DraftTree | None = None,
    head_scores: Sequence[float] | None = None,
    candidates: Sequence[CandidateTrie | None] = (),
    device=None,
    rules=None,
    source_names: Sequence[str] = (),
) -> FusedTree:
    """One verify tree of at most ``budget`` nodes (root included) from the head and the tries.

    ``head``: the head's tree (its root is ``root_token``); ``head_scores``: one score per head
    node (default ``exp(draft_logp)``, the head's own path probability). ``candidates[k]``: source
    ``k``'s trie below the same root, ranked by its ``scores``. ``shape``: recorded on the tree
    (the shape-bank executor whose buffers verify it). The result's ``draft_logp`` is the log of
    each node's score.

    ``rules`` (optional, the tree policy; see :class:`~adaptivespec.fusion_rules.FusionRules`): ``rules.fusion_scores(head)``
    gives the head's scores when ``head_scores`` is None, ``rules.fusion_source_scores(name, trie)`` source
    ``k``'s scores (``name``: ``source_names[k]``, when given), ``rules.fusion_size(ranking)`` how many
    ranked candidates are kept (at most ``budget - 1``), and a tree of at most ``shape.ndt`` nodes is recorded with
    ``rules.verify_shape(shape, n)`` (the bank's bucket for it). Each is skipped when absent.
    """
    tokens, parents, origin, score = [root_token], [-1], [0], [math.inf]
    head_where: list[int] = []  # candidate id of each head node
    key: dict[tuple[int, int], int] = {}

    def add(parent: int, token: int, s: float, bit: int) -> int:
        i = key.get((parent, token))
        if i is None:
            i = key[(parent, token)] = len(tokens)
            tokens.append(token), parents.append(parent), origin.append(bit), score.append(s)
        else:
            origin[i] |= bit
            score[i] = max(score[i], s)
        return i

    if head is not None and head.size > 1:
        h_tokens, h_parents = torch.stack([head.tokens, head.parents]).tolist()
        if head_scores is None and getattr(rules, "fusion_scores", None) is not None:
            head_scores = rules.fusion_scores(head)
        h_scores = list(head_scores) if head_scores is not None else head.draft_logp.exp().tolist()
        where = [0]
        for i in range(1, len(h_tokens)):
            where.append(add(where[h_parents[i]], h_tokens[i], h_scores[i], HEAD))
        head_where = where
    rescore = getattr(rules, "fusion_source_scores", None)
    for k, trie in enumerate(candidates):
        if trie is None:
            continue
        bit, where = 2 << k, []
        own = rescore(source_names[k], trie) if rescore is not None and k < len(source_names) else None
        for t, p, s in zip(trie.tokens, trie.parents, trie.scores if own is None else own):
            where.append(add(0 if p < 0 else where[p], t, s, bit))
    n = len(tokens)
    for i in range(1, n):  # parents first: a node never outranks its parent
        score[i] = min(score[i], score[parents[i]])
    ranked = sorted(range(1, n), key=lambda i: (-score[i], i))
    k = max(budget - 1, 0)
    size = getattr(rules, "fusion_size", None)
    if size is not None and ranked:
        head_of = [-1] * n
        for j, i in enumerate(head_where):
            head_of[i] = j
        k = min(k, max(int(size(FusionRanking(
            scores=[score[i] for i in ranked], index=ranked, first_level=[parents[i] == 0 for i in ranked],
            head_index=[head_of[i] for i in ranked], budget=budget))), 0))
    keep = sorted(ranked[:k])
    fit = getattr(rules, "verify_shape", None)
    if fit is not None and len(keep) + 1 <= shape.ndt:  # beyond ndt: the shape's extra verify rows
        shape = fit(shape, len(keep) + 1)
    remap = {0: 0, **{old: new for new, old in enumerate(keep, 1)}}
    kept = [0] + keep
    logp = [0.0] + [math.log(score[i]) if score[i] > 0 else -1e30 for i in keep]
    tree = tree_tensors([tokens[i] for i in kept], [-1] + [remap[parents[i]] for i in keep], logp, shape, device)
    return FusedTree(tree=tree, origin=[origin[i] for i in kept], scores=[score[i] for i in kept])
