"""``adaptivespec serve --runtime torch``: requests checked into one-line 4xx errors, the queue and
cancellation (a scripted engine behind a real uvicorn on loopback), the runtime choice and its CLI
errors; and, on the real model in float32, served greedy output equal to ``adaptivespec generate``,
seeded sampling that reproduces, structured output, and a server that keeps serving after bad input."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import threading
import time
import types
from pathlib import Path

import pytest

from adaptivespec import serve as front_door
from adaptivespec.config import load_config
from adaptivespec.decode import GenerationResult
from adaptivespec.server import launch
from adaptivespec.server.app import Service, build_app
from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.output import TextAssembler
from adaptivespec.server.schema import RequestError, parse_json, parse_request
from adaptivespec.server.worker import Job, QueueFull, Worker
from shared_prompts import PROMPTS

ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "configs" / "hybrid.yaml"


# -- a scripted engine: one token per step, held at a gate -----------------------------------------
class CharTokenizer:
    """Token i is the letter chr(97 + i % 26); a chat is its messages' contents."""

    chat_template = "plain"
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 26 for c in text]}

    def apply_chat_template(self, messages, **kw):
        return [ord(c) % 26 for m in messages for c in m["content"]]


class NoSampling:
    supports_sampling = False


class ScriptedEngine:
    def __init__(self, verifier=None) -> None:
        self.config = load_config(HYBRID)
        self.tokenizer = CharTokenizer()
        self.target = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64, vocab_size=26))
        self.runtime = types.SimpleNamespace(device="cpu", sampler=None)
        self.verifier = verifier or types.SimpleNamespace(sampler=None)
        self.sampler, self.lossless, self.eos, self.constraint = None, True, None, None
        self.gate = threading.Event()  # steps past free_steps wait for it
        self.gate.set()
        self.free_steps = 0
        self.steps: list[int] = []  # tokens generated per generation

    def generate_ids(self, prompt_ids, *, max_new_tokens, on_tokens, on_step, seed, response_format, sampling=None):
        out: list[int] = []
        self.steps.append(0)
        for i in range(max_new_tokens):
            assert i < self.free_steps or self.gate.wait(10)
            out.append(i)
            self.steps[-1] += 1
            on_tokens([i])
        stats = {"new_tokens": len(out), "target_forwards": len(out), "accept_length_mean": 1.0, "wall_seconds": 0.01,
                 "promoted_tokens": 0}
        return GenerationResult(token_ids=out, text=self.tokenizer.decode(out), stats=stats)


@contextlib.contextmanager
def uvicorn_on_loopback(app):
    """``app`` served by a real uvicorn in a thread on a free loopback port; yields the port."""
    import uvicorn

    from adaptivespec.sglang.server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def post(port: int, path: str, body, timeout: float = 30.0) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body if isinstance(body, (str, bytes)) else json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def wait_for(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def scripted():
    engine = ScriptedEngine()
    metrics = ServerMetrics()
    service = Service(engine=engine, worker=Worker(engine, 1, metrics), metrics=metrics, model="scripted")
    with uvicorn_on_loopback(build_app(service)) as port:
        yield engine, service, port
    engine.gate.set()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


# -- requests: one-line 4xx errors naming the field ------------------------------------------------
@pytest.mark.parametrize("body, field, words", [
    ({"messages": []}, "messages", "non-empty list"),
    ({}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "'wizard'"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", "got -5"),
    ({**CHAT, "temperature": -1}, "temperature", "0 or a number in [1e-06, 100]"),
    ({**CHAT, "top_p": 0}, "top_p", "(0, 1]"),
    ({**CHAT, "seed": "x"}, "seed", "non-negative integer"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**CHAT, "max_token": 3}, "max_token", "unknown field"),
    ({**CHAT, "n": 17}, "n", "an integer in [1, 16]"),
    ({**CHAT, "echo": True}, "echo", "only False"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": "/etc/passwd"}}},
     "response_format.json_schema.schema", "a JSON schema object"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}},
     "response_format.json_schema", "cannot compile"),
])
def test_bad_requests_name_the_field_value_and_expectation(body, field, words):
    config = load_config(HYBRID)
    with pytest.raises(RequestError) as err:
        parse_request(body, chat=True, defaults=config.generation, vocab_size=100, strict=True)  # max_token: refused
    assert err.value.status == 400 and err.value.param == field
    assert err.value.message.startswith(field) and words in err.value.message and "\n" not in err.value.message


