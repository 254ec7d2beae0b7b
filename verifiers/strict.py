"""Verifier ``strict``: greedy exact match, lossless (EAGLE-2/3's rule at temperature 0), and
tree speculative sampling at temperature > 0 (lossless in distribution; see :class:`StrictVerifier`).

A drafted node is *accepted* when its token equals the target's greedy choice at its parent and
its parent was accepted; the *bonus* token is the target's greedy choice at the deepest accepted
node. The output equals greedy decoding of the target token for token.
"""

from __future__ import annotations

import torch

import adaptivespec
from adaptivespec.api import (
    DraftTree, Verifier, VerifyResult, accepted_path, emit, greedy_ids, greedy_matches, residual_draw,
    sibling_accept,
)

__all__ = ["StrictVerifier", "emit", "greedy_matches"]  # the helpers live in adaptivespec.tree (kept importable here)


class StrictVerifier(Verifier):
    """Greedy exact match at temperature 0; tree speculative sampling above it (both lossless).

    **Temperature 0**: a drafted node is accepted when its token is the target's argmax at its
    parent and its parent was accepted; the bonus token is the argmax at the deepest accepted node.

    **Temperature > 0** (``self.sampler`` set; EAGLE-2's and SGLang's rule for deterministic
    top-k drafts). ``p(. | u)`` is the target's sampling distribution at node ``u`` (temperature,
    top-k, top-p, min-p applied: :mod:`adaptivespec.sampling`). From the root, at node ``u`` with
    children ``x_1 .. x_k`` in tree order (drafting order: most likely draft first):

    1. residual ``r = p(. | u)``; for j = 1..k: accept ``x_j`` with probability
       ``r(x_j) / sum(r)``; on acceptance emit ``x_j`` and continue at ``x_j``; on rejection set
       ``r(x_j) = 0`` (renormalising implicitly) and try ``x_{j+1}``;
    2. all children rejected: emit a token drawn from ``r`` and stop;
    3. a leaf (no children): emit the bonus token drawn from ``p(. | u)`` and stop.

    *Losslessness.* Fix ``u`` and write ``R_j = 1 - sum_{i<j} p(x_i)`` for distinct children. The
    chance that ``x_j`` is emitted is ``prod_{i<j} (1 - p(x_i)/R_i) * p(x_j)/R_j``; the product
    telescopes (``1 - p(x_i)/R_i = R_{i+1}/R_i``, ``R_1 = 1``) to ``R_j``, giving ``p(x_j)``. A token
    ``y`` that is not a child is reached only after all k rejections (chance ``R_{k+1}``) and then
    drawn with ``p(y)/R_{k+1}``: again ``p(y)``. So the token emitted at ``u`` is distributed as
    ``p(. | u)``; after accepting ``x_j`` the walk repeats the argument at ``x_j``, whose logits are
    the target's at prefix + ``x_j``; after a residual or bonus draw the step ends and the next one
    starts from the new prefix. By induction every emitted token is drawn from the target's
    sampling distribution given all earlier ones: the output is distributed exactly as plain
    sampling of the target. A sibling repeating an earlier token has ``r = 0`` there and is always
    rejected, so duplicates cost speed, never correctness; a token the warpers removed
    (``p = 0``) is never accepted or drawn. The draft's probabilities never enter (the drafts
    are deterministic), so neither does the tree shape: policies cannot change what is emitted.

    *Implementation.* Every node gets its own uniform and all sibling tests run at once
    (:func:`~adaptivespec.sampling.sibling_accept`); the walk then follows the accepted children
    (:func:`~adaptivespec.tree.accepted_path`) and one residual draw gives the last token. No loop
    over depth or tokens; the only host sync is the result's transfer, as at temperature 0.
    """

    name = "strict"
    lossless = True
    supports_sampling = True

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        sampler = self.sampler
        if sampler is not None and not sampler.greedy:
            probs = sampler.probs(logits)  # [n, V]
            last = accepted_path(tree, sibling_accept(tree, probs, sampler.uniform(tree.tokens.shape[0])))
            return emit(tree, last, residual_draw(tree, probs, last, sampler))
        top1 = greedy_ids(logits)  # [n]
        last = accepted_path(tree, greedy_matches(tree, top1))
        return emit(tree, last, top1[last])


@adaptivespec.hookimpl
def adaptivespec_register_verifiers(registry):
    registry.register(StrictVerifier)
