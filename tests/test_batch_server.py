"""``serve --runtime torch --parallel N``: the batching worker (:class:`~adaptivespec.server.batch_worker.BatchWorker`)
behind the real app and a real uvicorn on loopback.

A scripted batch engine stands in for the model where the output does not matter: the real
:class:`~adaptivespec.batch.Scheduler` decides joins, leaves and the FIFO order, every running
request gets one token per step (token i is the letter ``chr(97 + i)``, so an answer of 6 tokens
reads ``abcdef``), and the test opens and closes a gate the steps wait at, so what runs together,
what waits and what a cancellation catches are decided by the test, never by timing. Checked:
N requests decoded together all complete; FIFO beyond ``parallel`` and a 503 with Retry-After once
``queue_size`` wait; a dropped stream frees its slot at the next step and a cancelled waiting job
never runs; a stop string ends a job as completed; a step that raises fails its requests only;
a dead worker (no engine, or its thread raised) is Worker's dead worker; the batch series of
``/metrics``; ``--parallel 1`` keeps the one-at-a-time Worker; ``soak --runtime torch`` serves with
``--parallel`` and a queue its clients never fill. On the real model (float32,
``batched-hybrid.yaml``, strict): requests that join mid-generation each stream what the same prompt
gives decoded alone by greedy decoding, and ``/metrics`` shows the row budget's choices.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import math
import re
import threading
import time
import types

import pytest
from test_torch_server import CHAT, HYBRID, ScriptedEngine, drain, post, serve_args, uvicorn_on_loopback, wait_for

from adaptivespec.batch import CostTable, Request, Scheduler, Status
from adaptivespec.batch.engine import StepStats
from adaptivespec.server.app import Service, build_app
from adaptivespec.server.batch_worker import BatchWorker
from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.worker import Job, QueueFull, Worker

ROOT = HYBRID.parents[1]
GATE_S = 30.0
"""The longest a held step waits for the test (a failing test must not hang the suite)."""


# -- a scripted batch engine -------------------------------------------------------------------------
class ScriptedBatchEngine(ScriptedEngine):
    """:class:`~adaptivespec.batch.BatchEngine`'s surface for the worker and the app (the rest, the
    tokenizer, config and target sizes, is the scripted engine's of test_torch_server)."""

    def __init__(self, slots: int = 2, *, budget_rows: int | None = None) -> None:
        super().__init__()
        self.lanes = [types.SimpleNamespace(index=i) for i in range(slots)]
        self.scheduler = Scheduler(self.lanes, prefill_rows=64, prefill_chunk=0, max_rows=512)  # the real one
        self.last = StepStats()
        self.budget_rows = budget_rows
        self.joins: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = []
        """(prompt, the prompts running beside it) at each join, in order."""
        self.ran: collections.Counter = collections.Counter()  # prompt -> tokens generated
        self.most_running = 0
        self.explode: Exception | None = None  # the next step raises it (after its joins)
        self.refuse: Exception | None = None  # submit raises it: a bug outside any step
        self._gate = threading.Condition()
        self._allowed = math.inf
        self.held = 0  # steps waiting at the gate now

    # the test's hand on the steps
    def hold(self) -> None:
        with self._gate:
            self._allowed = 0

    def release(self, steps: int = 1) -> None:
        with self._gate:
            self._allowed += steps
            self._gate.notify_all()

    def open(self) -> None:
        with self._gate:
            self._allowed = math.inf
            self._gate.notify_all()

    def _pass_gate(self) -> None:
        with self._gate:
            self.held += 1
            self._gate.wait_for(lambda: self._allowed > 0, GATE_S)
            self.held -= 1
            self._allowed -= 1

    # the engine: the real scheduler's queues and plan; steps scripted
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def submit(self, r: Request) -> Request:
        if self.refuse is not None:
            raise self.refuse
        return self.scheduler.submit(r)

    def _admit(self, r: Request, lane) -> None:
        r.lane, r.status, r.started = lane, Status.DECODE, time.perf_counter()
        self.joins.append((tuple(r.prompt), tuple(tuple(o.prompt) for o in self.running if o is not r)))

    def step(self) -> list[Request]:
        ended: list[Request] = []
        self.scheduler.schedule(admit=self._admit, leave=lambda r: ended.append(self._finish(r, "cancelled")))
        if not self.running:
            return ended
        self.most_running = max(self.most_running, len(self.running))
        self._pass_gate()
        if self.explode is not None:
            exc, self.explode = self.explode, None
            raise exc
        n = len(self.running)
        for r in list(self.running):
            token = len(r.out)
            r.out.append(token)
            r.forwards += 1
            self.ran[tuple(r.prompt)] += 1
            if r.on_tokens is not None:
                r.on_tokens([token])
            if len(r.out) >= r.max_new_tokens:
                ended.append(self._finish(r, "length"))
        self.last = StepStats(requests=n, decoders=n, rows=n + (self.budget_rows or 0), draft_rows=self.budget_rows or 0,
                              budget_rows=self.budget_rows)
        return ended

    def abort(self, reason: str) -> list[Request]:  # as BatchEngine.abort: the running requests end with "error"
        ended = [self._finish(r, "error") for r in list(self.running)]
        for r in ended:
            r.error = reason
        return ended

    def _finish(self, r: Request, reason: str) -> Request:
        r.status, r.finish_reason, r.finished = Status.DONE, reason, time.perf_counter()
        self.scheduler.release(r)
        r.lane = None
        return r