def test_malformed_json_and_completions_prompts():
    with pytest.raises(RequestError, match=r"^request body: expected a JSON object, got invalid JSON \(Expecting"):
        parse_json(b"{nope")
    g = load_config(HYBRID).generation
    assert parse_request({"prompt": [1, 2, 3]}, chat=False, defaults=g, vocab_size=10).prompt == (1, 2, 3)
    with pytest.raises(RequestError, match=r"^prompt: expected token ids in \[0, 10\), got 12$"):
        parse_request({"prompt": [1, 12]}, chat=False, defaults=g, vocab_size=10)
    req = parse_request({"prompt": "x", "temperature": 0.5, "top_k": -1, "seed": 3}, chat=False, defaults=g, vocab_size=10)
    assert req.sampling.temperature == 0.5 and req.sampling.top_k is None and req.sampling.seed == 3
    assert parse_request({"prompt": "x"}, chat=False, defaults=g, vocab_size=10).sampling is None  # the config's greedy


def test_stop_strings_end_the_text_and_are_never_streamed_in_part():
    text = TextAssembler(CharTokenizer(), ("cde",))
    assert text.add([0, 1]) == "ab"
    assert text.add([2]) == ""  # "c" could start the stop string: held back
    assert text.add([3]) == ""
    assert text.add([4, 5]) == "" and text.stopped and text.text == "ab" and text.stop_tokens == 6
    text = TextAssembler(CharTokenizer(), ("cx",))
    assert text.add([0, 2]) == "a" and text.add([3]) == "cd" and not text.stopped and text.finish([0, 2, 3]) == ""


# -- queue, 503, cancellation, keeps serving -------------------------------------------------------
def test_full_queue_gets_a_503_with_retry_after_and_the_server_keeps_serving(scripted):
    engine, service, port = scripted
    engine.gate.clear()
    loop = types.SimpleNamespace(call_soon_threadsafe=lambda *a: None)
    held = [Job(prompt_ids=[1], max_tokens=2, loop=loop) for _ in range(2)]
    service.worker.submit(held[0])
    assert wait_for(lambda: service.worker.busy)
    service.worker.submit(held[1])  # the queue (size 1) is full now
    with pytest.raises(QueueFull):
        service.worker.submit(Job(prompt_ids=[1], max_tokens=2, loop=loop))
    status, headers, body = post(port, "/v1/chat/completions", CHAT)
    assert status == 503 and int(headers["retry-after"]) >= 1 and "--queue-size" in body["error"]["message"]
    engine.gate.set()
    status, _, body = post(port, "/v1/chat/completions", CHAT)
    assert status == 200 and body["choices"][0]["message"]["content"] == "abcdef"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert body["choices"][0]["finish_reason"] == "length" and body["speculation"]["lossless"] is True
    metrics = service.metrics.render().decode()
    assert 'adaptivespec_server_requests_total{outcome="rejected"} 1.0' in metrics
    assert "adaptivespec_server_queue_seconds_count" in metrics


def test_a_dropped_stream_cancels_its_generation_at_the_next_step(scripted):
    engine, service, port = scripted
    engine.free_steps = 2
    engine.gate.clear()  # two steps, then the generation waits while the client goes away
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 60, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    time.sleep(0.3)
    engine.gate.set()
    assert wait_for(lambda: 'outcome="cancelled"} 1.0' in service.metrics.render().decode())
    assert engine.steps[-1] < 60
    status, _, body = post(port, "/v1/chat/completions", CHAT)  # serving goes on
    assert status == 200 and body["choices"][0]["message"]["content"] == "abcdef"


def test_a_stream_ends_with_usage_and_done(scripted):
    _, _, port = scripted
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True, "stop": "cd"}),
                 {"Content-Type": "application/json"})
    lines = [ln.decode().strip() for ln in conn.getresponse() if ln.strip()]
    conn.close()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 4


def test_sampling_on_a_verifier_without_a_sampling_form_is_a_400():
    engine = ScriptedEngine(verifier=NoSampling())
    service = Service(engine=engine, worker=Worker(engine, 1), metrics=ServerMetrics(), model="x")
    with pytest.raises(RequestError, match=r"^temperature: expected 0 with verifier 'strict' \(it has no sampling form\), got 0.7$"):
        service.prepare(json.dumps({**CHAT, "temperature": 0.7}).encode(), True)
    with pytest.raises(RequestError, match=r"^max_tokens: expected at most 62 \(the context length 64 less the prompt's 2 tokens\), got 63$"):
        service.prepare(json.dumps({**CHAT, "max_tokens": 63}).encode(), True)
    with pytest.raises(RequestError, match=r"^messages: the prompt is 70 tokens; .*context length of 64 tokens$"):
        service.prepare(json.dumps({"messages": [{"role": "user", "content": "x" * 70}]}).encode(), True)


