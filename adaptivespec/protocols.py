"""What the decode step hands to strategies, and what it calls on runtimes and drafters, as
``typing.Protocol`` classes: the contracts a plugin codes against, not the built-in classes.

Strategies are handed two objects:

* :class:`Sampling`: ``Verifier.sampler`` at temperature > 0 (None when greedy), the built-in
  :class:`~adaptivespec.sampling.Sampler`;
* :class:`GrammarState`: ``CandidateSource.constraint`` when a response format is set (None for
  free text), the built-in :class:`~adaptivespec.constraints.Constraint`.

A tree policy is handed no runtime object: the runtime calls its level rules with scores.
Runtime and drafter plugins implement the other two:

* :class:`Runtime`: what the engine and the proposal stage call on a registered runtime
  (``cls(target, drafter, config)``), the built-in :class:`~adaptivespec.runtime.TorchRuntime`;
* :class:`Drafter`: what the torch runtime calls on a drafter of a registered kind
  (``cls.from_pretrained(path, target, dtype, device)``), the built-in
  :class:`~adaptivespec.drafter.Eagle3Drafter`.

Each lists only what the step uses.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from adaptivespec.types import DraftTree, TreeShape, VerifyResult


class Sampling(Protocol):
    """The generation's sampling distribution and random draws, as a verifier reads them."""

    @property
    def greedy(self) -> bool:
        """True at temperature 0 (the engine then sets no sampler at all)."""
        ...

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] float32 sampling distribution of the target from its logits [..., V]."""
        ...

    def uniform(self, n: int) -> torch.Tensor:
        """[n] float32 uniforms in [0, 1) from the generation's seeded generator."""
        ...

    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One token per row of non-negative ``weights`` [..., V] (need not sum to 1): [...]."""
        ...

    def choose(self, probs: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """[n] the target's keyed choice at each row of ``probs`` [n, V], row ``i`` giving the token
        ``depth[i]`` positions past the step's first: a function of the request's seed, the position
        and the row alone (the same text for a seed whatever the tree; ``strict``'s rule)."""
        ...


class GrammarState(Protocol):
    """The generation's grammar state, as a candidate source reads it."""

    def forced_tokens(self, mode: str = "canonical", limit: int = 16) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (``mode``: ``canonical``, ``greedy`` or
        ``single``: how the forced string becomes tokens); empty when nothing is forced."""
        ...


class Runtime(Protocol):
    """Where the target and the drafter run: prefill, plain steps, tree drafting, verification, commit."""

    device: torch.device
    drafter: Any
    """The drafter (a :class:`Drafter` for the torch runtime), or None: plain decoding or sources alone."""
    root: torch.Tensor
    """0-dim: the last emitted token, root of the next tree."""
    sampler: Sampling | None
    """Set by the engine at temperature > 0: prefill's first token and plain steps are drawn with it."""
    logits_processor: Callable[[torch.Tensor], None] | None
    """Set by the engine: changes the next token's logits [V] in place before they are picked."""

    def prepare(self, shapes: tuple[TreeShape, ...], capacity: int = 1024, extra_rows: int = 0) -> Any:
        """Build what every shape the policy may choose needs, before decoding."""
        ...

    def prefill(self, prompt_ids: list[int], max_new_tokens: int = 0) -> int:
        """Run the prompt; the first generated token."""
        ...

    def ar_step(self) -> int:
        """One plain decoding step from the root; the next token."""
        ...

    def draft_root_stats(self) -> tuple[float, float, float]:
        """The drafter's top-1 probability, entropy (nats) and top-4 probability of the first token
        below the root (what :class:`~adaptivespec.types.StepSignals` carries)."""
        ...

    def draft(self, shape: TreeShape, rules: Any) -> DraftTree:
        """A draft tree of ``shape`` below the root; ``rules``: the tree policy (its level rules)."""
        ...

    def verify_forward(self, tree: DraftTree) -> tuple[torch.Tensor, Any]:
        """One target forward over ``tree``: (logits [n, V], what :meth:`commit` needs)."""
        ...

    def commit(self, tree: DraftTree, result: VerifyResult, hidden_states: Any) -> None:
        """Keep the accepted path of ``tree`` in the caches and make its last token the root."""
        ...


class Drafter(Protocol):
    """A draft head as the torch runtime drives it (EAGLE-3's interface)."""

    length: int
    """Committed positions in the drafter's cache (the runtime sets it back before a commit)."""

    @classmethod
    def from_pretrained(cls, path: Any, target: Any, dtype: torch.dtype, device: Any) -> "Drafter":
        """Load the head for ``target`` from ``path``."""
        ...

    def reset_cache(self, capacity: int) -> None:
        """An empty cache with room for ``capacity`` positions (a new prompt)."""
        ...

    def fuse(self, target_hidden: tuple[torch.Tensor, ...], index: torch.Tensor | None = None) -> torch.Tensor:
        """[.., T, H] the drafter's input state from the target's hidden states (positions ``index`` only)."""
        ...

    def step(self, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Run nodes ``tokens`` [b] fed with ``state`` [b, H] at ``positions`` [b] and append them to
        the cache (``mask``: additive, None: causal); [b, H] output states."""
        ...

    def log_probs(self, out_state: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., Vd] from output states [..., H]."""
        ...

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids to target-vocabulary ids (EAGLE-3's d2t)."""
        ...
