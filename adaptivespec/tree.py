"""Draft trees: EAGLE-2/3 beam drafting, tree masks, the accepted-path rule and the helpers every
verifier builds its result with (:func:`greedy_matches`, :func:`emit`).

Every function here works on whole tensors: the only Python loops run over tree *levels*
(at most ``nsteps``, i.e. a handful), never over tokens or vocabulary entries.
"""

from __future__ import annotations

from typing import Callable, Generator, Protocol

import torch

from adaptivespec.types import DraftTree, TreeShape, VerifyResult


class ExpandFn(Protocol):
    """Runs the drafter on one level of expanded nodes.

    ``tokens``: [b] target-vocabulary ids; ``hidden``: [b, H] drafter state the nodes are fed with
    (their parent's output); ``parent_slots``: [b] drafter-cache slot of each node's parent among
    the nodes expanded earlier in this tree, -1 for children of the root; ``depth``: their depth.
    Returns ``(logp [b, Vd], hidden_out [b, H])``: draft log-probabilities of their children and
    the drafter's output state for each node. Node ``i`` of the call gets slot ``first_slot + i``.
    """

    def __call__(
        self, tokens: torch.Tensor, hidden: torch.Tensor, parent_slots: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n, n] bool: ``anc[i, j]`` is True when j is i or one of its ancestors.

    ``parents``: [n] with parents[0] == -1 (the root). Built with ``max_depth`` boolean matrix
    products (one per level), so no host-device sync and no loop over nodes.
    """
    n = parents.shape[0]
    step = torch.zeros(n, n, dtype=torch.float32, device=parents.device)
    child = torch.arange(1, n, device=parents.device)
    step[child, parents[1:]] = 1.0  # step[i, parent(i)] = 1
    anc = torch.eye(n, dtype=torch.float32, device=parents.device)
    reach = anc
    for _ in range(max_depth):
        reach = reach @ step  # reach[i, j] = 1 iff j is the ancestor of i that many levels up
        anc = anc + reach
    return anc > 0


def make_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    shape: TreeShape | None = None,
    draft_logp: torch.Tensor | None = None,
) -> DraftTree:
    """A :class:`DraftTree` from explicit tokens and parent indices (topologically ordered)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    n = tokens.shape[0]
    if parents.shape != (n,) or int(parents[0]) != -1:
        raise ValueError("parents must have one entry per token and parents[0] == -1 (the root)")
    if n > 1 and bool((parents[1:] >= torch.arange(1, n, device=parents.device)).any()):
        raise ValueError("nodes must be in topological order: parents[i] < i")
    max_depth = shape.nsteps if shape is not None else n - 1
    anc = ancestor_matrix(parents, max_depth)
    depth = anc.sum(-1) - 1
    if shape is None:  # descriptive only: the tightest EAGLE shape that contains this tree
        width = int(torch.bincount(depth).max()) if n > 1 else 1
        shape = TreeShape(max(int(depth.max()), 1), width, max(n, 2))
    if draft_logp is None:
        draft_logp = torch.zeros(n, device=tokens.device)
    return DraftTree(tokens=tokens, parents=parents, depth=depth, ancestors=anc, draft_logp=draft_logp, shape=shape)


def draft_tree(
    shape: TreeShape,
    root_token: torch.Tensor,
    root_logp: torch.Tensor,
    root_hidden: torch.Tensor,
    expand: ExpandFn,
    to_target: Callable[[torch.Tensor], torch.Tensor],
    rules,
) -> DraftTree:
    """Draft one tree of ``shape`` (EAGLE-2/3 beam drafting with pluggable level rules).

    1. depth 1: the root's ``topk`` most likely children (``root_logp``: [Vd] draft log-probs);
    2. each further depth: the beam chosen by ``rules.select_level`` is run through the drafter
       (``expand``) and every beam node proposes its ``topk`` children, scored by cumulative
       log-probability ``score(child) = score(parent) + log q(child | path)``;
    3. ``rules.select_final`` keeps ``ndt - 1`` pooled candidates (ancestor-closed) beside the root.

    ``root_hidden``: [H] drafter output at the root; ``to_target`` maps draft-vocabulary ids to
    target ids (EAGLE-3's d2t). ``rules`` is the tree policy. The drafting itself is
    :func:`draft_levels`; this runs its levels one after the other through ``expand``.
    """
    levels = draft_levels(shape, root_token, root_logp, root_hidden, to_target, rules)
    try:
        level = next(levels)
        while True:
            level = levels.send(expand(*level))
    except StopIteration as done:
        return done.value


DraftLevels = Generator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor], DraftTree]
"""A tree being drafted: yields each level's ``expand`` arguments ``(tokens, hidden, parent_slots,
depth)``, is sent back ``expand``'s ``(logp, hidden_out)``, and returns the :class:`DraftTree`."""