def test_a_served_context_length_bounds_requests_and_may_not_exceed_the_models():
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.server.launch import served_context

    engine = ScriptedEngine()  # the model's context: 64
    service = Service(engine=engine, worker=Worker(engine, 1), metrics=ServerMetrics(), model="x", context_length=20)
    assert service.context == 20
    with pytest.raises(RequestError, match=r"^max_tokens: expected at most 18 \(the context length 20 less the prompt's 2 tokens\), got 19$"):
        service.prepare(json.dumps({**CHAT, "max_tokens": 19}).encode(), True)
    with pytest.raises(RequestError, match=r"^messages: the prompt is 30 tokens; expected fewer than the served context length of 20 tokens$"):
        service.prepare(json.dumps({"messages": [{"role": "user", "content": "x" * 30}]}).encode(), True)
    assert served_context(engine, None) == 64 and served_context(engine, 32) == 32
    with pytest.raises(AdaptiveSpecError, match=r"^--context-length: expected at most 64 \(the model's context length\), got 65$"):
        served_context(engine, 65)


def test_the_worker_trims_the_heap_after_each_generation_unless_told_not_to(monkeypatch):
    from adaptivespec.server import worker as worker_mod

    if worker_mod._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim here")
    calls = []
    monkeypatch.setattr(worker_mod, "_malloc_trim", lambda: lambda pad: calls.append(pad))
    for trim, expected in ((True, [0, 0]), (False, [])):
        calls.clear()
        engine, metrics = ScriptedEngine(), ServerMetrics()
        w = Worker(engine, 2, metrics, trim=trim).start()
        loop = asyncio.new_event_loop()
        try:
            for _ in range(2):
                job = Job(prompt_ids=[1, 2], max_tokens=3, loop=loop)
                w.submit(job)
                assert loop.run_until_complete(asyncio.wait_for(drain(job), 10)) == "done"
            counted = 'adaptivespec_server_trim_seconds_count %.1f' % len(expected)
            assert wait_for(lambda: len(calls) == len(expected) and counted in metrics.render().decode())
            assert calls == expected
        finally:
            w.stop()
            loop.close()


async def drain(job) -> str:
    """The kind of ``job``'s last event."""
    while True:
        kind, _ = await job.events.get()
        if kind != "tokens":
            return kind


# -- the runtime choice -----------------------------------------------------------------------------
def serve_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser(prog="adaptivespec")
    front_door.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "--config", str(HYBRID), *argv])


def test_auto_picks_sglang_where_it_can_serve_else_torch_and_says_why(monkeypatch):
    monkeypatch.setattr(front_door, "sglang_reason", lambda: "sglang is not installed; install it with x.")
    assert front_door.choose_runtime(serve_args()) == ("torch", "sglang is not installed; install it with x")
    assert front_door.choose_runtime(serve_args("--print-command")) == ("sglang", "--print-command is SGLang's")
    monkeypatch.setattr(front_door, "sglang_reason", lambda: None)
    assert front_door.choose_runtime(serve_args()) == ("sglang", "sglang can serve here")
    assert front_door.choose_runtime(serve_args("--queue-size", "4"))[0] == "torch"
    assert front_door.choose_runtime(serve_args("--parallel", "4")) == ("torch", "--parallel is the torch runtime's")
    assert front_door.first_line("torch", "--runtime torch", "127.0.0.1", 30000) == \
        "adaptivespec serve: runtime torch (--runtime torch) on http://127.0.0.1:30000"


def test_auto_serves_on_torch_what_sglang_cannot_serve(monkeypatch):
    monkeypatch.setattr(front_door, "sglang_reason", lambda: None)  # SGLang could serve here
    args = serve_args()
    args.config = str(HYBRID.parent / "grammar.yaml")  # sources without a draft head
    assert front_door.choose_runtime(args) == ("torch", "SGLang's worker needs a draft head for this config's sources")
    args.runtime = "sglang"  # asked for explicitly: serve refuses it as before
    assert front_door.choose_runtime(args) == ("sglang", "--runtime sglang")


