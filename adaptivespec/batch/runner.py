"""The batch's model runner: one packed target forward over a step's prompt chunks, verify trees
and plain rows (:func:`~adaptivespec.fastpath.batched.packed_forward`), every lane's keys and
values in one :class:`~adaptivespec.fastpath.batched.KVSlab`; and the greedy picks of plain rows
in one call, made by the forward."""

from __future__ import annotations

from typing import Sequence

import torch

from adaptivespec.batch.request import Lane
from adaptivespec.batch.scheduler import Chunk
from adaptivespec.batch.step import Item
from adaptivespec.fastpath.batched import KVSlab, Part, kernels_attend, layer_pieces, packed_forward, padded_rows
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.tree_sampling import greedy_ids
from adaptivespec.types import DraftTree, TreeShape

ROOT_SHAPE = TreeShape(1, 1, 2)
"""The shape recorded on a plain row (the root alone: never looked up in a shape bank)."""


class Runner:
    """The target (and the drafter's fusion of the states it reads) run over a step's rows."""

    def __init__(self, target, drafter, dtype, device) -> None:
        self.pieces = layer_pieces(target)
        self.kernels = kernels_attend(getattr(self.pieces, "sgl", None), dtype)
        self.drafter, self.device = drafter, device
        # the target's hidden states the draft head reads (its three layers), kept by each forward
        self.head_states = [i + 1 for i in drafter.aux_layers] if drafter is not None else False
        self.slab: KVSlab | None = None
        """Every lane's target caches, slot ``i`` lane ``i`` (set by the engine's ``reserve``)."""

    def reserve(self, lanes: Sequence[Lane], positions: int, heads, states: torch.Tensor | None) -> None:
        """Every lane's caches sized for ``positions`` context positions: the target's in one
        :class:`~adaptivespec.fastpath.batched.KVSlab` (slot ``i``: lane ``i``), the draft head's per
        lane (``heads``: :class:`~adaptivespec.batch.head.DraftHeads`), and with the prefix cache's
        ``states`` (its pool of the head's input states) the lane's own such state per position."""
        rt0 = lanes[0].engine.runtime
        config = rt0.target.config
        cap = rt0.reserved_positions(positions)
        self.slab = None  # the old slab goes before the new one is taken
        for lane in lanes:
            lane.engine.runtime.cache = None
        self.slab = slab = KVSlab(config, len(lanes), cap, rt0.dtype, self.device)
        for lane in lanes:
            rt = lane.engine.runtime
            rt.cache = buffered_cache(config, cap)
            slab.bind(lane.index, rt.cache)
            with heads.bound(lane):
                lane.engine.reserve(positions)
            lane.states = states.new_zeros(cap, states.shape[1]) if states is not None else None

    def slot(self, lane: Lane) -> int | None:
        """``lane``'s slot in the slab, or None when its cache left it (a request longer than reserved)."""
        slab = self.slab
        return lane.index if slab is not None and slab.holds(lane.index, lane.engine.runtime.cache) else None

    def forward(self, chunks: Sequence[Chunk], items: Sequence[Item]):
        """One packed target forward. Returns (logits of the last prompt rows, logits of the items'
        rows, the drafter's input states of all rows or None); each item's ``rows`` are its span of
        the forward's rows, ``logit`` where its logits start, ``token`` a greedy plain row's pick."""
        ids, positions, parts, logit_rows = [], [], [], []
        row = 0
        for c in chunks:
            rt = c.request.lane.engine.runtime
            n = c.end - c.start
            ids.append(torch.tensor(c.request.prompt[c.start:c.end], dtype=torch.long, device=self.device))
            positions.append(torch.arange(c.start, c.end, device=self.device))
            # in the slab where each member attends over its own keys (the kernels); alone otherwise, where
            # its long past would widen everyone's keys (by itself, an 8-row chunk's attention had cost as
            # much as the step's other rows: 7 decoders' steps went 15 -> 35 ms, not 1.8x)
            parts.append(Part(cache=rt.cache, rows=n, slot=self.slot(c.request.lane) if self.kernels else None))
            if c.last:
                logit_rows.append(torch.tensor([row + n - 1], device=self.device))
            row += n
        n_chunk_logits, li = len(logit_rows), 0
        for it in items:
            rt = it.request.lane.engine.runtime
            if it.tree is None:  # plain decoding: the root alone
                it.tree = root_tree(rt.root)
            n = it.tree.size
            if n > 1:
                pos, mask = rt.verify_inputs(it.tree)
            else:
                pos, mask = rt.P + it.tree.depth, None
            ids.append(it.tree.tokens), positions.append(pos)
            parts.append(Part(cache=rt.cache, rows=n, mask=mask, slot=self.slot(it.request.lane)))
            logit_rows.append(torch.arange(row, row + n, device=self.device))
            it.rows, it.logit = (row, row + n), li
            row, li = row + n, li + n
        R = padded_rows(row)
        ids = torch.cat(ids)
        pos = torch.cat(positions)
        if R > row:
            ids = torch.cat([ids, ids.new_zeros(R - row)])
            pos = torch.cat([pos, pos.new_zeros(R - row)])
        read = torch.cat(logit_rows) if logit_rows else torch.zeros(0, dtype=torch.long, device=self.device)
        m = read.shape[0]
        if m:
            read = torch.cat([read, read[-1:].expand(padded_rows(m) - m)])  # bounded row counts for the LM head too
        logits, hidden = packed_forward(self.pieces, ids, pos, parts, read, hidden=self.head_states,
                                        slab=self.slab)
        for it in items:
            if it.tree.size > 1:
                it.request.lane.engine.runtime.verify_done(it.tree)
        fused = self.drafter.fuse(hidden)[0] if self.drafter is not None else None  # [R, H]
        self.greedy_rows(items, logits[n_chunk_logits:m])
        return logits[:n_chunk_logits], logits[n_chunk_logits:m], fused

    @staticmethod
    def greedy_rows(items: Sequence[Item], logits: torch.Tensor) -> None:
        """Each plain row picked greedily (no sampler, no grammar) gets its ``token``, all in one argmax
        (on a 2-vCPU EPYC, bf16, a 49k-vocabulary argmax of 8 rows: 380 us row by row, 180 in one call)."""
        plain = [it for it in items if it.proposal is None and it.request.lane.engine.runtime.sampler is None
                 and it.request.lane.engine.runtime.logits_processor is None]
        if not plain:
            return
        rows = [it.logit for it in plain]
        one = rows[-1] - rows[0] == len(rows) - 1  # consecutive (a plain step): a view, no gather (+110 us)
        picked = greedy_ids(logits[rows[0]:rows[-1] + 1] if one else logits[torch.tensor(rows)]).tolist()
        for it, tok in zip(plain, picked):
            it.token = tok


def root_tree(root: torch.Tensor) -> DraftTree:
    """The root alone: a plain decoding row."""
    dev = root.device
    return DraftTree(tokens=root.reshape(1).to(torch.long), parents=torch.tensor([-1], device=dev),
                     depth=torch.zeros(1, dtype=torch.long, device=dev), ancestors=torch.ones(1, 1, dtype=torch.bool, device=dev),
                     draft_logp=torch.zeros(1, device=dev), shape=ROOT_SHAPE)