def draft_levels(
    shape: TreeShape,
    root_token: torch.Tensor,
    root_logp: torch.Tensor,
    root_hidden: torch.Tensor,
    to_target: Callable[[torch.Tensor], torch.Tensor],
    rules,
) -> DraftLevels:
    """:func:`draft_tree` as a generator that hands each level's drafter call to its driver
    (:data:`DraftLevels`): a batch engine drives one per request and runs a level of all of them
    in one drafter pass; :func:`draft_tree` drives one alone."""
    device = root_logp.device
    k = shape.topk
    top = torch.topk(root_logp.float(), k)
    scores = top.values  # [c] cumulative log-probs of the level's candidates
    tokens = to_target(top.indices)  # [c]
    parent_pool = torch.full((k,), -1, dtype=torch.long, device=device)  # pool index of parent
    hidden_in = root_hidden.unsqueeze(0).expand(k, -1)  # [c, H]
    parent_slot = torch.full((k,), -1, dtype=torch.long, device=device)

    pool_tokens, pool_scores, pool_parents = [], [], []
    pool_size, n_expanded = 0, 0
    for depth in range(1, shape.nsteps + 1):
        pool_sel, beam = rules.select_level(scores, depth, shape, pool_size)
        if pool_sel is None:  # every candidate stays in the pool
            level_pool_idx = pool_size + torch.arange(scores.shape[0], device=device)
            pool_tokens.append(tokens), pool_scores.append(scores), pool_parents.append(parent_pool)
            pool_size += scores.shape[0]
        else:
            level_pool_idx = torch.full((scores.shape[0],), -1, dtype=torch.long, device=device)
            level_pool_idx[pool_sel] = pool_size + torch.arange(pool_sel.shape[0], device=device)
            pool_tokens.append(tokens[pool_sel]), pool_scores.append(scores[pool_sel])
            pool_parents.append(parent_pool[pool_sel])
            pool_size += pool_sel.shape[0]
        if depth == shape.nsteps or beam.shape[0] == 0:
            break
        # Run the beam through the drafter; its children are the next level's candidates.
        b = beam.shape[0]
        logp, hidden_out = yield tokens[beam], hidden_in[beam], parent_slot[beam], depth
        child = torch.topk(logp.float(), k, dim=-1)  # [b, k]
        scores = (scores[beam].unsqueeze(1) + child.values).reshape(-1)
        tokens = to_target(child.indices.reshape(-1))
        parent_pool = level_pool_idx[beam].repeat_interleave(k)
        hidden_in = hidden_out.repeat_interleave(k, dim=0)
        parent_slot = (n_expanded + torch.arange(b, device=device)).repeat_interleave(k)
        n_expanded += b

    all_tokens = torch.cat(pool_tokens)
    all_scores = torch.cat(pool_scores)
    all_parents = torch.cat(pool_parents)
    kept = torch.sort(rules.select_final(all_scores, shape)).values  # pool order = topological
    remap = torch.zeros(pool_size + 1, dtype=torch.long, device=device)  # pool idx + 1 -> node idx
    remap[kept + 1] = torch.arange(1, kept.shape[0] + 1, device=device)
    parents = torch.cat([torch.tensor([-1], device=device), remap[all_parents[kept] + 1]])
    node_tokens = torch.cat([root_token.reshape(1).to(torch.long), all_tokens[kept]])
    logp = torch.cat([torch.zeros(1, device=device), all_scores[kept]])
    anc = ancestor_matrix(parents, shape.nsteps)
    depth = anc.sum(-1) - 1
    fit = getattr(rules, "verify_shape", None)  # a variable verify budget: the bucket holding the tree
    shape = shape if fit is None else fit(shape, kept.shape[0] + 1)
    return DraftTree(tokens=node_tokens, parents=parents, depth=depth, ancestors=anc, draft_logp=logp, shape=shape)


def subtree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """The nodes ``keep`` of ``tree`` (sorted indices, 0 among them, closed under ancestors) as a
    tree of their own, in the same order: what a row budget verifies of a drafted tree. Node ``i``
    of the result is node ``keep[i]`` of ``tree``.

    Worked example: parents ``[-1, 0, 0, 1, 2]``, keep ``[0, 2, 4]`` -> parents ``[-1, 0, 1]``."""
    remap = torch.full((tree.size + 1,), -1, dtype=torch.long, device=keep.device)  # old idx + 1 -> new idx
    remap[keep + 1] = torch.arange(keep.shape[0], device=keep.device)
    return DraftTree(tokens=tree.tokens[keep], parents=remap[tree.parents[keep] + 1], depth=tree.depth[keep],
                     ancestors=tree.ancestors[keep][:, keep], draft_logp=tree.draft_logp[keep], shape=tree.shape)


def accepted_path(tree: DraftTree, ok: torch.Tensor) -> torch.Tensor:
    """The deepest node whose whole root path is acceptable, as a 0-dim index tensor.

    ``ok``: [n] bool, node i may be accepted given its parent was (ok[0] must be True). When every
    node has at most one acceptable child the acceptable nodes form a single path from the root.
    """
    valid = ~(tree.ancestors & ~ok.unsqueeze(0)).any(-1)
    return torch.where(valid, tree.depth, -1).argmax()


def path_to(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """Node indices from the root down to ``node`` (ascending = by depth)."""
    return tree.ancestors[node].nonzero().squeeze(1)


def greedy_matches(tree: DraftTree, top1: torch.Tensor) -> torch.Tensor:
    """[n] bool: node i's token is the target's top-1 at its parent (the root counts as a match).

    ``top1``: [n] the target's argmax at every node. The strict rule: ``accepted_path(tree,
    greedy_matches(tree, top1))`` is the deepest node whose whole path matches."""
    ok = tree.tokens == top1[tree.parents.clamp(min=0)]
    ok[0] = True
    return ok


def emit(tree: DraftTree, last: torch.Tensor, bonus: torch.Tensor, promoted: torch.Tensor | int = 0) -> VerifyResult:
    """The :class:`VerifyResult` of the path from the root to ``last`` (a 0-dim node index), with
    ``bonus`` (0-dim token) as the step's last token and ``promoted`` accepted tokens that were not
    the target's top-1; a single device-to-host transfer. A verifier builds its result with it."""
    path = path_to(tree, last)
    promoted = torch.as_tensor(promoted, device=path.device).reshape(1)
    flat = torch.cat([path, tree.tokens[path[1:]], bonus.reshape(1), promoted]).tolist()
    k = path.shape[0]
    return VerifyResult(path=flat[:k], tokens=flat[k : 2 * k], promoted=flat[-1])
