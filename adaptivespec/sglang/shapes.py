"""Tree shapes as SGLang's EAGLE worker runs them: which shapes it can run, how a policy's shape maps
onto one, the smallest tree a loaded server falls back to, and the KV slots a shape needs per step.
No sglang import."""

from __future__ import annotations

from typing import Iterable

from adaptivespec.types import TreeShape


def format_shapes(shapes: Iterable[TreeShape]) -> str:
    return ", ".join(str(s) for s in sorted(shapes)) or "(none)"


def sglang_shape_problem(shape: TreeShape) -> str | None:
    """Why SGLang's EAGLE worker cannot run ``shape``, as a sentence; None when it can.

    SGLang's topk=1 path drafts a plain chain and keeps every drafted token (its server-argument
    hook forces ``ndt = nsteps + 1`` and ``_rebuild_topk1_chain_buffers`` asserts it).
    """
    if shape.topk == 1 and shape.ndt != shape.nsteps + 1:
        return f"{shape}: SGLang's topk=1 chain path needs ndt == nsteps + 1 (here {shape.nsteps + 1})"
    return None


def sglang_shape(shape: TreeShape) -> TreeShape:
    """The shape SGLang runs for ``shape``: no deeper than ``ndt - 1`` levels.

    A verified tree of ``ndt`` nodes (the root and the ``ndt - 1`` best drafted nodes, a set closed
    under ancestors, since a node's score never exceeds its parent's) holds no node deeper than
    ``ndt - 1``, so drafting further levels changes nothing but the cost; and SGLang 0.5.23's verify
    compacts ``nsteps + 1`` accepted rows into ``ndt`` slots, which fails when ``nsteps >= ndt``
    (``_compact_accept_to_front``: "expanded size ... must match"), e.g. cost_aware's ``(6, 4, 4)``.
    """
    return TreeShape(min(shape.nsteps, shape.ndt - 1), shape.topk, shape.ndt) if shape.ndt >= 2 else shape


def sglang_shapes(shapes: Iterable[TreeShape]) -> set[TreeShape]:
    """The set of shapes SGLang runs for a policy's ``shapes`` (:func:`sglang_shape` of each)."""
    return {sglang_shape(s) for s in shapes}


class NoDraft:
    """The step that drafts nothing: the target verifies the last token alone (one row per request)
    and emits one token, as plain decoding does. SGLang's EAGLE worker runs it at
    ``speculative_num_steps == 0`` (its draft extension still runs, so the next step can draft).
    Has a shape's fields (``(0, 0, 1)``) so costs and labels read it like one."""

    nsteps, topk, ndt = 0, 0, 1

    def __repr__(self) -> str:
        return "NO_DRAFT"

    def __str__(self) -> str:
        return "(no draft)"

    def __lt__(self, other: object) -> bool:  # sorts before every tree
        return not isinstance(other, NoDraft)


NO_DRAFT = NoDraft()
"""The one no-draft step (:class:`NoDraft`)."""


def load_floor_shape(shapes: Iterable[TreeShape]) -> TreeShape:
    """The smallest tree a load-aware controller falls back to under a large batch: one draft
    step, one drafted token verified (``ndt = 2``), at the bank's smallest ``topk`` (SGLang's EAGLE
    worker cannot skip drafting; this is the least speculation it runs)."""
    k = min(s.topk for s in shapes)
    return TreeShape(1, k, 2)


def kv_alloc_len_per_decode(shape: TreeShape, page_size: int, max_ndt: int) -> int:
    """KV slots one request may take in one decode step of ``shape`` (mirrors SGLang's
    ``get_alloc_len_per_decode`` in ``sglang/srt/mem_cache/allocation_sizing.py``: the draft
    writes ``nsteps * topk`` slots, the verify ``ndt``; with pages and topk > 1 every branch
    rounds up to whole pages)."""
    if page_size == 1 or shape.topk == 1:
        return max(shape.nsteps * shape.topk, max_ndt)
    pages_per_branch = (page_size - 1 + shape.nsteps + page_size - 1) // page_size
    return max(pages_per_branch * page_size * shape.topk, max_ndt)