def batch_service(slots: int = 2, queue_size: int = 4, **engine_kw) -> Service:
    engine = ScriptedBatchEngine(slots, **engine_kw)
    metrics = ServerMetrics()
    return Service(engine=engine, worker=BatchWorker(engine, queue_size, metrics), metrics=metrics, model="scripted")


@pytest.fixture
def served(request):
    """(service, port) of a scripted batch engine behind uvicorn; ``@pytest.mark.parametrize("served",
    [dict(slots=..., queue_size=...)], indirect=True)`` sizes it (default 2 slots, 4 may wait)."""
    service = batch_service(**getattr(request, "param", {}))
    with uvicorn_on_loopback(build_app(service)) as port:
        try:
            yield service, port
        finally:
            service.engine.open()  # a held step must not keep the worker from stopping


class Asker:
    """Requests sent from threads; ``answers[name]`` = (status, headers, body) once answered."""

    def __init__(self, port: int) -> None:
        self.port, self.answers, self.threads = port, {}, []

    def ask(self, name: str, body: dict, path: str = "/v1/chat/completions") -> None:
        def run() -> None:
            if body.get("stream"):
                self.answers[name] = stream(self.port, body, path)
            else:
                self.answers[name] = post(self.port, path, body)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def join(self) -> dict:
        for t in self.threads:
            t.join(GATE_S)
        assert not any(t.is_alive() for t in self.threads), "a request was never answered"
        return self.answers


def stream(port: int, body: dict, path: str = "/v1/chat/completions") -> tuple[int, str, list[dict]]:
    """A streamed request read to its end: (status, the text, the JSON chunks)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GATE_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        lines = [ln.decode().strip() for ln in resp if ln.strip()]
    finally:
        conn.close()
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    text = "".join((c.get("choices") or [{}])[0].get("delta", {}).get("content") or
                   (c.get("choices") or [{}])[0].get("text") or "" for c in chunks)
    assert lines[-1] == "data: [DONE]", lines
    return resp.status, text, chunks


def content(answer) -> str:
    status, _, body = answer
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def metric(service: Service, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", service.metrics.render().decode(), re.M)
    assert m, name
    return float(m.group(1))


def outcomes(service: Service) -> dict[str, float]:
    return {k: metric(service, f'adaptivespec_server_requests_total{{outcome="{k}"}}')
            for k in ("completed", "cancelled", "rejected", "bad", "failed")}


def chat_body(prompt: str, max_tokens: int = 6, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}


def running_job(service: Service, prompt: tuple[int, ...]) -> Job:
    """The worker's job for ``prompt`` (the scripted tokenizer: letter i is id i)."""
    assert wait_for(lambda: any(tuple(j.prompt_ids) == prompt for j in list(service.worker._jobs.values())))
    return next(j for j in list(service.worker._jobs.values()) if tuple(j.prompt_ids) == prompt)


