"""One generation at a time: the engine in one worker thread, a bounded FIFO queue in front of it,
and cancellation at the next step.

The HTTP side (:mod:`adaptivespec.server.app`) never runs a forward: it puts a :class:`Job` in the
queue (:meth:`Worker.submit`, refused with :class:`QueueFull` when ``queue_size`` jobs already wait:
the client gets a 503 with ``Retry-After``) and reads the job's events from an ``asyncio.Queue``.
The worker thread takes jobs in arrival order and runs ``Engine.generate_ids``, whose ``on_tokens``
callback, called once per step, posts the step's new ids to the event loop
(``loop.call_soon_threadsafe``) and raises :class:`Cancelled` once the job is cancelled (the client
went away, or a stop string was found): the generation ends at the next step, and a job cancelled
while it waits is dropped when its turn comes. The next generation starts from its own prefill
(caches, policy and grammar state are reset by ``generate_ids``), so an abandoned one leaves nothing
behind.

Events, in order: ``("tokens", [ids])`` per step, then one of ``("done", Finished)``,
``("cancelled", Finished)`` or ``("error", message)``. A job ended by :meth:`Job.stop` (its answer is
complete: a stop string) ends like a cancelled one, at the next step, but its last event is
``("done", Finished)`` and ``/metrics`` counts it ``completed``.

**A dead worker.** ``Worker.failure`` is None while the worker can take jobs, else a one-line reason:
the generation thread raised outside a generation (an exception inside ``generate_ids`` only fails
that request, with a 500) or the engine could not be built. Once it is set, every job that was
waiting or running has had an ``("error", reason)`` event, :meth:`Worker.submit` answers each new job
with one at once, and the app answers ``/health`` and new requests with 503. Any other worker the app
runs (a batching one) keeps the same surface: ``failure``, and ``Job.stopped`` read as above.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import functools
import logging
import math
import threading
import time
from typing import Any, Callable

import attrs

from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.schema import Sampling

GREEDY = Sampling(temperature=0.0)
"""A request's settings at temperature 0 (the server's greedy requests; a config's sampling is never used)."""

log = logging.getLogger("adaptivespec.server")

@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, or no C library to load)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (``malloc_trim(0)``); False where there is none.

    A prefill's activations are freed when it ends, but glibc keeps the pages of its heap, so a
    server's resident memory would follow the longest prompt it has seen; trimmed after each
    generation it stays at what the live buffers take (a few ms for this engine's heap)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Cancelled(Exception):
    """Raised from ``on_tokens`` to end a cancelled generation at its next step."""


class QueueFull(Exception):
    """The queue holds ``queue_size`` waiting jobs; ``retry_after``: seconds to suggest."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


@attrs.frozen(kw_only=True)
class Finished:
    """What a generation ended with (a cancelled one: up to its last step)."""

    token_ids: list[int]
    stats: dict[str, Any]
    """``GenerationResult.stats`` (partial for a cancelled job) plus ``queue_seconds``."""
    grammar_ended: bool = False
    """The response format's grammar reached its end (a ``stop``, not a ``length``, finish)."""
    logprobs: list | None = None
    """Per token ``(id, log-probability, [(id, log-probability)] top ones)`` when the request asked."""


@attrs.define(eq=False, kw_only=True)
class Job:
    """One request's generation: what to generate, and where its events go."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling | None = None
    seed: int = 0
    response_format: Any = None
    stop_ids: tuple[int, ...] = ()
    """Token ids that end this generation besides the model's EOS ids (the request's ``stop_token_ids``)."""
    logprobs: int | None = None
    """Return each token's log-probability and this many top ones (None: none)."""
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = attrs.Factory(asyncio.Queue)
    cancelled: threading.Event = attrs.Factory(threading.Event)
    stopped: bool = False
    """Set by :meth:`stop`: the answer is complete; ended at the next step and counted ``completed``."""
    enqueued: float = attrs.Factory(time.perf_counter)
    started: float | None = None
    # running totals, kept by the worker (a cancelled job's stats come from them)
    tokens: list[int] = attrs.Factory(list)
    logprob_entries: list = attrs.Factory(list)
    steps: int = 0
    promoted: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def stop(self) -> None:
        """End at the next step because the answer is complete (a stop string), not abandoned."""
        self.stopped = True
        self.cancelled.set()

    def post(self, kind: str, payload: Any) -> None:
        held = getattr(_OUTBOX, "events", None)
        if held is not None:  # inside a batch step: handed over with the step's other events (Outbox)
            held.append((self, kind, payload))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