@pytest.mark.parametrize("argv, message", [
    (["--runtime", "torch", "--print-command"], "--print-command: only with --runtime sglang"),
    (["--runtime", "torch", "--overlap"], "--overlap: only with --runtime sglang"),
    (["--runtime", "sglang", "--queue-size", "3"], "--queue-size: only with --runtime torch"),
    (["--runtime", "sglang", "--parallel", "4"], "--parallel: only with --runtime torch"),
])
def test_a_flag_of_the_other_runtime_is_a_one_line_exit_2(argv, message, capsys):
    from adaptivespec.cli import main

    assert main(["serve", "--config", str(HYBRID), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"adaptivespec: error: {message}") and "\n" not in err


def test_parallel_is_a_positive_integer(capsys):
    from adaptivespec.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse's own errors
        main(["serve", "--config", str(HYBRID), "--parallel", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == ("adaptivespec: error: adaptivespec serve: argument --parallel: expected a "
                                               "positive integer, got '0' (see --help)")


# -- the real model, float32 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid32():
    """The hybrid config served in float32 (in-process: FastAPI's TestClient), and the config."""
    from fastapi.testclient import TestClient

    from adaptivespec.decode import Engine

    config = load_config(HYBRID, ["runtime.dtype=float32"])
    engine = Engine(config, structured=True)
    metrics = ServerMetrics(("retrieval", "head"))
    service = Service(engine=engine, worker=Worker(engine, 4, metrics), metrics=metrics, model="hybrid")
    with TestClient(build_app(service)) as client:
        yield client, config


def chat(client, prompt: str, **extra):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                                                   "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.model
def test_served_greedy_equals_generate(hybrid32, capsys):
    from adaptivespec.cli import main

    client, _ = hybrid32
    for prompt in PROMPTS[:2]:
        assert main(["generate", "--config", str(HYBRID), "--set", "runtime.dtype=float32", "--max-new-tokens", "24",
                     "--json", "--prompt", prompt]) == 0
        want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        got = chat(client, prompt)
        assert got["choices"][0]["message"]["content"] == want["text"]
        assert got["usage"]["completion_tokens"] == want["stats"]["new_tokens"]
        assert got["speculation"]["target_forwards"] == want["stats"]["target_forwards"]
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                                 "max_tokens": 24, "temperature": 0, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want["text"]


@pytest.mark.model
def test_seeded_sampling_reproduces_and_follows_generate(hybrid32):
    from adaptivespec.decode import Engine

    client, config = hybrid32
    a = chat(client, PROMPTS[2], temperature=0.8, top_k=40, seed=11)
    b = chat(client, PROMPTS[2], temperature=0.8, top_k=40, seed=11)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    sampled = Engine(load_config(HYBRID, ["runtime.dtype=float32", "generation.temperature=0.8", "generation.top_k=40"]))
    want = sampled.generate(PROMPTS[2], max_new_tokens=24, seed=11)
    assert a["choices"][0]["message"]["content"] == want.text


@pytest.mark.model
def test_structured_output_and_bad_input_then_serving_goes_on(hybrid32):
    client, _ = hybrid32
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    out = chat(client, "Give me a person record.", max_tokens=48,
               response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    record = json.loads(out["choices"][0]["message"]["content"])
    assert set(record) == {"name", "age"} and out["choices"][0]["finish_reason"] == "stop"
    bad = [b"{not json", json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}),
           json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1})]
    for body in bad:
        r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
    assert "context length" in client.post("/v1/chat/completions", content=bad[1]).json()["error"]["message"]
    assert chat(client, PROMPTS[0])["choices"][0]["message"]["content"]
    assert client.get("/v1/models").json()["data"][0]["id"] == "hybrid"
    metrics = client.get("/metrics").text
    assert 'adaptivespec_steps_total{shape="3,4,8"}' in metrics and "adaptivespec_accepted_tokens_per_step_bucket" in metrics


# -- the bench's served contender and the soak's runtime ---------------------------------------------
def test_the_bench_reads_a_served_stream_into_stats(scripted):
    from adaptivespec.evaluation.served_contenders import TorchServedContender

    _, _, port = scripted
    contender = object.__new__(TorchServedContender)
    contender.name, contender.config, contender.port = "hybrid-served", load_config(HYBRID), port
    contender.server = types.SimpleNamespace(pause=lambda: None, resume=lambda: None)
    result = contender.generate_ids([1, 2], max_new_tokens=5)
    assert result.text == "abcde" and result.stats["new_tokens"] == 5 and result.stats["target_forwards"] == 5
    assert 0 < result.stats["prefill_seconds"] <= result.stats["wall_seconds"]


