"""The scheduler decides one step; it never touches a cache or a tensor.

Budgets are plain counters (vLLM V1's): the step's rows go first to the decoding requests' root
rows, then to prompt chunks in arrival order. While others decode, prompt rows are capped per
step (``batch.prefill_rows``, by default sized from the measured costs so that the step stays
within ``batch.prefill_stall`` times its cost, that much again for every further prompt being
read: a long prompt is read over several steps, and the others' next tokens are not held up
behind it); with nobody decoding, up to
``runtime.prefill_chunk`` rows per prompt. The verify trees' draft rows are the row budget's business (:mod:`adaptivespec.batch.budget`),
after drafting.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from adaptivespec.batch.request import Request, Status


@attrs.frozen(kw_only=True)
class Chunk:
    """Prompt positions ``[start, end)`` of ``request`` run this step."""

    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        """The prompt's last chunk: its last row gives the first token."""
        return self.end == len(self.request.prompt)


@attrs.frozen(kw_only=True)
class StepPlan:
    """One step, decided: the whole interface between the scheduler and the engine."""

    leaves: tuple[Request, ...] = ()
    """Cancelled requests (running or waiting): their lanes are freed before the step."""
    joins: tuple[Request, ...] = ()
    """Waiting requests that take a free lane this step (their prefill starts now)."""
    chunks: tuple[Chunk, ...] = ()
    """Prompt rows run this step, per request, in arrival order."""
    decoders: tuple[Request, ...] = ()
    """Requests taking a speculative (or plain) step."""

    @property
    def rows(self) -> int:
        """Rows the step runs before any draft row: the prompt chunks and one root row per decoder."""
        return sum(c.end - c.start for c in self.chunks) + len(self.decoders)

    @property
    def idle(self) -> bool:
        return not self.chunks and not self.decoders


class Scheduler:
    """Joins, leaves and prompt chunks of each step (see the module's text)."""

    def __init__(self, slots: int, *, prefill_rows: int | Callable[[int, int, int], int], prefill_chunk: int,
                 max_rows: int) -> None:
        """``prefill_rows``: prompt rows per step while others decode, or a function of the rows the
        step runs without them (the decoders' roots), the first waiting prompt's tokens already
        read and the number of requests reading prompts that says how many."""
        self.slots, self.max_rows = slots, max_rows
        self.prefill_rows = prefill_rows if callable(prefill_rows) else (lambda base, past, prompts, rows=prefill_rows: rows)
        self.prefill_chunk = prefill_chunk or max_rows

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> StepPlan:
        """The next step for ``running`` (holding lanes, arrival order) and ``waiting`` (FIFO)."""
        leaves = [r for r in (*running, *waiting) if r.cancelled]
        staying = [r for r in running if not r.cancelled]
        free = self.slots - len(staying)
        joins = [r for r in waiting if not r.cancelled][:max(free, 0)]
        decoders = [r for r in staying if r.status is Status.DECODE]
        prefilling = [r for r in staying if r.status is Status.PREFILL] + joins
        first = prefilling[0].prefilled if prefilling else 0
        room = min(self.prefill_rows(len(decoders), first, len(prefilling)) if decoders else self.max_rows, self.max_rows - len(decoders))
        chunks = []
        for r in prefilling:
            start = r.prefilled
            take = min(len(r.prompt) - start, room, self.prefill_chunk)
            if take <= 0:
                break
            chunks.append(Chunk(request=r, start=start, end=start + take))
            room -= take
        return StepPlan(leaves=tuple(leaves), joins=tuple(joins), chunks=tuple(chunks), decoders=tuple(decoders))