def ids(text: str) -> tuple[int, ...]:
    return tuple(ord(c) % 26 for c in text)


# -- decoded together, FIFO beyond, 503 at the queue's size -------------------------------------------------
@pytest.mark.parametrize("served", [dict(slots=3)], indirect=True)
def test_parallel_requests_decode_together_and_all_complete(served):
    service, port = served
    engine = service.engine
    engine.hold()
    asker = Asker(port)
    asker.ask("a", chat_body("a"))
    assert wait_for(lambda: engine.held == 1)  # a joined alone; b and c arrive while its step is held
    asker.ask("b", chat_body("b", stream=True))
    assert wait_for(lambda: len(service.worker._waiting) == 1)  # b first (two client threads would race)
    asker.ask("c", chat_body("c"))
    assert wait_for(lambda: len(service.worker._waiting) == 2)  # in the worker's hands, not yet the engine's
    engine.open()
    answers = asker.join()
    assert content(answers["a"]) == content(answers["c"]) == "abcdef"
    status, text, chunks = answers["b"]
    assert status == 200 and text == "abcdef" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.most_running == 3  # b and c joined at a's second step: three in one step
    assert [p for p, _ in engine.joins] == [ids("a"), ids("b"), ids("c")]
    assert outcomes(service)["completed"] == 3 and not service.worker.busy and service.worker.depth == 0


@pytest.mark.parametrize("served", [dict(slots=2, queue_size=2)], indirect=True)
def test_fifo_beyond_parallel_and_a_503_with_retry_after_once_the_queue_is_full(served):
    service, port = served
    engine, worker = service.engine, service.worker
    engine.hold()
    loop = types.SimpleNamespace(call_soon_threadsafe=lambda *a: None)
    jobs = [Job(prompt_ids=[k], max_tokens=2 + 2 * k, loop=loop) for k in range(4)]
    worker.submit(jobs[0])
    assert wait_for(lambda: engine.held == 1)  # 0 holds a slot; its step waits
    for job in jobs[1:]:
        worker.submit(job)  # 1 takes the second slot at the next step; 2 and 3 wait
    assert worker.depth == 2
    with pytest.raises(QueueFull) as full:
        worker.submit(Job(prompt_ids=[9], max_tokens=2, loop=loop))
    assert full.value.retry_after >= 1
    status, headers, body = post(port, "/v1/chat/completions", CHAT)
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert body["error"]["message"].startswith("server busy: 2 requests decode together (--parallel 2) and 2 more may "
                                               "wait (--queue-size 2); all are taken, retry after ")
    engine.open()
    assert wait_for(lambda: not worker.busy and worker.depth == 0)
    # first come, first served: 2 takes the slot 0 leaves, 3 the slot 1 leaves
    assert engine.joins == [((0,), ()), ((1,), ((0,),)), ((2,), ((1,),)), ((3,), ((2,),))]
    assert engine.most_running == 2
    assert dict(engine.ran) == {(k,): 2 + 2 * k for k in range(4)}
    assert content(post(port, "/v1/chat/completions", CHAT)) == "abcdef"  # serving goes on
    assert outcomes(service)["rejected"] == 1 and outcomes(service)["completed"] == 5


def test_the_busy_message_of_one_generation_at_a_time():
    from adaptivespec.server.app import _running

    assert _running(Worker(ScriptedEngine(), 1)) == "one generation runs at a time (--parallel 1)"
    assert _running(BatchWorker(ScriptedBatchEngine(4), 1)) == "4 requests decode together (--parallel 4)"


