"""The draft head across a batch's lanes: what it drafts, what it follows, and its catching up.

Every lane has the head's own cache (``lane.kv``) and root state (its runtime's ``root_state`` /
``root_logp``). A drafting step drafts every tree together (one head pass per depth level over all
trees still growing); after the commit the head runs every request's new rows (prompt chunks,
accepted tokens and bonus) in one pass. A plain step does not run the head: the rows it skipped
wait in ``lane.pending`` and the head catches up on all of them in one pass before it drafts again,
so it never drafts from a stale state.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from adaptivespec.batch.request import Lane
from adaptivespec.batch.scheduler import StepPlan
from adaptivespec.batch.step import Item
from adaptivespec.fastpath.batched import DraftPart, bound, packed_draft_step
from adaptivespec.runtime import LevelMasks
from adaptivespec.types import DraftTree


class DepthCap:
    """A tree policy's level rules with drafting stopped below ``cap`` levels: the beam is empty
    from depth ``cap`` on, so the head runs ``cap - 1`` passes (everything else is the policy's)."""

    def __init__(self, rules, cap: int) -> None:
        self.rules, self.cap = rules, cap

    def select_level(self, scores, depth, shape, pool_size):
        pool_sel, beam = self.rules.select_level(scores, depth, shape, pool_size)
        return pool_sel, (beam[:0] if depth >= self.cap else beam)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rules, name)


class DraftHeads:
    """The draft head (``drafter``: None for a config without one) for every lane of a batch."""

    def __init__(self, drafter, device) -> None:
        self.drafter, self.device = drafter, device

    def bound(self, lane: Lane):
        """The head on ``lane``'s cache for single-request operations (nothing without a head)."""
        return bound(self.drafter, lane.kv) if self.drafter is not None else contextlib.nullcontext()

    # -- before drafting --------------------------------------------------------------------------
    def rows_behind(self, plan: StepPlan, items: Sequence[Item]) -> int:
        """Rows the head would run if this step drafted for every decoder: those plain steps left it
        behind on, and the step's prompt chunks (with their prefixes from the cache) where it is up
        to date (see :meth:`extend`); in a plain step they wait."""
        if self.drafter is None:
            return 0
        n = 0
        for it in items:  # a lane's pending rows are consecutive positions: first to last, not entry by entry
            pending = it.request.lane.pending
            if pending:
                n += int(pending[-1][2][-1]) - int(pending[0][2][0]) + 1
        for c in plan.chunks:
            lane = c.request.lane
            if not lane.pending:
                n += c.end - c.start + (lane.kept_rows[0].shape[0] if lane.kept_rows is not None else 0)
        return n

    def catch_up(self, lanes: Sequence[Lane]) -> None:
        """The head runs the rows it skipped in plain steps, every lane's in one pass; then the draft
        distributions of heads that followed plain steps, in one pass too."""
        behind = [lane for lane in lanes if lane.pending]
        for lane in behind:  # commit_target moved the head's length past the rows it has not run yet
            lane.kv.length = int(lane.pending[0][2][0])
        if behind:
            self.follow([(lane, *(torch.cat(part) for part in zip(*lane.pending))) for lane in behind])
            for lane in behind:
                lane.pending.clear()
        stale = [lane.engine.runtime for lane in lanes if lane.engine.runtime.root_logp is None]
        if stale:
            logp = self.drafter.log_probs(torch.stack([rt.root_state for rt in stale]))
            for rt, lp in zip(stale, logp):
                rt.root_logp = lp

    # -- drafting ---------------------------------------------------------------------------------
    def draft(self, items: Sequence[Item], capped: bool) -> dict[int, DraftTree]:
        """Every item's head tree, all drafted together: one draft-head pass (and one LM-head pass)
        per depth level over the levels of all trees still growing; ``capped``: each lane drafts no
        deeper than the row budget's ``lane.depth_cap``. Returns ``id(item)`` -> tree."""
        d = self.drafter
        trees: dict[int, DraftTree] = {}
        growing = []  # (item, levels generator, masks, the level's expand arguments)
        for it in items:
            lane = it.request.lane
            rt = lane.engine.runtime
            rules = lane.engine.policy
            if capped and lane.depth_cap:
                rules = DepthCap(rules, lane.depth_cap)
            with bound(d, lane.kv):
                masks = LevelMasks(rt, it.shape)
            levels = rt.draft_levels(it.shape, rules)
            try:
                growing.append((it, levels, masks, next(levels)))
            except StopIteration as done:
                trees[id(it)] = done.value
        while growing:
            tokens, states, positions, parts = [], [], [], []
            for it, _, masks, (tok, hid, parent_slots, depth) in growing:
                pos, mask = masks.inputs(tok.shape[0], parent_slots, depth)
                tokens.append(tok), states.append(hid), positions.append(pos)
                parts.append(DraftPart(kv=it.request.lane.kv, rows=tok.shape[0], mask=mask))
            out = packed_draft_step(d, torch.cat(tokens), torch.cat(states), torch.cat(positions), parts)
            logp = d.log_probs(out)  # [R, Vd]
            nxt, start = [], 0
            for (it, levels, masks, level), part in zip(growing, parts):
                masks.clear()
                end = start + part.rows
                try:
                    nxt.append((it, levels, masks, levels.send((logp[start:end], out[start:end]))))
                except StopIteration as done:
                    trees[id(it)] = done.value
                start = end
            growing = nxt
        return trees

    # -- after the commit -------------------------------------------------------------------------
    @staticmethod
    def keep(follow: list) -> None:
        """The head's input states of a step's new rows ``(lane, tokens, states, positions)`` into
        the lanes' ``states`` (what the prefix cache keeps beside the keys and values)."""
        for lane, _, states, positions in follow:
            if lane.states is not None:
                keep_states(lane, states, positions)

    def extend(self, follow: list, plain: bool) -> None:
        """The head runs a step's new rows ``(lane, tokens, states, positions)`` now where it is up
        to date, or leaves them pending after a plain step (a prompt read in chunks over plain and
        drafting steps: its later chunks wait behind the earlier ones, in order)."""
        now = []
        for lane, *rows in follow:
            if plain or lane.pending:
                lane.pending.append(rows)
            else:
                now.append((lane, *rows))
        if now:
            self.follow(now)

    def follow(self, follow) -> None:
        """The head runs every request's new rows (prompt chunks, accepted tokens + bonus) in one
        pass; each request's root state and draft distribution come from its last row."""
        parts = [DraftPart(kv=lane.kv, rows=tokens.shape[0]) for lane, tokens, _, _ in follow]
        out = packed_draft_step(self.drafter, torch.cat([f[1] for f in follow]), torch.cat([f[2] for f in follow]),
                                torch.cat([f[3] for f in follow]), parts)
        ends = torch.tensor([p.rows for p in parts]).cumsum(0) - 1
        last = out[ends]
        for (lane, *_), state in zip(follow, last):  # the draft distribution when it is next needed
            rt = lane.engine.runtime
            rt.root_state, rt.root_logp = state, None


def keep_states(lane: Lane, states: torch.Tensor, positions: torch.Tensor) -> None:
    """The head's input ``states`` [n, H] of ``positions`` [n] into ``lane.states`` (grown by doubling
    for a request longer than reserved)."""
    end = int(positions[-1]) + 1
    if end > lane.states.shape[0]:
        lane.states = torch.cat([lane.states, lane.states.new_zeros(max(end, lane.states.shape[0]), states.shape[1])])
    lane.states.index_copy_(0, positions, states)
