"""Base classes of the pluggable strategies: tree policies and verifiers.

A strategy is a class with three class attributes, ``name``, ``lossless`` and ``Params`` (an attrs
class holding its YAML parameters, validated strictly), and is built once per generation run as
``cls(params)``. The decode loop then calls its methods directly: no hook call on the hot path.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from adaptivespec.fusion_rules import FusionRules
from adaptivespec.types import DraftTree, StepRecord, StepSignals, TreeShape, VerifyResult


@attrs.frozen(kw_only=True)
class NoParams:
    """A strategy without parameters."""


class TreePolicy(FusionRules):
    """Chooses the draft-tree shape of every step and how each tree level is kept.

    Subclasses implement :meth:`shapes` and :meth:`next_shape`; they may override :meth:`observe`
    (called after every step with its record), :meth:`reset` (new prompt) and the two tree rules
    :meth:`select_level` / :meth:`select_final`, whose defaults are EAGLE-2/3's beam drafting.
    With candidate sources, the fusion rules (:class:`~adaptivespec.fusion_rules.FusionRules`:
    ``fusion_scores``, ``fusion_size``) rank and size the fused tree.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True  # a policy never changes what is accepted
    Params: ClassVar[type] = NoParams
    adapts_shape: ClassVar[bool] = True
    """Whether the shape may change from step to step. ``False`` (``static``: a baseline's one shape)
    tells a serving engine to keep that shape as it is: ``adaptivespec serve``'s load model does not
    shrink it under load."""
    reads_draft_entropy: ClassVar[bool] = False
    """Whether :meth:`next_shape` reads ``signals.draft_entropy``: a runtime that does not compute it
    for free (SGLang hands over the root's top-k only) then measures it for this policy."""

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    # -- lifecycle -------------------------------------------------------------------------
    def shapes(self) -> tuple[TreeShape, ...]:
        """Every shape :meth:`next_shape` may return; the runtime prepares one executor for each."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget per-sequence state before a new prompt."""

    def next_shape(self, signals: StepSignals) -> TreeShape:
        """The shape of this step, from signals available before drafting it."""
        raise NotImplementedError

    def observe(self, record: StepRecord) -> None:
        """Learn from the step that just finished."""

    def plain_next(self) -> bool:
        """Whether the next step is a plain one: the runtime's one-token step, nothing drafted or
        proposed (it is recorded with ``undrafted="policy"`` and not passed to :meth:`observe`). Asked
        once per step, before anything else, and only on a runtime that keeps its head's rows for later
        (``defers_head``: llama.cpp's, where a plain step then costs exactly plain decoding's). Default: never."""
        return False

    def state(self) -> dict[str, Any]:
        """What the policy wants recorded in the step trace about its last decision."""
        return {}

    def observe_tree(self, tree: DraftTree, result: VerifyResult) -> None:
        """Learn from one verify result: the verified tree and its accepted path (optional;
        called before :meth:`state` and :meth:`observe` of the same step)."""

    def fitted_on(self) -> list:
        """The fitted files this policy reads (cost profiles, calibration priors, fitted models), each
        as a :class:`~adaptivespec.costmodel.ProfileOrigin` naming its config key and what it was
        measured on. The engine compares them with the running target, head and CPU and warns once
        where they differ. Default: none."""
        return []

    def bind_costs(self, measure: Any, device: str) -> None:
        """Called once by the engine before :meth:`fitted_on` and the first step. ``measure()``
        returns this machine's measured step costs for the running target, head and dtype (a
        :class:`~adaptivespec.fastpath.costs.CostTable`: measured on first use, ~30 s, then cached)
        or None where the runtime measures none; ``device``: ``runtime.device``. A policy that
        prices steps with a cost model may switch to it (``policy.costs``,
        :func:`~adaptivespec.costmodel.measured_costs`). Not called on replays. Default: ignored."""

    def verify_shape(self, shape: TreeShape, n: int) -> TreeShape:
        """The bank shape whose executor verifies a tree of ``n`` nodes drafted with ``shape``
        (policies with a variable verify budget return a smaller bucket); default ``shape``."""
        return shape

    # -- tree construction rules (EAGLE-2/3 defaults) ----------------------------------------
    def select_level(
        self, scores: torch.Tensor, depth: int, shape: TreeShape, nodes_so_far: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Which candidates of one tree level stay in the pool and which are expanded further.

        ``scores``: [c] cumulative draft log-probabilities of the level's candidates (c = topk at
        depth 1, beam * topk below). Returns ``(pool, beam)`` index tensors; ``pool=None`` means
        every candidate stays in the pool. EAGLE keeps all candidates and expands the best topk.
        """
        k = min(shape.topk, scores.shape[0])
        return None, torch.topk(scores, k, sorted=False).indices

    def select_final(self, scores: torch.Tensor, shape: TreeShape) -> torch.Tensor:
        """Indices of the pooled candidates verified by the target (``ndt - 1`` best by score).

        The pool is laid out by depth, so a stable sort keeps a parent ahead of a child whose
        cumulative score ties with it: the kept set is closed under ancestors.
        """
        k = min(shape.ndt - 1, scores.shape[0])
        return torch.sort(scores, descending=True, stable=True).indices[:k]


class Verifier:
    """Decides which path of a drafted tree is accepted, from the target's logits over the tree.

    A verifier is *lossless* when its output equals greedy decoding of the target token for token.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    Params: ClassVar[type] = NoParams
    supports_sampling: ClassVar[bool] = False
    """Whether :meth:`verify` has a sampling form (``generation.temperature > 0``). Without one,
    a speculative config at temperature > 0 is refused (:func:`adaptivespec.config.check_sampling`)."""
    sampler: Any = None
    """At temperature > 0 the engine sets its :class:`~adaptivespec.sampling.Sampler` here before
    decoding; None means greedy. A verifier with a sampling form reads it in :meth:`verify`."""

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        """Accepted path and emitted tokens. ``logits``: [n, V] target logits at every tree node."""
        raise NotImplementedError


