"""The tree rules a verifier shares, part of the plugin API (:mod:`adaptivespec.api`): greedy picks
and the lossless tree test of speculative sampling.

:func:`sibling_accept` and :func:`residual_draw` implement tree speculative sampling for
deterministic (top-k) drafts, whose rule and proof are in the ``strict`` verifier's docstring;
``margin`` falls back to them below its outright acceptances. The draws come from the engine's
sampler (:class:`~adaptivespec.protocols.Sampling`; the engine's is :class:`adaptivespec.sampling.Sampler`).
"""

from __future__ import annotations

import torch

from adaptivespec.protocols import Sampling
from adaptivespec.types import DraftTree

_TINY = 1e-30


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the index of each row's first maximum ([...] from [..., V]).

    Computed as ``max(-1).indices`` (documented to return the first maximal value's index, as argmax):
    on the CPU, torch's argmax over a 49k vocabulary in bfloat16 is ~4x slower (8 rows: ~0.75 vs
    ~0.17 ms; one row: ~0.19 vs ~0.04 ms), paid by every greedy verify and decoding step."""
    return logits.max(-1).indices


def earlier_siblings(tree: DraftTree) -> torch.Tensor:
    """[n, n] bool: ``e[i, j]`` when j is a sibling of i listed before it (drafted nodes only)."""
    n = tree.tokens.shape[0]
    idx = torch.arange(n, device=tree.tokens.device)
    e = (tree.parents.unsqueeze(1) == tree.parents.unsqueeze(0)) & (idx.unsqueeze(0) < idx.unsqueeze(1))
    e[0] = False
    e[:, 0] = False
    return e


def sibling_accept(tree: DraftTree, probs: torch.Tensor, u: torch.Tensor, earlier: torch.Tensor | None = None) -> torch.Tensor:
    """[n] bool: node i is the child its parent accepts, should the walk reach the parent.

    Children are tried in index order; child ``x_j`` is accepted when ``u_j < p(x_j) / R_j``,
    ``R_j = 1 - sum_{i<j} p(x_i)`` the mass left after the earlier siblings were rejected (a
    sibling repeating an earlier token has residual probability 0: always rejected). Every node
    has its own uniform, so all parents are decided at once; only the decisions along the walk
    from the root are used, and they are independent, which is what the sequential test draws.
    ``probs``: [n, V] the target's sampling distribution at each node; ``u``: [n] uniforms.
    """
    e = earlier_siblings(tree) if earlier is None else earlier
    parent = tree.parents.clamp(min=0)
    p_tok = probs[parent, tree.tokens]  # [n] p(token(i) | parent(i))
    dup = (e & (tree.tokens.unsqueeze(0) == tree.tokens.unsqueeze(1))).any(-1)
    p_eff = torch.where(dup, torch.zeros_like(p_tok), p_tok)
    p_eff[0] = 0.0
    left = probs.sum(-1)[parent] - e.float() @ p_eff  # [n] R_j (the row sums are 1 up to rounding)
    ratio = (p_eff / left.clamp_min(_TINY)).clamp(max=1.0)
    acc = u < ratio
    acc[0] = False
    ok = acc & ~(e & acc.unsqueeze(0)).any(-1)  # the first accepted sibling only
    ok[0] = True
    return ok


def residual_draw(tree: DraftTree, probs: torch.Tensor, last: torch.Tensor, sampler: Sampling) -> torch.Tensor:
    """0-dim bonus token at ``last``: drawn from ``probs[last]`` without the tokens of its
    children (all rejected when the walk stopped there; a leaf has none)."""
    row = probs[last]  # [V]
    is_child = (tree.parents == last).float()  # [n]
    kill = torch.zeros_like(row).scatter_reduce(0, tree.tokens, is_child, "amax")  # [V]
    res = row * (1 - kill)
    res = torch.where(res.sum() > 0, res, row)  # rounding left no mass: the children's row itself
    return sampler.draw(res)
