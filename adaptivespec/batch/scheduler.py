"""The scheduler owns the requests and decides each step; it never touches a cache or a tensor.

It holds the queues (vLLM V1's seam): ``waiting`` (FIFO, filled from any thread by :meth:`submit`),
``running`` (holding a lane, arrival order) and the free lanes. :meth:`Scheduler.schedule` takes the
cancelled out, admits waiting requests into free lanes (the engine's ``admit`` starts their
strategies and caches; its ``match`` loads what the prefix cache keeps of their prompts), then sizes
the step: one frozen :class:`StepPlan` per step, which the engine runs.

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

import collections
import threading
from typing import Any, Callable, Sequence

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
    """The requests' queues, and joins, leaves and prompt chunks of each step (see the module's text)."""

    def __init__(self, slots: int | Sequence[Any], *, prefill_rows: int | Callable[[int, int, int], int],
                 prefill_chunk: int, max_rows: int) -> None:
        """``slots``: the lanes requests decode in (or how many, for :meth:`plan` alone);
        ``prefill_rows``: prompt rows per step while others decode, or a function of the rows the
        step runs without them (the decoders' roots), the first waiting prompt's tokens already
        read and the number of requests reading prompts that says how many."""
        lanes = list(range(slots)) if isinstance(slots, int) else list(slots)
        self.slots, self.max_rows = len(lanes), max_rows
        self.prefill_rows = prefill_rows if callable(prefill_rows) else (lambda base, past, prompts, rows=prefill_rows: rows)
        self.prefill_chunk = prefill_chunk or max_rows
        self.share_prompts = False
        """A request whose prompt another one is reading waits for it, then takes the prompt from
        the prefix cache (set where there is one: ``n`` choices of one request read their prompt once)."""
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free: list[Any] = lanes
        self._lock = threading.Lock()

    # -- the queues -------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request`` (any thread); it joins a free lane at a coming step."""
        with self._lock:
            self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, *, admit: Callable[[Request, Any], None], leave: Callable[[Request], None],
                 match: Callable[[Request], int] | None = None) -> StepPlan:
        """The next step, one plan: cancelled requests go (``leave``: the engine ends them, which
        frees their lanes through :meth:`release`); waiting ones take free lanes, the lowest first
        (``admit(request, lane)``: the engine starts them there); requests that hold a lane and have
        read nothing of their prompt yet take what the prefix cache keeps of it (``match``: the
        prompt tokens loaded, asked at every step until their first chunk runs); then the step's
        prompt chunks and decoders (:meth:`plan`)."""
        with self._lock:
            leaves = [r for r in (*self.running, *self.waiting) if r.cancelled]
            for r in leaves:
                if r in self.waiting:
                    self.waiting.remove(r)
        for r in leaves:
            leave(r)
        with self._lock:  # (one cancelled meanwhile leaves at the next step)
            joins = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.free)))]
        for r in joins:
            lane = min(self.free, key=lambda lane: getattr(lane, "index", lane))  # the lowest slot: the slab's range stays short
            self.free.remove(lane)
            self.running.append(r)
            admit(r, lane)
        if match is not None:
            for r in self.running:
                if r.status is Status.PREFILL and not r.prefilled:
                    r.prefilled = r.cached = match(r)
        plan = self.plan([r for r in self.running if not r.cancelled], ())
        return attrs.evolve(plan, leaves=tuple(leaves), joins=tuple(joins))

    def release(self, r: Request) -> None:
        """``r`` ended: out of the queues, its lane free again."""
        with self._lock:
            if r in self.running:
                self.running.remove(r)
            elif r in self.waiting:
                self.waiting.remove(r)
        if r.lane is not None:
            self.free.append(r.lane)

    def plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> StepPlan:
        """The next step for ``running`` (holding lanes, arrival order) and ``waiting`` (FIFO)."""
        leaves = [r for r in (*running, *waiting) if r.cancelled]
        staying = [r for r in running if not r.cancelled]
        free = self.slots - len(staying)
        joins = [r for r in waiting if not r.cancelled][:max(free, 0)]
        decoders = [r for r in staying if r.status is Status.DECODE]
        prefilling = [r for r in staying if r.status is Status.PREFILL] + joins
        if self.share_prompts:  # a prompt being read already: the same prompt again waits to take it from the cache
            prefilling = [r for i, r in enumerate(prefilling)
                          if r.prefilled or not any(o.prompt == r.prompt for o in prefilling[:i])]
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
