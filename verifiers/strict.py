"""Verifier ``strict``: greedy exact match, lossless (EAGLE-2/3's rule at temperature 0).

A drafted node is *accepted* when its token equals the target's greedy choice at its parent and
its parent was accepted; the *bonus* token is the target's greedy choice at the deepest accepted
node. The output equals greedy decoding of the target token for token.
"""

from __future__ import annotations

import torch

import adaptivespec
from adaptivespec.strategies import Verifier
from adaptivespec.tree import accepted_path, path_to
from adaptivespec.types import DraftTree, VerifyResult


def greedy_matches(tree: DraftTree, top1: torch.Tensor) -> torch.Tensor:
    """[n] bool: node i's token is the target's top-1 at its parent (the root counts as a match)."""
    ok = tree.tokens == top1[tree.parents.clamp(min=0)]
    ok[0] = True
    return ok


def emit(tree: DraftTree, last: torch.Tensor, bonus: torch.Tensor, promoted: torch.Tensor | int = 0) -> VerifyResult:
    """Build the result with a single device-to-host transfer."""
    path = path_to(tree, last)
    promoted = torch.as_tensor(promoted, device=path.device).reshape(1)
    flat = torch.cat([path, tree.tokens[path[1:]], bonus.reshape(1), promoted]).tolist()
    k = path.shape[0]
    return VerifyResult(path=flat[:k], tokens=flat[k : 2 * k], promoted=flat[-1])


class StrictVerifier(Verifier):
    """Greedy exact match (lossless)."""

    name = "strict"
    lossless = True

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        top1 = logits.argmax(-1)  # [n]
        last = accepted_path(tree, greedy_matches(tree, top1))
        return emit(tree, last, top1[last])


@adaptivespec.hookimpl
def adaptivespec_register_verifiers(registry):
    registry.register(StrictVerifier)
