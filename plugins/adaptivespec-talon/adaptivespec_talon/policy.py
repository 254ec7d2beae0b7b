"""Policy ``talon``: TALON's budget-driven hybrid tree expansion.

Liu, Lv, Shen, Sun, Sun, *TALON: Confidence-Aware Speculative Decoding with Adaptive Token Trees*,
arXiv:2601.07353 (2026), section 3: a fixed global node budget ``N``; the first drafted layer is the
root's top-K ("robust tree initialization"); every further layer keeps the candidates whose path
probability is at least ``mu`` times the layer's best ("confidence-gated expansion"); drafting
stops when ``N`` nodes are in the tree. Paper defaults: N = 60, mu = 0.03.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from adaptivespec.api import StepSignals, TreePolicy, TreeShape, number_in, positive_int

THRESHOLD_TOL = 1e-6
"""Slack on the log-space gate ``score >= best + log(mu)``, so that a candidate at exactly
``mu`` times the best path probability is kept despite float32 rounding."""


@attrs.frozen(kw_only=True)
class TalonParams:
    budget: int = attrs.field(default=60, validator=positive_int)
    """N: drafted nodes per tree (the root not counted); the target verifies N + 1 tokens."""
    mu: float = attrs.field(default=0.03, validator=number_in(0, 1, lo_open=True))
    """Confidence gate: a layer keeps candidates with path probability >= mu x the layer's best."""
    topk: int = attrs.field(default=10, validator=positive_int)
    """K: children of the root in the first layer, and children proposed by every expanded node."""
    max_depth: int = attrs.field(default=10, validator=positive_int)
    """Depth cap: drafting stops here even when the budget is not spent."""

    def __attrs_post_init__(self) -> None:
        if self.topk > self.budget:
            raise ValueError(f"topk: expected at most budget ({self.budget}), got {self.topk}")
        k, d = self.topk, self.max_depth
        bound = k + (d - 1) * k * k  # largest ndt - 1 a TreeShape(d, k, .) accepts
        if self.budget > bound:
            raise ValueError(
                f"budget: expected at most topk + (max_depth - 1) * topk^2 = {bound} for topk={k}, "
                f"max_depth={d} (the largest tree a (nsteps, topk, ndt) shape describes), got {self.budget}"
            )


class TalonPolicy(TreePolicy):
    """TALON: a fixed node budget, spent layer by layer where the draft is confident (lossless).

    Tree construction, through :func:`adaptivespec.tree.draft_tree`'s level rules (path probability
    = product of draft probabilities from the root, i.e. ``exp`` of the cumulative score):

    * **layer 1** (the paper's layer 0, robust initialization): the root's top-K children are all
      kept and all expanded, capped at N;
    * **layer d >= 2** (confidence-gated expansion): the candidates are the K children of every
      node kept in layer d - 1; a candidate is kept when its path probability is >= mu x the
      best path probability in the layer, at most the remaining budget of them, best first.
      Kept candidates form the pool *and* the beam: each is verified and each is expanded;
    * drafting stops once N nodes are kept, or at ``max_depth``; every kept node is verified
      (:meth:`select_final` keeps the whole pool), so a tree has N drafted nodes unless the
      depth cap came first. TALON redistributes nodes within the budget (deep and narrow when the
      draft is confident, shallow and wide when it is not); it never changes the total.

    :meth:`shapes` is the one shape ``(max_depth, K, N + 1)`` that bounds every tree. Verification
    is the configured verifier's business: with ``strict`` the output is the target's greedy one.
    Choices the paper leaves open: K children per expanded node (EAGLE-3's per-node top-k), the
    depth cap, and ties at the budget cap (``torch.topk`` order).
    """

    name = "talon"
    lossless = True
    Params = TalonParams

    def __init__(self, params: TalonParams | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.shape = TreeShape(p.max_depth, p.topk, p.budget + 1)
        self._log_mu = math.log(p.mu) - THRESHOLD_TOL
        self._widths: list[int] = []

    def shapes(self) -> tuple[TreeShape, ...]:
        return (self.shape,)

    def next_shape(self, signals: StepSignals) -> TreeShape:
        return self.shape

    def state(self) -> dict[str, Any]:
        """Nodes kept per layer in the last tree (its depth is the list's length)."""
        return {"level_widths": list(self._widths)}

    def select_level(
        self, scores: torch.Tensor, depth: int, shape: TreeShape, nodes_so_far: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Kept candidates of one layer, best first, as both pool and beam.

        ``scores``: [c] cumulative draft log-probabilities. One host sync per layer below the
        first (the number of candidates passing the gate).
        """
        if depth == 1:
            self._widths = []
        room = self.params.budget - nodes_so_far
        cap = min(room, scores.shape[0])
        top = torch.topk(scores, cap, sorted=True)  # best first; top.values[0] is the layer's best
        if depth == 1:
            kept = top.indices  # robust initialization: the root's top-K, no gate
        else:  # confidence gate: p >= mu * p_best  <=>  log p >= log p_best + log mu
            passing = int((top.values >= top.values[0] + self._log_mu).sum())  # a prefix (sorted)
            kept = top.indices[:passing]
        self._widths.append(int(kept.shape[0]))
        full = nodes_so_far + kept.shape[0] >= self.params.budget
        beam = kept[:0] if full else kept  # budget spent: expand nothing, drafting stops
        return kept, beam

    def select_final(self, scores: torch.Tensor, shape: TreeShape) -> torch.Tensor:
        """Every pooled candidate: the pool already holds at most N nodes, closed under ancestors."""
        return torch.arange(scores.shape[0], device=scores.device)