class CandidateSource:
    """Proposes continuations of the sequence so far, verified beside (or instead of) the head's tree.

    One instance lives in an engine for its whole life. Per generation the decode loop calls
    :meth:`reset` with the prompt, :meth:`extend` with every token emitted, :meth:`propose` before
    each step's verify and :meth:`observe` after it (with the tokens the step emitted, so a source
    can learn how often its proposals are accepted), and :meth:`finish` with the whole output.
    A source only proposes: the verifier decides, so it never makes decoding lossy.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True  # proposals are verified like any drafted node
    Params: ClassVar[type] = NoParams
    structured_default: ClassVar[bool] = False
    """True: with a response format (and ``generation.grammar_draft``), a speculative config that
    does not list this source gets it with default parameters (the built-in ``grammar`` source)."""
    constraint: Any = None
    """The generation's grammar state (:class:`~adaptivespec.constraints.Constraint`) when a
    response format is set, else None; the engine sets it before :meth:`reset`. Proposals need
    not obey it (the target's masked logits reject what the grammar forbids)."""

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new sequence with ``prompt_ids``."""

    def extend(self, tokens: list[int]) -> None:
        """``tokens`` were appended to the sequence (the last one is the root of the next tree)."""

    def propose(self):
        """A :class:`~adaptivespec.types.CandidateTrie` of continuations below the root (its
        ``scores`` set: estimated acceptance of each node's path), or None."""
        raise NotImplementedError

    def observe(self, trie, tokens: list[int]) -> None:
        """The step verified with ``trie`` emitted ``tokens`` (accepted + bonus)."""

    def finish(self, output_ids: list[int]) -> None:
        """The generation ended with ``output_ids`` (a source may remember them for later prompts)."""

    def forget(self) -> None:
        """Drop whatever was remembered across generations."""

    def extra_slots(self) -> int:
        """Verify slots granted beyond the policy's ``ndt`` when this source has proposals."""
        return 0

    def skip_draft(self, trie) -> bool:
        """True when ``trie`` alone is worth verifying: the head's draft passes are skipped."""
        return False
