"""A verifier for comparing runtimes step for step, whatever the weights (tests and device checks).

Random weights accept nothing under the strict rule, so two runtimes that differ only in how
their caches are kept (eager, static buffers, captured graphs) would be compared on one-token
steps alone. :class:`ForcedPath` accepts a path fixed by the tree's structure instead: long, and
off the first branch, so cache compaction is compared too.
"""

from __future__ import annotations

import torch

from adaptivespec.strategies import Verifier
from adaptivespec.tree import path_to
from adaptivespec.types import DraftTree, VerifyResult


class ForcedPath(Verifier):
    """Accepts the path to the tree's last node, then to its middle node, in turn, and the
    target's choice after it (lossy by design: for comparisons, never registered)."""

    name = "forced-path"
    lossless = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        """verify calls so far (odd: the last node, even: the middle one)."""

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        self.calls += 1
        node = tree.size - 1 if self.calls % 2 else tree.size // 2
        path = path_to(tree, torch.tensor(node, device=tree.tokens.device))
        tokens = tree.tokens[path[1:]].tolist() + [int(logits[node].argmax())]
        return VerifyResult(path=path.tolist(), tokens=tokens)