# -- cancellation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("served", [dict(slots=1, queue_size=2)], indirect=True)
def test_a_dropped_stream_frees_its_slot_at_the_next_step(served):
    service, port = served
    engine = service.engine
    engine.hold()
    engine.release(2)  # the stream gets two tokens, then its third step waits
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GATE_S)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat_body("x", 60, stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    job = running_job(service, ids("x"))
    asker = Asker(port)
    asker.ask("next", chat_body("y"))  # waits for the only slot
    assert wait_for(lambda: service.worker.depth == 1 and engine.held == 1)
    conn.sock.close()
    conn.close()
    for _ in range(10):  # the app notices when it cannot send the next chunk: one step at a time until then
        if job.cancelled.is_set():
            break
        before = engine.ran[ids("x")]
        engine.release(1)
        wait_for(lambda: job.cancelled.is_set() or (engine.ran[ids("x")] > before and engine.held == 1))
    assert wait_for(job.cancelled.is_set)
    ran = engine.ran[ids("x")]
    engine.open()
    assert content(asker.join()["next"]) == "abcdef"
    assert engine.ran[ids("x")] <= ran + 1  # at most the step already under way, then it left
    assert [p for p, _ in engine.joins] == [ids("x"), ids("y")] and engine.joins[1][1] == ()  # y got x's slot
    assert wait_for(lambda: outcomes(service)["cancelled"] == 1)
    assert outcomes(service)["completed"] == 1


def test_a_cancelled_waiting_job_never_runs():
    """Cancelled while the worker has not handed it over yet, or while the engine holds it waiting
    for a slot: it ends ``cancelled`` without a token, and the running one is untouched."""
    engine = ScriptedBatchEngine(1)
    metrics = ServerMetrics()
    worker = BatchWorker(engine, 4, metrics).start()
    loop = asyncio.new_event_loop()
    try:
        engine.hold()
        running = Job(prompt_ids=[0], max_tokens=4, loop=loop)
        worker.submit(running)
        assert wait_for(lambda: engine.held == 1)
        in_engine, in_queue = Job(prompt_ids=[1], max_tokens=4, loop=loop), Job(prompt_ids=[2], max_tokens=4, loop=loop)
        worker.submit(in_engine)
        engine.release(1)  # the worker hands in_engine to the engine, whose next step waits again
        assert wait_for(lambda: len(engine.waiting) == 1 and engine.held == 1)
        worker.submit(in_queue)  # still in the worker's queue
        in_engine.cancel()
        in_queue.cancel()
        engine.open()
        kinds = [loop.run_until_complete(asyncio.wait_for(drain(j), GATE_S)) for j in (running, in_engine, in_queue)]
        assert kinds == ["done", "cancelled", "cancelled"]
        assert [p for p, _ in engine.joins] == [(0,)] and dict(engine.ran) == {(0,): 4}
        assert not engine.busy and sorted(lane.index for lane in engine.scheduler.free) == [lane.index for lane in engine.lanes]
        render = metrics.render().decode()
        assert 'outcome="cancelled"} 2.0' in render and 'outcome="completed"} 1.0' in render
        assert "adaptivespec_server_queue_depth 0.0" in render
    finally:
        engine.open()
        worker.stop()
        loop.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_stop_string_ends_the_job_as_completed_with_finish_reason_stop(streamed):
    service = batch_service(slots=2)
    engine = service.engine
    with uvicorn_on_loopback(build_app(service)) as port:
        try:
            engine.hold()
            engine.release(4)  # "abcd": the stop string "cd" is complete after the fourth token
            asker = Asker(port)
            asker.ask("stopped", chat_body("s", 50, stop=["cd"], stream=streamed))
            job = running_job(service, ids("s"))  # it joins first: the four steps are its first four
            asker.ask("beside", chat_body("t", 8))
            assert wait_for(lambda: job.stopped)
            engine.open()
            answers = asker.join()
        finally:
            engine.open()
    if streamed:
        status, text, chunks = answers["stopped"]
        reason, usage = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["usage"]
    else:
        status, _, body = answers["stopped"]
        text, reason, usage = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"], body["usage"]
    assert status == 200 and text == "ab" and reason == "stop" and usage["completion_tokens"] == 4
    assert engine.ran[ids("s")] <= 5  # ended at the next step, not at 50
    assert content(answers["beside"]) == "abcdefgh"
    assert outcomes(service)["completed"] == 2 and outcomes(service)["cancelled"] == 0


# -- failures -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("served", [dict(slots=2)], indirect=True)
def test_a_step_that_raises_fails_its_requests_with_a_500_and_serving_goes_on(served):
    service, port = served
    engine = service.engine
    engine.hold()
    asker = Asker(port)
    asker.ask("plain", chat_body("p", 20))
    assert wait_for(lambda: engine.held == 1)
    asker.ask("streamed", chat_body("q", 20, stream=True))
    assert wait_for(lambda: len(service.worker._waiting) == 1)
    engine.release(1)  # q joins at the next step, which waits
    assert wait_for(lambda: len(engine.running) == 2 and engine.held == 1)
    engine.explode = RuntimeError("kernel exploded")
    engine.open()
    answers = asker.join()
    status, _, body = answers["plain"]
    assert status == 500 and body["error"]["message"] == "generation failed: RuntimeError: kernel exploded"
    status, _, chunks = answers["streamed"]
    assert status == 200 and chunks[-1]["error"]["code"] == 500 and "kernel exploded" in chunks[-1]["error"]["message"]
    assert service.worker.failure is None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    assert content(post(port, "/v1/chat/completions", CHAT)) == "abcdef"  # the lanes are free again
    assert outcomes(service)["failed"] == 2 and outcomes(service)["completed"] == 1


def test_a_batch_engine_that_cannot_be_built_is_a_dead_worker():
    from adaptivespec.errors import AdaptiveSpecError

    def broken():
        raise AdaptiveSpecError("batch.max_rows: nope")

    worker = BatchWorker(None, 2, build=broken).start()
    with pytest.raises(AdaptiveSpecError, match="batch.max_rows: nope"):
        worker.wait_ready()
    assert worker.failure == "the engine could not be built: AdaptiveSpecError: batch.max_rows: nope"
    loop = asyncio.new_event_loop()
    try:
        job = Job(prompt_ids=[1], max_tokens=2, loop=loop)
        worker.submit(job)  # answered at once, never queued
        assert loop.run_until_complete(asyncio.wait_for(job.events.get(), 5)) == ("error", worker.failure)
    finally:
        loop.close()
    assert worker.depth == 0 and worker.parallel == 1


@pytest.mark.parametrize("served", [dict(slots=1, queue_size=4)], indirect=True)
def test_a_dying_worker_thread_fails_every_request_it_held_and_health_says_503(served):
    """A bug outside any step (here the engine's submit raises) ends the thread: the running request,
    the one being handed over and the one behind it in the same hand-over all get a 503 naming it."""
    service, port = served
    engine = service.engine
    engine.hold()
    asker = Asker(port)
    asker.ask("running", chat_body("r", 20))
    assert wait_for(lambda: engine.held == 1)
    asker.ask("queued1", chat_body("s"))
    asker.ask("queued2", chat_body("t", stream=True))
    assert wait_for(lambda: service.worker.depth == 2)
    engine.refuse = RuntimeError("submit exploded")
    engine.open()
    answers = asker.join()
    reason = "the generation worker failed: RuntimeError: submit exploded"
    for name in ("running", "queued1"):
        status, _, body = answers[name]
        assert status == 503 and body["error"]["message"] == reason, answers
    status, _, chunks = answers["queued2"]
    assert chunks[-1]["error"]["code"] == 503 and chunks[-1]["error"]["message"] == reason
    assert service.worker.failure == reason
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    health = json.loads(resp.read())
    conn.close()
    assert resp.status == 503 and health["status"] == "failed" and health["error"] == reason
    status, _, body = post(port, "/v1/chat/completions", CHAT)  # at once, no hang
    assert status == 503 and body["error"]["message"] == f"server unavailable: {reason}; restart it"
    assert outcomes(service)["failed"] == 4


# -- /metrics -----------------------------------------------------------------------------------------------
def test_metrics_show_the_batch_series():
    service = batch_service(slots=2, budget_rows=5)
    with uvicorn_on_loopback(build_app(service)) as port:
        asker = Asker(port)
        for name, n in (("a", 4), ("b", 6)):
            asker.ask(name, chat_body(name, n))
        asker.join()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    p = "adaptivespec_server"
    for series in (f"{p}_batch_size ", f"{p}_batch_requests_count ", f"{p}_step_rows_count ", f"{p}_budget_rows_count ",
                   f"{p}_request_accept_length_count 2.0"):
        assert series in text, series
    assert metric(service, f"{p}_budget_rows_sum") == 5 * metric(service, f"{p}_budget_rows_count")
    assert metric(service, f"{p}_request_accept_length_sum") == 2.0  # one token per forward, both requests


# -- serve --parallel -------------------------------------------------------------------------------------
class FakeUvicorn:
    """``uvicorn.Server`` that returns at once (closing the listening socket)."""

    def __init__(self, config) -> None:
        self.config = config

    def run(self, sockets=()) -> None:
        for s in sockets:
            s.close()


@pytest.mark.parametrize("argv, kind, how", [
    (["--parallel", "1"], Worker, "one generation at a time, 16 may wait"),
    ([], BatchWorker, "8 decoded together, KV reserved 3 MiB (8 x 64 positions), 16 may wait"),
    (["--parallel", "3", "--queue-size", "5"], BatchWorker, "3 decoded together, KV reserved 3 MiB (3 x 64 positions), 5 may wait"),
])
def test_serve_parallel_1_keeps_the_one_at_a_time_worker(argv, kind, how, monkeypatch, capsys):
    import uvicorn

    import adaptivespec.batch
    import adaptivespec.decode
    import adaptivespec.server.app as app_mod
    from adaptivespec.server import launch

    built: dict = {}

    class Single(ScriptedEngine):
        def __init__(self, config, structured=False) -> None:
            super().__init__()
            built["engine"] = "Engine"

        def reserve(self, positions) -> None:
            pass

    class Batch(ScriptedBatchEngine):
        def __init__(self, config, slots, measure=False, log=print) -> None:  # BatchEngine's signature
            super().__init__(slots)
            built["engine"] = f"BatchEngine({slots})"

        def reserve(self, positions) -> None:
            pass

    services = []
    real_build_app = app_mod.build_app
    monkeypatch.setattr(adaptivespec.decode, "Engine", Single)
    monkeypatch.setattr(adaptivespec.batch, "BatchEngine", Batch)
    monkeypatch.setattr(uvicorn, "Server", FakeUvicorn)
    monkeypatch.setattr(app_mod, "build_app", lambda service, **kw: services.append(service) or real_build_app(service, **kw))
    monkeypatch.setattr(launch, "served_context", lambda engine, asked: 64)
    monkeypatch.setattr(launch, "warm_up", lambda engine, context: None)
    monkeypatch.setattr(launch, "warm_up_batch", lambda engine, context: None)
    monkeypatch.setattr(launch, "reserved_bytes", lambda engine: 3 * 2**20)
    monkeypatch.delenv("ADAPTIVESPEC_API_KEY", raising=False)
    args = serve_args("--runtime", "torch", "--port", "0", *argv)
    assert launch.run_torch(args, "adaptivespec serve: runtime torch") == 0
    worker = services[0].worker
    try:
        assert type(worker) is kind
        assert built["engine"] == ("Engine" if kind is Worker else f"BatchEngine({worker.parallel})")
        ready = capsys.readouterr().err.strip().splitlines()[-1]
        assert ready == f"adaptivespec serve: ready: hybrid (static+strict), {how}"
    finally:
        worker.stop()


# -- the real model, float32 ------------------------------------------------------------------------------
N = 24
TEXTS = ["What is the capital of France? Answer in one sentence.",
         "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
         "Write a haiku about the sea.",
         "Explain in two sentences why the sky is blue, for a child of six who asks a lot of questions."]
SLOTS = 3


def linear_costs(ms_per_row: float, fixed: float = 20.0, draft: float = 0.5) -> CostTable:
    """A synthetic cost table (no calibration in tests): verify(r) = fixed + ms_per_row * (r - 1)."""
    top = fixed + ms_per_row * 511
    return CostTable(rows=(1, 512), verify_short=(fixed, top), verify_long=(fixed, top), contexts=(128, 1024),
                     per_request=0.1, draft_rows=(1, 128), draft=(draft, draft), machine={"cpu": "synthetic"})


@pytest.fixture(scope="module")
def batched32():
    """``batched-hybrid.yaml`` in float32 (row budget: goodput over synthetic costs), SLOTS lanes, served
    by the batching worker behind uvicorn; yields (service, port)."""
    from adaptivespec.batch import BatchEngine
    from adaptivespec.config import load_config

    config = load_config(ROOT / "configs" / "batched-hybrid.yaml", ["runtime.dtype=float32"])
    engine = BatchEngine(config, SLOTS, costs=linear_costs(0.5), log=lambda _: None)
    metrics = ServerMetrics(("retrieval", "head"))
    service = Service(engine=engine, worker=BatchWorker(engine, 4, metrics), metrics=metrics, model="batched-hybrid")
    with uvicorn_on_loopback(build_app(service)) as port:
        yield service, port


@pytest.mark.model
def test_requests_joining_mid_generation_each_stream_what_they_decode_alone(batched32, greedy_reference, monkeypatch):
    """Four requests on three lanes: the first starts alone, two join at its second step, the fourth
    waits for a lane and joins as the first leaves; each one's streamed text is transformers' greedy
    output for its prompt (strict verifier, float32), and /metrics shows the batch."""
    service, port = batched32
    engine = service.engine
    gate, step = threading.Event(), engine.step

    def held_step():
        assert gate.wait(GATE_S)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    refs = [greedy_reference(text, N) for text in TEXTS]
    asker = Asker(port)
    asker.ask(0, chat_body(TEXTS[0], N, temperature=0, stream=True))
    assert wait_for(lambda: service.worker.busy)
    for k in (1, 2, 3):
        asker.ask(k, chat_body(TEXTS[k], N, temperature=0, stream=k != 2))
    assert wait_for(lambda: len(service.worker._waiting) == 3)  # they arrive while the first step is held
    gate.set()
    answers = asker.join()
    tok = engine.tokenizer
    for k, (prompt_ids, ref) in enumerate(refs):
        if k == 2:
            status, _, body = answers[k]
            text, usage, reason = body["choices"][0]["message"]["content"], body["usage"], body["choices"][0]["finish_reason"]
        else:
            status, text, chunks = answers[k]
            usage, reason = chunks[-1]["usage"], chunks[-1]["choices"][0]["finish_reason"]
        assert status == 200, answers[k]
        assert text == tok.decode(ref, skip_special_tokens=True), TEXTS[k]
        assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == len(ref), TEXTS[k]
        assert reason == ("stop" if ref[-1] == tok.eos_token_id else "length"), TEXTS[k]
    p = "adaptivespec_server"
    assert metric(service, f"{p}_batch_requests_count") > metric(service, f'{p}_batch_requests_bucket{{le="2.0"}}')
    assert metric(service, f"{p}_budget_rows_count") > 0 and metric(service, f"{p}_step_rows_count") > 0
    assert metric(service, f"{p}_request_accept_length_count") == 4
    assert metric(service, f"{p}_request_accept_length_sum") > 4.0  # drafts were accepted in the batch
    assert outcomes(service)["completed"] == 4


@pytest.mark.model
def test_a_prompt_sent_again_reads_only_its_last_token_and_says_so_in_usage(batched32, greedy_reference):
    """The same chat request twice: the second takes all but the prompt's last token from the prefix
    cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``, the server's cached-tokens counter)
    and answers the same greedy text."""
    service, port = batched32
    ids, ref = greedy_reference(TEXTS[1], N)
    before = metric(service, "adaptivespec_server_cached_tokens_total")
    answers = []
    for _ in range(2):
        status, _, body = post(port, "/v1/chat/completions", chat_body(TEXTS[1], N, temperature=0))
        assert status == 200, body
        answers.append(body)
    tok = service.engine.tokenizer
    assert [b["choices"][0]["message"]["content"] for b in answers] == [tok.decode(ref, skip_special_tokens=True)] * 2
    assert answers[1]["usage"]["prompt_tokens"] == len(ids)
    assert answers[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": len(ids) - 1}
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in answers)
    assert metric(service, "adaptivespec_server_cached_tokens_total") - before == cached


# -- the soak serves with --parallel ------------------------------------------------------------------------
class StartRefused(Exception):
    pass


@pytest.mark.parametrize("argv, served", [
    (["--concurrency", "16"], ["--parallel", "16", "--queue-size", "16"]),
    (["--concurrency", "40"], ["--parallel", "16", "--queue-size", "40"]),  # capped; every client beyond a slot may wait
    (["--concurrency", "4", "--parallel", "1"], ["--parallel", "1", "--queue-size", "16"]),
])
def test_the_soak_serves_with_parallel_and_a_queue_its_clients_never_fill(argv, served, monkeypatch, tmp_path, capsys):
    from adaptivespec.cli import main
    from adaptivespec.evaluation import soak_cli

    started = []

    class Server:  # the soak's server, refused at its start (nothing is served)
        def __init__(self, argv, env, log, timeout):
            started.append(argv)

        def __enter__(self):
            raise StartRefused

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(soak_cli, "SGLangServer", Server)
    monkeypatch.setattr(soak_cli, "_inputs", lambda: ([], []))
    with pytest.raises(StartRefused):
        main(["soak", "--config", str(HYBRID), "--runtime", "torch", "--out", str(tmp_path), *argv])
    (command,) = started
    assert command[command.index("--parallel"):] == served
    assert "(torch runtime, " + ", ".join(f"{served[i]} {served[i + 1]}" for i in (0, 2)) + ")" in capsys.readouterr().out


def test_the_soak_refuses_parallel_with_sglang_and_takes_an_rss_limit(capsys, tmp_path):
    from adaptivespec.cli import main
    from adaptivespec.evaluation.soak import Outcome
    from adaptivespec.evaluation.soak_report import SoakReport

    assert main(["soak", "--config", str(HYBRID), "--parallel", "4", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("adaptivespec: error: --parallel: only with --runtime torch (SGLang batches "
                                               "on its own)")
    report = SoakReport(config="x.yaml", requests=10, concurrency=2, seconds=1.0, answered_after=True, metrics={},
                        outcomes=(Outcome(index=0, kind="chat", status=503, ok=False, seconds=0.1),),
                        rss_series=((0.0, 0, 1000.0), (1.0, 1, 1000.0), (2.0, 10, 1060.0)), rss_limit=0.05)
    assert report.counts["http_503"] == report.counts["http_5xx"] == 1
    assert "resident memory grew 6.0% (limit 5%)" in report.failures() and "http_5xx: 1" in report.failures()


def test_a_step_hands_its_events_to_the_event_loop_in_one_call_in_order():
    """Inside ``Outbox`` (one batch step) every job's events are held, then given to each event loop
    in one ``call_soon_threadsafe``, in the order posted; outside it a post goes at once."""
    from adaptivespec.server.worker import Outbox

    calls = []
    loop = types.SimpleNamespace(call_soon_threadsafe=lambda fn, *a: calls.append((fn, a)))
    a, b = (Job(prompt_ids=[1], max_tokens=2, loop=loop) for _ in range(2))
    with Outbox():
        a.post("tokens", [1])
        b.post("tokens", [2])
        a.post("done", "x")
        assert calls == []
    assert len(calls) == 1
    fn, args = calls[0]
    fn(*args)  # what the loop runs
    assert [a.events.get_nowait(), b.events.get_nowait(), a.events.get_nowait()] == [("tokens", [1]), ("tokens", [2]),
                                                                                   ("done", "x")]
    b.post("done", "y")
    assert len(calls) == 2
