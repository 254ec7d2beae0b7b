"""Verifier ``strict``: greedy exact match, lossless (EAGLE-2/3's rule at temperature 0), and
tree speculative sampling at temperature > 0 (lossless in distribution, the same text for a seed
whatever the tree; see :class:`StrictVerifier`).

A drafted node is *accepted* when its token equals the target's greedy choice at its parent and
its parent was accepted; the *bonus* token is the target's greedy choice at the deepest accepted
node. The output equals greedy decoding of the target token for token.
"""

from __future__ import annotations

import torch

import adaptivespec
from adaptivespec.api import (
    DraftTree, Verifier, VerifyResult, accepted_path, emit, greedy_ids, greedy_matches,
)

__all__ = ["StrictVerifier", "emit", "greedy_matches"]  # the helpers live in adaptivespec.tree (kept importable here)


class StrictVerifier(Verifier):
    """Greedy exact match at temperature 0; keyed tree speculative sampling above it (both lossless).

    **Temperature 0**: a drafted node is accepted when its token is the target's argmax at its
    parent and its parent was accepted; the bonus token is the argmax at the deepest accepted node.

    **Temperature > 0** (``self.sampler`` set). ``p(. | u)`` is the target's sampling distribution
    at node ``u`` (temperature, top-k, top-p, min-p applied: :mod:`adaptivespec.sampling`). Each
    node's row gets the target's *keyed choice* ``c(u) = F_u^{-1}(U_q)``: the inverse CDF of
    ``p(. | u)`` at one uniform ``U_q`` per sequence position ``q`` (a hash of the request's seed
    and ``q``: :meth:`~adaptivespec.sampling.Sampler.choose`); the walk is then the greedy one on
    those choices: a drafted node is accepted when its token is its parent's choice, the last
    token is the choice at the deepest accepted node.

    *Losslessness.* Every emitted token at position ``q`` is ``F^{-1}(U_q)`` under the target's
    distribution given all earlier emitted tokens, with ``U_q`` uniform and independent of
    everything before ``q``: an exact draw from ``p``, so the output is distributed exactly as
    plain sampling of the target. A token the warpers removed (``p = 0``) is never chosen.

    *Acceptance.* A drafted child ``x`` of ``u`` is accepted with probability ``p(x | u)``; the
    children's chances add up to their mass, what the sequential residual test (EAGLE-2's and
    SGLang's rule for deterministic top-k drafts, :func:`~adaptivespec.tree_sampling.sibling_accept`)
    gives: the same expected accept length. And the tree decides nothing: plain decoding, any
    tree and any batch emit the same tokens for a seed where the target's logits are the same.

    *Implementation.* One choice per node row, all at once (no loop over depth or tokens); the only
    host sync is the result's transfer, as at temperature 0.
    """

    name = "strict"
    lossless = True
    supports_sampling = True

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        sampler = self.sampler
        if sampler is not None and not sampler.greedy:
            top1 = sampler.choose(sampler.probs(logits), tree.depth)  # [n] the keyed choice per node
        else:
            top1 = greedy_ids(logits)  # [n]
        last = accepted_path(tree, greedy_matches(tree, top1))
        return emit(tree, last, top1[last])


@adaptivespec.hookimpl
def adaptivespec_register_verifiers(registry):
    registry.register(StrictVerifier)