_OUTBOX = threading.local()


class Outbox:
    """``with Outbox():`` around a batch step: the events its jobs post (every request's tokens,
    the answers) go to the event loop in one ``call_soon_threadsafe`` per loop when it ends, in the
    order posted, instead of one wake-up of the loop's thread per request per step (each one takes
    a core from the step's two threads on a 2-vCPU machine)."""

    def __enter__(self) -> "Outbox":
        _OUTBOX.events = []
        return self

    def __exit__(self, *exc) -> None:
        events, _OUTBOX.events = _OUTBOX.events, None
        by_loop: dict[int, tuple[Any, list]] = {}
        for job, kind, payload in events:
            by_loop.setdefault(id(job.loop), (job.loop, []))[1].append((job.events, (kind, payload)))
        for loop, items in by_loop.values():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass


def _deliver(items) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class Worker:
    """The generation thread and its queue (``queue_size``: jobs that may wait behind the running one)."""

    def __init__(self, engine, queue_size: int, metrics: ServerMetrics | None = None, *,
                 build: Callable[[], Any] | None = None, trim: bool = False) -> None:
        """``engine``: the engine, or None with ``build``: a function that makes it, called first
        thing in the worker thread (:meth:`wait_ready` returns it). On a CPU the engine is best
        built where it runs: torch ops in a thread other than the one that ran the first ones went
        at about half speed here (bf16, 2 cores; the cause is below torch's Python API).
        ``trim``: :func:`trim_heap` after each generation (its answer is out by then)."""
        self.engine, self.queue_size, self.trim = engine, queue_size, trim
        self.metrics = metrics or ServerMetrics()
        self._build, self._build_error = build, None
        self._ready = threading.Event()
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._failure: str | None = None
        self._mean_seconds = 1.0  # running mean of a generation's wall time, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="adaptivespec-generation", daemon=True)

    # -- the HTTP side ----------------------------------------------------------------------------
    def start(self) -> "Worker":
        """Start the generation thread (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO), or raise :class:`QueueFull`; on a dead worker (:attr:`failure`) the job
        gets its ``("error", ...)`` event at once."""
        with self._cond:
            if self._failure is not None:
                self.metrics.outcome("failed")
                job.post("error", self._failure)
                return
            if self._stopping or len(self._waiting) >= self.queue_size:
                ahead = len(self._waiting) + (self._running is not None)
                raise QueueFull(max(1, math.ceil(self._mean_seconds * ahead)))
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def wait_ready(self):
        """The engine, once the thread has built it (re-raises what building it raised)."""
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def failure(self) -> str | None:
        """None while the worker can take jobs; else why it cannot (one line), see the module's docstring."""
        return self._failure

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every job and end the thread."""
        with self._cond:
            self._stopping = True
            for job in [*self._waiting, *([self._running] if self._running else [])]:
                job.cancel()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.engine is None:
            try:
                self.engine = self._build()
            except BaseException as exc:  # handed to wait_ready's caller
                self._build_error = exc
                self._failure = f"the engine could not be built: {_one_line(exc)}"
                self._ready.set()
                return
        self._ready.set()
        try:
            self._serve()
        except BaseException as exc:  # a bug outside any one generation: nothing may wait on this thread now
            log.exception("the generation thread failed")
            self._die(f"the generation worker failed: {_one_line(exc)}")

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for job in self._waiting:
                        job.post("error", "the server is shutting down")
                    self._waiting.clear()
                    return
                job = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
                self._running = job
            self._run(job)  # what escapes leaves the job in _running: _die answers it
            with self._cond:
                self._running = None
            if self.trim:
                self._trim()

    def _trim(self) -> None:
        """:func:`trim_heap`, timed into ``trim_seconds``."""
        t0 = time.perf_counter()
        if trim_heap():
            self.metrics.trim_seconds.observe(time.perf_counter() - t0)

    def _release(self) -> list[Job]:
        """Every job the worker holds, running and waiting, let go of (under the lock)."""
        jobs = [*([self._running] if self._running is not None else []), *self._waiting]
        self._waiting.clear()
        self._running = None
        return jobs

    def _die(self, reason: str) -> None:
        """Mark the worker failed and answer every job it holds with ``("error", reason)``."""
        with self._cond:
            self._failure = reason
            jobs = self._release()
            self.metrics.queue_depth.set(0)
        for job in jobs:
            self.metrics.outcome("failed")
            job.post("error", reason)

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        waited = job.started - job.enqueued
        self.metrics.queue_seconds.observe(waited)
        if job.cancelled.is_set():  # the client left while it waited
            self.metrics.outcome("cancelled")
            job.post("cancelled", self._partial(job, waited))
            return
        engine = self.engine
        sampling = job.sampling if job.sampling is not None else GREEDY  # the request's, never the config's

        def on_tokens(ids: list[int]) -> None:
            if not job.tokens:
                self.metrics.first_token_seconds.observe(time.perf_counter() - job.started)
            job.tokens.extend(ids)
            job.post("tokens", list(ids))
            if job.cancelled.is_set():
                raise Cancelled

        def on_step(record) -> None:
            job.steps += 1
            job.promoted += record.promoted
            self.metrics.observe_step(record)

        def on_logprobs(entries: list) -> None:
            job.logprob_entries.extend(entries)
            job.post("logprobs", list(entries))

        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        extra = {"stop_ids": job.stop_ids} if job.stop_ids else {}  # only when set: engines without them work
        if job.logprobs is not None:
            extra.update(logprobs=job.logprobs, on_logprobs=on_logprobs)
        try:
            result = engine.generate_ids(job.prompt_ids, max_new_tokens=job.max_tokens, on_tokens=on_tokens,
                                         on_step=on_step, seed=job.seed, response_format=job.response_format,
                                         sampling=sampling, **extra)
        except Cancelled:
            self.metrics.generated_tokens.inc(len(job.tokens))
            partial = self._partial(job, waited)
            if job.stopped:  # a stop string: the answer is complete
                self.metrics.generation_seconds.observe(partial.stats["wall_seconds"])
                self.metrics.outcome("completed")
                job.post("done", partial)
            else:
                self.metrics.outcome("cancelled")
                job.post("cancelled", partial)
            return
        except Exception as exc:  # a bug, not a bad request: the request gets a 500, the server goes on
            self.metrics.outcome("failed")
            job.post("error", f"generation failed: {type(exc).__name__}: {exc}")
            return
        wall = result.stats["wall_seconds"]
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * wall
        self.metrics.generation_seconds.observe(wall)
        self.metrics.generated_tokens.inc(len(result.token_ids))
        self.metrics.outcome("completed")
        ended = engine.constraint is not None and engine.constraint.terminated
        job.post("done", Finished(token_ids=result.token_ids, stats={**result.stats, "queue_seconds": waited},
                                  grammar_ended=ended, logprobs=result.logprobs))

    def _partial(self, job: Job, waited: float) -> Finished:
        wall = time.perf_counter() - job.started
        forwards = (1 + job.steps) if job.steps else len(job.tokens)
        stats = {"new_tokens": len(job.tokens), "target_forwards": forwards,
                 "accept_length_mean": len(job.tokens) / forwards if forwards else 0.0, "wall_seconds": wall,
                 "promoted_tokens": job.promoted, "queue_seconds": waited}
        return Finished(token_ids=list(job.tokens), stats=stats,
                        logprobs=list(job.logprob_entries) if job.logprobs is not None else None)
