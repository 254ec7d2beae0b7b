"""Continuous batching behind the server: up to ``parallel`` jobs decode together, more wait (FIFO).

:class:`BatchWorker` keeps :class:`~adaptivespec.server.worker.Worker`'s surface (``submit``,
``QueueFull`` beyond ``queue_size`` waiting jobs, ``failure``, the same events per job) and runs a
:class:`~adaptivespec.batch.BatchEngine` in its thread: each loop takes the new jobs in as requests,
turns the HTTP side's cancellations into the requests' (a disconnect or a stop string frees the
slot at the next step), runs one engine step and answers the jobs that finished in it.
"""

from __future__ import annotations

import math
import time

from adaptivespec.batch import BatchEngine, Request
from adaptivespec.server.worker import GREEDY, Finished, Job, Outbox, QueueFull, Worker, log

IDLE_TRIM_S = 1.0
"""With ``trim``, the heap is trimmed when the engine has been idle this long (not after every
generation: with requests overlapping there is no quiet moment between generations)."""


class BatchWorker(Worker):
    """The generation thread of ``serve --runtime torch --parallel N``."""

    def __init__(self, engine: BatchEngine | None, queue_size: int, metrics=None, *, build=None,
                 trim: bool = False) -> None:
        super().__init__(engine, queue_size, metrics, build=build, trim=trim)
        self._jobs: dict[int, Job] = {}  # request id -> its job, while the engine holds the request
        self._requests: dict[int, Request] = {}
        self._intake: list[Job] = []  # jobs taken off the queue and being handed to the engine (see _die)

    # -- the HTTP side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._failure is not None:
                self.metrics.outcome("failed")
                job.post("error", self._failure)
                return
            if self._stopping or self._waiting_count() >= self.queue_size:
                ahead = len(self._waiting) + len(self._jobs)
                raise QueueFull(max(1, math.ceil(self._mean_seconds * ahead / self.parallel)))
            self._waiting.append(job)
            self.metrics.queue_depth.set(self._waiting_count())
            self._cond.notify()

    def _waiting_count(self) -> int:
        """Jobs that hold no slot: handed over but not yet joined, beyond the free slots."""
        if self.engine is None:
            return len(self._waiting)
        pending = len(self._waiting) + len(self.engine.waiting)
        return max(0, pending - len(self.engine.scheduler.free))

    @property
    def depth(self) -> int:
        return self._waiting_count()

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def running(self) -> int:
        return len(self._jobs)

    @property
    def parallel(self) -> int:
        """Requests decoded together (the engine's lanes, ``--parallel``; 1 until it is built)."""
        return len(self.engine.lanes) if self.engine is not None else 1

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            for job in [*self._waiting, *self._jobs.values()]:
                job.cancel()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        engine: BatchEngine = self.engine
        idle_since: float | None = None
        while True:
            with self._cond:
                while not self._waiting and not self._jobs and not self._stopping:
                    if self.trim and idle_since is not None and time.perf_counter() - idle_since >= IDLE_TRIM_S:
                        self._trim()
                        idle_since = None
                    self._cond.wait(timeout=IDLE_TRIM_S if idle_since is not None else None)
                if self._stopping:
                    for job in [*self._waiting, *self._jobs.values()]:
                        job.post("error", "the server is shutting down")
                    self._waiting.clear()
                    return
                new = self._intake = list(self._waiting)
                self._waiting.clear()
            for job in new:
                self._take(job)
            self._intake = []
            for rid, job in self._jobs.items():
                if job.cancelled.is_set():
                    self._requests[rid].cancel()
            with Outbox():  # the step's tokens and answers reach the event loop in one hand-over
                try:
                    finished = engine.step()
                except Exception as exc:  # a bug in a step: its requests get a 500, the server goes on
                    log.exception("a batch step failed")
                    finished = engine.abort(f"generation failed: {type(exc).__name__}: {exc}")
                self._observe_step(engine)
                for r in finished:
                    self._answer(r)
            self.metrics.queue_depth.set(self._waiting_count())
            idle_since = time.perf_counter() if not self._jobs else None

    def _take(self, job: Job) -> None:
        """``job`` becomes a request of the engine (it joins a slot at a coming step)."""
        job.started = time.perf_counter()
        self.metrics.queue_seconds.observe(job.started - job.enqueued)  # to the hand-over; the wait for a slot follows
        sampling = job.sampling if job.sampling is not None else GREEDY  # the request's, never the config's

        def on_tokens(ids: list[int], job: Job = job) -> None:
            if not job.tokens:
                self.metrics.first_token_seconds.observe(time.perf_counter() - job.started)
            job.tokens.extend(ids)
            job.post("tokens", list(ids))

        def on_step(record, job: Job = job) -> None:  # (the speculation series: per forward, _observe_step)
            job.steps += 1
            job.promoted += record.promoted

        def on_logprobs(entries: list, job: Job = job) -> None:
            job.logprob_entries.extend(entries)
            job.post("logprobs", list(entries))

        r = Request(prompt=list(job.prompt_ids), max_new_tokens=job.max_tokens, seed=job.seed, sampling=sampling,
                    response_format=job.response_format, stop_ids=frozenset(getattr(job, "stop_ids", None) or ()),
                    on_tokens=on_tokens, on_step=on_step, logprobs=getattr(job, "logprobs", None),
                    on_logprobs=on_logprobs)
        if job.cancelled.is_set():
            r.cancel()
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self._jobs[r.rid], self._requests[r.rid] = job, r
        self.engine.submit(r)

    def _answer(self, r: Request) -> None:
        job = self._jobs.pop(r.rid)
        self._requests.pop(r.rid)
        if r.finish_reason == "error":
            self.metrics.outcome("failed")
            job.post("error", r.error or "generation failed")
            return
        stats = r.stats()
        waited = stats["queue_seconds"] + (job.started - job.enqueued)
        stats["queue_seconds"] = waited
        self.metrics.generated_tokens.inc(len(r.out))
        self.metrics.cached_tokens.inc(r.cached)
        if r.forwards:
            self.metrics.request_accept_length.observe(len(r.out) / r.forwards)
        finished = Finished(token_ids=list(r.out), stats=stats, grammar_ended=r.grammar_ended,
                            logprobs=list(job.logprob_entries) if r.logprobs is not None else None)
        if r.finish_reason == "cancelled" and not job.stopped:
            self.metrics.outcome("cancelled")
            job.post("cancelled", finished)
            return
        wall = stats["wall_seconds"]
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * wall
        self.metrics.generation_seconds.observe(wall)
        self.metrics.outcome("completed")  # a stop string (job.stopped) is a complete answer too
        job.post("done", finished)

    def _observe_step(self, engine: BatchEngine) -> None:
        s = engine.last
        if s.requests:
            self.metrics.observe_batch(requests=s.requests, rows=s.rows, budget_rows=s.budget_rows, records=s.records,
                                       undrafted=s.undrafted, verify_rows=s.verify_rows)

    def _release(self) -> list[Job]:
        held = list(self._jobs.values())
        jobs = [*held, *(j for j in self._intake if not any(j is h for h in held)), *self._waiting]
        self._intake = []
        self._jobs.clear()
        self._requests.clear()
        self._waiting.clear()
        return jobs
