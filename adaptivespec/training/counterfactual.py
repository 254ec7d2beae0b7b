"""Counterfactual acceptance: teacher-forced along a greedy output, what every tree shape would have
accepted at every position (smaller trees are subtrees of the largest verified one). Used by the
shape oracle (:mod:`adaptivespec.analysis.shape_oracle`) and by ``train-policy``'s labels
(:mod:`adaptivespec.training.policy_data`)."""

from __future__ import annotations

import torch

from adaptivespec.sampling import root_stats
from adaptivespec.types import TreeShape


def kept_nodes(depth: torch.Tensor, logp: torch.Tensor, nsteps: int, ndt: int | None) -> torch.Tensor:
    """The nodes of a full tree that shape ``(nsteps, *, ndt)`` keeps: the root and the ``ndt - 1`` best
    by cumulative score among depths 1..nsteps (stable, so ties keep pool order, parents first);
    ``ndt`` None keeps every node down to ``nsteps``."""
    idx = torch.nonzero((depth >= 1) & (depth <= nsteps)).squeeze(1)
    if ndt is not None:
        idx = idx[torch.sort(logp[idx], descending=True, stable=True).indices[: ndt - 1]]
    kept = torch.zeros(depth.shape[0], dtype=torch.bool)
    kept[0] = True
    kept[idx] = True
    return kept


def accepted_for_shapes(tree, cont: torch.Tensor, shapes_k: list[TreeShape]) -> dict[TreeShape, int]:
    """a_S for every shape of one branching from one full tree (all candidates kept)."""
    depth, logp, anc = tree.depth, tree.draft_logp, tree.ancestors
    n = depth.shape[0]
    want = torch.full((n,), -1, dtype=torch.long)
    ok_d = depth <= cont.shape[0]
    want[ok_d & (depth > 0)] = cont[(depth[ok_d & (depth > 0)] - 1)]
    match = (tree.tokens == want) | (depth == 0)
    out = {}
    for s in shapes_k:
        kept = kept_nodes(depth, logp, s.nsteps, s.ndt)
        good = kept & match
        path_ok = (~anc | good.unsqueeze(0)).all(dim=1) & kept  # every ancestor-or-self kept and matching
        out[s] = int(depth[path_ok].max())
    return out


def tree_record(tree, cont: torch.Tensor) -> dict:
    """What an in-step replay needs of one full teacher-forced tree: per node its depth, parent,
    cumulative draft log-prob, and whether its token is the continuation's at its depth."""
    depth = tree.depth.cpu()
    want = torch.full_like(depth, -1)
    ok = (depth > 0) & (depth <= cont.shape[0])
    want[ok] = cont.cpu()[depth[ok] - 1]
    match = (tree.tokens.cpu() == want) | (depth == 0)
    return {"depth": depth.to(torch.int8), "parents": tree.parents.cpu().to(torch.int16),
            "logp": tree.draft_logp.cpu().float(), "match": match}


def teacher_forced(eng, ids: list[int], Y: list[int], full: dict[int, TreeShape], shapes: list[TreeShape],
                   on_position=None) -> dict:
    """Teacher-forced along the greedy output ``Y`` of prompt ``ids``: at every position ``j`` (root
    ``Y[j]``) the drafter drafts the full tree ``full[k]`` of each branching ``k`` and the tokens
    every shape of ``shapes`` would accept there are read off the continuation ``Y[j+1:]``.

    Returns ``acc`` (per position, shape -> accepted), ``p1`` (the draft's top-1 probability at the
    root), ``entropy`` (of the draft's distribution at the root, nats), ``top4`` (its four most
    likely tokens' probability) and ``trees`` (branching ->
    per position :func:`tree_record`). ``on_position(j)`` (optional) is called after each position.
    The runtime's bank must hold the ``full`` shapes (``runtime.prepare``)."""
    rt, d = eng.runtime, eng.runtime.drafter
    seq = torch.tensor([ids + Y])
    rt.bank.reserve(seq.shape[1] + max(b.ndt for b in full.values()) + 1)
    out = eng.target(input_ids=seq, output_hidden_states=True, logits_to_keep=1)
    state = d.fuse(out.hidden_states)[0]  # [L, H]
    L = seq.shape[1]
    d.reset_cache(capacity=L + 2048)
    outs = d.step(seq[0, 1:], state[: L - 1], torch.arange(L - 1), None)  # position i: (token[i+1], state[i])
    saved_k, saved_v = d._k.clone(), d._v.clone()
    acc, p1, ent, top4 = [], [], [], []
    trees: dict[int, list] = {k: [] for k in full}
    for j in range(len(Y) - 1):
        P = len(ids) + j
        d.length = P
        rt.P, rt.root = P, seq[0, P]
        rt.root_state = outs[P - 1]
        rt.root_logp = d.log_probs(outs[P - 1])
        top, h, t4 = root_stats(rt.root_logp.float())
        p1.append(top)
        ent.append(h)
        top4.append(t4)
        cont = seq[0, P + 1 :]
        a = {}
        for k, big in full.items():
            d.length = P  # drafting appends scratch slots: every tree starts from the same cache
            tree = rt.draft(big, eng.policy)
            d._k[:, :, P : P + 1024] = saved_k[:, :, P : P + 1024]
            d._v[:, :, P : P + 1024] = saved_v[:, :, P : P + 1024]
            a.update(accepted_for_shapes(tree, cont, [s for s in shapes if s.topk == k]))
            trees[k].append(tree_record(tree, cont))
        acc.append(a)
        if on_position is not None:
            on_position(j)
    return {"acc": acc, "p1": p1, "entropy": ent, "top4": top4, "trees": trees}

