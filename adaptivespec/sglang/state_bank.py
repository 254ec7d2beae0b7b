"""The shape bank of the served worker: one pre-built runtime state per tree shape. No sglang import."""

from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

from adaptivespec.errors import AdaptiveSpecError, ShapeNotInBankError
from adaptivespec.sglang.shapes import format_shapes, kv_alloc_len_per_decode, sglang_shape_problem
from adaptivespec.types import TreeShape

S = TypeVar("S")

KV_RESERVE = {"len": 0}
"""KV slots per request and decode step covering every bank shape, set by the served worker at start-up
(this process's bank) and read by the plugin's ``get_alloc_len_per_decode`` hook."""


class ShapeStateBank(Generic[S]):
    """One pre-built runtime state per ``(nsteps, topk, ndt)`` triplet, keyed by the whole triplet.

    SGLang's own ``--speculative-adaptive`` keys its states by ``num_steps`` alone (topk = 1); the
    paper swaps among trees that differ in width too, so the key here is the full
    :class:`TreeShape`. States are built once at start-up (:meth:`build_missing`) and looked up
    every step (:meth:`get`), which fails loudly with the captured keys.
    """

    def __init__(self, shapes: Iterable[TreeShape]) -> None:
        self.shapes = tuple(sorted(set(shapes)))
        if not self.shapes:
            raise AdaptiveSpecError("a shape bank needs at least one tree shape")
        problems = [p for p in map(sglang_shape_problem, self.shapes) if p]
        if problems:
            raise AdaptiveSpecError("shapes SGLang cannot run: " + "; ".join(problems))
        self._states: dict[TreeShape, S] = {}

    def register(self, shape: TreeShape, state: S) -> None:
        if shape not in self.shapes:
            raise ShapeNotInBankError(f"{shape} is not one of this bank's shapes: {format_shapes(self.shapes)}")
        self._states[shape] = state

    def build_missing(self, build: Callable[[TreeShape], S]) -> list[TreeShape]:
        """Build and register a state for every shape without one, in shape order; returns them."""
        built = [s for s in self.shapes if s not in self._states]
        for shape in built:
            self.register(shape, build(shape))
        return built

    def get(self, shape: TreeShape) -> S:
        try:
            return self._states[shape]
        except KeyError:
            missing = [s for s in self.shapes if s not in self._states]
            hint = f"; declared but not built: {format_shapes(missing)}" if missing else ""
            raise ShapeNotInBankError(
                f"no runtime state for tree shape {shape}; captured shapes: {format_shapes(self._states)}{hint}"
            ) from None

    def keys(self) -> tuple[TreeShape, ...]:
        """Shapes that have a state."""
        return tuple(sorted(self._states))

    def missing(self) -> tuple[TreeShape, ...]:
        return tuple(s for s in self.shapes if s not in self._states)

    def __contains__(self, shape: object) -> bool:
        return shape in self._states

    def __len__(self) -> int:
        return len(self._states)

    def max_shape(self) -> TreeShape:
        """The element-wise largest triplet: every buffer SGLang sizes from its server arguments
        at start-up (attention backends, KV headroom, draft-input relay) fits every bank shape
        when the server starts with it. A valid shape, since ``max_nodes`` grows with both depth
        and width."""
        return TreeShape(
            max(s.nsteps for s in self.shapes), max(s.topk for s in self.shapes), max(s.ndt for s in self.shapes)
        )

    def max_topk(self) -> int:
        return max(s.topk for s in self.shapes)

    def kv_alloc_len_per_decode(self, page_size: int = 1) -> int:
        """KV slots per request and decode step that cover every shape of the bank: reserved
        before the policy picks the step's shape, so it must fit the largest."""
        max_ndt = max(s.ndt for s in self.shapes)
        return max(kv_alloc_len_per_decode(s, page_size, max_ndt) for s in self.shapes)
