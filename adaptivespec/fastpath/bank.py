"""The shape bank: one pre-built executor per selectable tree shape.

The paper's system pre-captures one CUDA graph per ``(nsteps, topk, ndt)`` triplet and swaps them
every step. Here a :class:`ShapeExecutor` holds everything tied to one shape: the additive
attention-mask buffers of the drafter's levels and of the target's tree verification, the
drafter's slot-ancestry matrix, and (on CUDA) a slot for captured graphs. All are allocated when
the bank is built or when a prompt needs more context than reserved — never when the policy
switches shape. Asking for a shape outside the bank raises, listing the shapes that exist.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import torch

from adaptivespec.errors import ShapeNotInBankError
from adaptivespec.types import TreeShape


def max_beam(shape: TreeShape) -> int:
    """Most nodes one drafter level can run for this shape (EAGLE: topk; budget rules: <= ndt)."""
    return max(shape.topk, shape.ndt - 1)


def max_expanded(shape: TreeShape) -> int:
    """Most drafter slots a tree of this shape can use (beam nodes over nsteps - 1 levels)."""
    return max(1, (shape.nsteps - 1) * max_beam(shape))


@attrs.define(eq=False)
class ShapeExecutor:
    """Buffers (and, on CUDA, graphs) of one tree shape; reused every step that shape is chosen."""

    shape: TreeShape
    verify_mask: torch.Tensor  # [1, 1, ndt + extra_rows, capacity] additive, all 0 outside the current tree block
    draft_mask: torch.Tensor  # [1, 1, max_beam, capacity] additive, same convention
    slot_anc: torch.Tensor  # [max_expanded, max_expanded] bool, drafter slot ancestry
    graphs: dict[str, Any] = attrs.field(factory=dict)  # filled by a CUDA-graph capturer

    @property
    def capacity(self) -> int:
        return int(self.verify_mask.shape[-1])


class ShapeBank:
    """Executors keyed by :class:`TreeShape`, built before decoding."""

    def __init__(self, shapes: Iterable[TreeShape], *, capacity: int, dtype: torch.dtype, device: Any, extra_rows: int = 0) -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self.extra_rows = extra_rows  # verify slots beyond ndt (candidate sources' extra nodes)
        self._executors = {s: self._build(s, capacity) for s in sorted(set(shapes))}
        if not self._executors:
            raise ValueError("a shape bank needs at least one shape")

    def _build(self, shape: TreeShape, capacity: int) -> ShapeExecutor:
        z = dict(dtype=self.dtype, device=self.device)
        slots = max_expanded(shape)
        return ShapeExecutor(
            shape=shape,
            verify_mask=torch.zeros(1, 1, shape.ndt + self.extra_rows, capacity, **z),
            draft_mask=torch.zeros(1, 1, max_beam(shape), capacity, **z),
            slot_anc=torch.zeros(slots, slots, dtype=torch.bool, device=self.device),
        )

    @property
    def shapes(self) -> tuple[TreeShape, ...]:
        return tuple(self._executors)

    @property
    def capacity(self) -> int:
        return min(ex.capacity for ex in self._executors.values())

    def __contains__(self, shape: object) -> bool:
        return shape in self._executors

    def get(self, shape: TreeShape) -> ShapeExecutor:
        try:
            return self._executors[shape]
        except KeyError:
            known = ", ".join(str(s) for s in self._executors)
            raise ShapeNotInBankError(f"tree shape {shape} is not in the shape bank; prepared shapes: {known}") from None

    def reserve(self, positions: int) -> None:
        """Make every executor cover ``positions`` context positions (at prefill, never per step)."""
        if positions > self.capacity:
            capacity = max(positions, 2 * self.capacity)
            self._executors = {s: attrs.evolve(self._build(s, capacity), graphs=ex.graphs) for s, ex in self._executors.items()}