def test_bench_and_soak_take_the_torch_runtime(tmp_path, capsys):
    from adaptivespec.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--configs", str(HYBRID), "--served-configs", str(HYBRID),
                                      "--dataset", "specbench"])
    assert args.served_configs == [str(HYBRID)]
    argv = launch.torch_command(HYBRID, 31001, queue_size=8)
    assert argv[1:] == ["-m", "adaptivespec.cli", "serve", "--runtime", "torch", "--config", str(HYBRID), "--host",
                        "127.0.0.1", "--port", "31001", "--queue-size", "8"]
    assert main(["soak", "--config", str(HYBRID), "--runtime", "torch", "--out", str(tmp_path), "--", "--x", "1"]) == 2
    assert capsys.readouterr().err.strip() == "adaptivespec: error: --x: SGLang's arguments only with --runtime sglang"


def test_the_openai_client_reads_answers_streams_and_errors(scripted):
    openai = pytest.importorskip("openai")
    _, _, port = scripted
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content == "abcd" and out.usage.completion_tokens == 4
    assert out.model_extra["speculation"]["target_forwards"] == 4
    stream = client.completions.create(model="scripted", prompt="hi", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "abc"
    with pytest.raises(openai.BadRequestError, match="max_tokens: expected a positive integer, got 0"):
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert [m.id for m in client.models.list()] == ["scripted"]


def test_the_engine_is_built_in_the_worker_thread_and_a_failed_build_is_raised():
    from adaptivespec.errors import AdaptiveSpecError

    threads = []
    worker = Worker(None, 1, build=lambda: threads.append(threading.current_thread()) or "engine").start()
    assert worker.wait_ready() == "engine" and threads == [worker._thread]
    worker.stop()

    def broken():
        raise AdaptiveSpecError("model.target: nope")

    with pytest.raises(AdaptiveSpecError, match="model.target: nope"):
        Worker(None, 1, build=broken).start().wait_ready()


def test_ready_line_comes_once_the_port_accepts(capsys):
    """The port refuses while the model loads, and a client that connects as soon as it reads the
    ready line is queued, not refused (uvicorn's own listen comes later)."""
    import socket

    sock = launch._bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        launch.announce_ready(sock, "adaptivespec serve: ready: x")
        assert capsys.readouterr().err == "adaptivespec serve: ready: x\n"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sock.close()


# -- the command a user runs ------------------------------------------------------------------------
@pytest.mark.model
def test_serve_runtime_torch_as_a_user_runs_it(tmp_path):
    """``adaptivespec serve --runtime torch`` in its own process (the default ``--parallel 8``: the batch
    engine, its caches reserved for 8 x 512 positions, which the small --context-length keeps quick):
    it says which runtime it started and what it reserved, answers, refuses what its --context-length
    cannot hold, trims once idle and stops on SIGINT; a --context-length beyond the model's is one
    line and exit 2."""
    import signal
    import subprocess
    import sys

    from adaptivespec.sglang.server import free_port

    port = free_port()
    argv = [sys.executable, "-m", "adaptivespec.cli", "serve", "--config", str(HYBRID), "--runtime", "torch",
            "--port", str(port), "--context-length", "512"]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "ready:" in log.read_text() or proc.poll() is not None, 180), log.read_text()
        assert proc.poll() is None, log.read_text()
        lines = log.read_text().splitlines()
        assert lines[0] == f"adaptivespec serve: runtime torch (--runtime torch) on http://127.0.0.1:{port}"
        ready = next(line for line in lines if "ready:" in line)
        assert re.fullmatch(r"adaptivespec serve: ready: hybrid \(static\+strict\), 8 decoded together, KV reserved "
                            r"[1-9][\d,]* MiB \(8 x 512 positions\), prefix cache 51\d MiB, 16 may wait", ready), ready
        status, _, body = post(port, "/v1/chat/completions", {**CHAT, "max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert body["speculation"]["target_forwards"] >= 1
        status, _, body = post(port, "/v1/chat/completions", {**CHAT, "max_tokens": 600})
        assert status == 400 and body["error"]["param"] == "max_tokens" and "context length 512" in body["error"]["message"]

        def metrics() -> str:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            return text

        # the heap is trimmed once the engine has been idle a second, so the metric lags the response
        assert wait_for(lambda: "adaptivespec_server_trim_seconds_count 1.0" in metrics(), 30), metrics()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    run = subprocess.run([*argv[:-1], "100000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("adaptivespec: error: --context-length: expected at most 8192 "
                                                   "(the model's context length), got 100000")
