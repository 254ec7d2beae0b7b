"""``serve --runtime torch`` against what real OpenAI clients send (issue 53, part 6): fields that
change nothing accepted and logged once (``--strict-fields`` refuses them), fields that would change
the output refused, ``stream_options.include_usage``, ``chat_template_kwargs``, stop strings counted
as completed, non-finite sampling values, OpenAI's error body for every error, ``--api-key``, vLLM's
``/tokenize`` and ``/detokenize``, and a dead generation worker. A scripted engine stands in for the
model (the output does not matter here); a real transformers tokenizer built in the test shows the
template variables reach the template."""

from __future__ import annotations

import http.client
import json
import logging
import threading

import pydantic
import pytest
from fastapi.testclient import TestClient
from test_torch_server import CHAT, HYBRID, ScriptedEngine, post, uvicorn_on_loopback, wait_for

from adaptivespec.server import schema
from adaptivespec.server import worker as worker_mod
from adaptivespec.server.app import Service, build_app
from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.worker import Worker


class Sampled:
    """A verifier with a sampling form (the scripted engine's default has none)."""

    supports_sampling = True
    sampler = None


def make_service(engine=None, *, queue_size: int = 4, trim: bool = False, **kw) -> Service:
    engine = engine or ScriptedEngine()
    metrics = ServerMetrics()
    return Service(engine=engine, worker=Worker(engine, queue_size, metrics, trim=trim), metrics=metrics,
                   model="scripted", **kw)


@pytest.fixture
def said(monkeypatch):
    """A fresh once-per-name memory for the field warnings (it lives for the process otherwise)."""
    fresh: set[str] = set()
    monkeypatch.setattr(schema, "_said", fresh)
    return fresh


def sse(lines) -> list[dict]:
    """The JSON chunks of a server-sent event stream, checked to end with ``[DONE]``."""
    lines = [ln for ln in lines if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def openai_error(r, status: int, param=...) -> str:
    """``r``'s OpenAI error body, checked; its message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and "\n" not in body["error"]["message"]
    if param is not ...:
        assert body["error"]["param"] == param, body
    return body["error"]["message"]


# -- fields -----------------------------------------------------------------------------------------
CLIENT_FIELDS = {"store": False, "metadata": {"app": "x"}, "service_tier": "auto", "top_logprobs": None,
                 "parallel_tool_calls": True, "user": "u1", "logit_bias": {}, "logprobs": False, "n": 1,
                 "presence_penalty": 0, "frequency_penalty": 0.0, "tools": [], "tool_choice": "auto",
                 "safety_identifier": "s", "prompt_cache_key": "k", "seed": None, "stream_options": None,
                 "x_vendor_extra": {"a": [1, 2]}}


def test_fields_that_change_nothing_are_accepted_and_logged_once_per_name(said, caplog):
    with TestClient(build_app(make_service())) as client, caplog.at_level(logging.WARNING, "adaptivespec.server"):
        for _ in range(2):
            r = client.post("/v1/chat/completions", json={**CHAT, **CLIENT_FIELDS})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "abcdef"
        r = client.post("/v1/chat/completions", json={**CHAT, "max_token": 3})
        assert r.status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if rec.name == "adaptivespec.server"]
    for name in ("store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "x_vendor_extra"):
        assert sum(f"'{name}'" in m for m in warned) == 1, (name, warned)
    assert not any("'user'" in m or "'n'" in m or "'tools'" in m for m in warned)  # read or checked: no warning
    assert any("'max_token'" in m and "did you mean max_tokens?" in m for m in warned)


@pytest.mark.parametrize("field", ["store", "metadata", "x_vendor_extra", "max_token"])
def test_strict_fields_restores_the_400s(said, field):
    with TestClient(build_app(make_service(strict_fields=True))) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, field: None})
        message = openai_error(r, 400, field)
        assert message.startswith(f"{field}: ") and "--strict-fields" in message and "max_tokens" in message
        assert client.post("/v1/chat/completions", json={**CHAT, "user": "u", "n": 1}).status_code == 200


@pytest.mark.parametrize("extra, field", [
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(said, extra, field):
    with TestClient(build_app(make_service())) as client:
        message = openai_error(client.post("/v1/chat/completions", json={**CHAT, **extra}), 400, field)
        assert message.startswith(f"{field}: this server supports only ")


def test_messages_sent_back_by_clients_and_the_developer_role(said):
    engine = ScriptedEngine()
    seen = []
    engine.tokenizer.apply_chat_template = lambda messages, **kw: seen.append(messages) or [1, 2]
    with TestClient(build_app(make_service(engine))) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "tool_calls": None, "refusal": None, "annotations": []},
            {"role": "user", "content": "again"}]})
        assert r.status_code == 200, r.text
    assert [m["role"] for m in seen[0]] == ["system", "user", "assistant", "user"]


# -- sampling values --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, field", [
    ('"temperature": 1e999', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": -0.5', "temperature"),
    ('"temperature": 1e-300', "temperature"),
    ('"temperature": 1e300', "temperature"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"top_p": NaN', "top_p"),
    ('"top_k": -2', "top_k"),
    ('"min_p": Infinity', "min_p"),
    ('"max_tokens": 0', "max_tokens"),
    ('"max_tokens": -3', "max_tokens"),
    ('"max_completion_tokens": 0', "max_completion_tokens"),
    ('"seed": 9223372036854775808', "seed"),
    ('"seed": -1', "seed"),
    ('"seed": 1.5', "seed"),
    ('"presence_penalty": NaN', "presence_penalty"),
    ('"frequency_penalty": 1e999', "frequency_penalty"),
])
def test_non_finite_or_absurd_sampling_values_are_a_400_naming_the_field(raw, field):
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + raw + "}"
    service = make_service(ScriptedEngine(verifier=Sampled()))
    with TestClient(build_app(service)) as client:
        r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert openai_error(r, 400, field).startswith(f"{field}: ")
    assert service.engine.steps == []  # nothing generated


# -- streams, stop strings --------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
])
def test_include_usage_ends_the_stream_with_a_usage_chunk_and_none_before(path, body):
    with TestClient(build_app(make_service())) as client:
        with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = sse(r.iter_lines())
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            plain = sse(r.iter_lines())
    *text, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 and "speculation" in last
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4
    assert all("usage" not in c for c in text) and text[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" in plain[-1] and plain[-1]["choices"][0]["finish_reason"] == "length"  # without it: as before


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_ended_by_a_stop_string_finishes_with_stop_and_counts_as_completed(stream):
    service = make_service()
    service.engine.free_steps = 4  # "abcd", then the generation waits: the stop string is seen meanwhile
    service.engine.gate.clear()
    threading.Timer(0.5, service.engine.gate.set).start()
    body = {"prompt": "hi", "max_tokens": 20, "stop": ["cd"], "stream": stream}
    with TestClient(build_app(service)) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = sse(r.iter_lines())
            text, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    # ended at the step that found it (when the loop read "cd" before on_tokens looked) or the next one
    assert text == "ab" and reason == "stop" and service.engine.steps[-1] in (4, 5), service.engine.steps
    metrics = service.metrics.render().decode()
    assert 'outcome="completed"} 1.0' in metrics and 'outcome="cancelled"} 0.0' in metrics, metrics


# -- chat_template_kwargs, /tokenize, /detokenize ----------------------------------------------------
class WordTokenizerEngine(ScriptedEngine):
    """The scripted engine with a real transformers tokenizer whose chat template reads
    ``enable_thinking`` as Qwen3's does."""

    WORDS = ("[UNK]", "<s>", "hi", "there", "think", "nothink", "user", "assistant", "system")

    def __init__(self) -> None:
        super().__init__()
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace
        from transformers import PreTrainedTokenizerFast

        core = Tokenizer(WordLevel({w: i for i, w in enumerate(self.WORDS)}, unk_token="[UNK]"))
        core.pre_tokenizer = Whitespace()
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="[UNK]")
        self.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                                        "{% if add_generation_prompt %}{% if enable_thinking is defined and "
                                        "not enable_thinking %}nothink{% else %}think{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_chat_template():
    service = make_service(WordTokenizerEngine())
    with TestClient(build_app(service)) as client:
        tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi there"}],
                                             "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert tok["tokens"] == [6, 2, 3, 5] and tok["count"] == 4 and tok["max_model_len"] == 64
        assert tok["token_strs"] is None
        plain = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi there"}],
                                               "return_token_strs": True}).json()
        assert plain["token_strs"] == ["user", "hi", "there", "think"]
        r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi there"}], "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
        message = openai_error(client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"tokenize": False}}),
                               400, "chat_template_kwargs")
        assert message.startswith("chat_template_kwargs.tokenize: expected a template variable")
        openai_error(client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": [1]}),
                     400, "chat_template_kwargs")


def test_tokenize_and_detokenize_as_vllm_names_them():
    with TestClient(build_app(make_service(WordTokenizerEngine()))) as client:
        r = client.post("/tokenize", json={"model": "scripted", "prompt": "hi there", "return_token_strs": True})
        assert r.json() == {"count": 2, "max_model_len": 64, "tokens": [2, 3], "token_strs": ["hi", "there"]}
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/tokenize", json={**chat, "add_generation_prompt": False}).json()["tokens"] == [6, 2]
        assert client.post("/tokenize", json={**chat, "add_special_tokens": True}).json()["tokens"] == [1, 6, 2, 4]
        openai_error(client.post("/tokenize", json={**chat, "continue_final_message": True}), 400,
                     "continue_final_message")
        openai_error(client.post("/tokenize", json={"prompt": 5}), 400, "prompt")
        assert client.post("/detokenize", json={"model": "scripted", "tokens": [1, 2, 3]}).json() == {"prompt": "<s> hi there"}
        assert openai_error(client.post("/detokenize", json={"tokens": [2, 99]}), 400, "tokens") == \
            "tokens: expected token ids in [0, 26), got 99"
        openai_error(client.post("/detokenize", json={"tokens": "hi"}), 400, "tokens")


# -- errors in OpenAI's body ------------------------------------------------------------------------
class Typed(pydantic.BaseModel):
    count: int


def test_malformed_or_deeply_nested_json_and_fastapis_own_errors_in_openais_body():
    app = build_app(make_service())

    @app.post("/typed")
    async def typed(body: Typed) -> dict:  # a typed route: FastAPI's own 422
        return {"count": body.count}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaput\nsecond line")

    with TestClient(app, raise_server_exceptions=False) as client:
        def send(path: str, body: bytes):
            return client.post(path, content=body, headers={"Content-Type": "application/json"})

        assert "invalid JSON" in openai_error(send("/v1/chat/completions", b"{nope"), 400)
        for deep in (b"[" * 100_000, b'{"a":' * 200 + b"1" + b"}" * 200):
            assert "nested at most 64 levels" in openai_error(send("/v1/chat/completions", deep), 400)
        assert "nested" in openai_error(send("/tokenize", b"[" * 100_000), 400)
        message = openai_error(client.get("/v1/chat/completion"), 404)
        assert message.startswith("GET /v1/chat/completion: no such route") and "POST /v1/chat/completions" in message
        r = client.get("/v1/chat/completions")
        assert openai_error(r, 405) == "GET /v1/chat/completions: method not allowed; expected POST"
        assert openai_error(send("/typed", b'{"count": "many"}'), 422, "count").startswith("count: ")
        assert openai_error(client.get("/boom"), 500) == "internal error: RuntimeError: kaput"


# -- --api-key --------------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_health():
    service = make_service(api_key="s3cret")
    with TestClient(build_app(service)) as client:
        assert client.get("/health").status_code == 200
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"prompt": "hi"}), ("GET", "/metrics", None),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/nowhere", None)]:
            for headers, got in [({}, "got no Authorization header"), ({"Authorization": "Bearer wrong"}, "a different key"),
                                 ({"Authorization": "Basic s3cret"}, "another scheme")]:
                r = client.request(method, path, json=body, headers=headers)
                message = openai_error(r, 401, "Authorization")
                assert message.endswith(got) and "s3cret" not in message and r.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT, headers=good).json()["choices"][0]["message"]["content"] == "abcdef"
        assert client.get("/metrics", headers=good).status_code == 200


def test_the_openai_client_with_an_api_key_and_extra_fields(said):
    openai = pytest.importorskip("openai")
    service = make_service(api_key="k1")
    with uvicorn_on_loopback(build_app(service)) as port:
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base, api_key="k1", max_retries=0)
        out = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                             store=False, metadata={"a": "b"}, user="u", service_tier="auto",
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert out.choices[0].message.content == "abc"
        chunks = list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        assert all(c.usage is None for c in chunks[:-1])


# -- a dead worker ----------------------------------------------------------------------------------
def test_a_dead_worker_fails_the_running_and_queued_requests_and_health_says_503(monkeypatch):
    service = make_service(ScriptedEngine(verifier=Sampled()), queue_size=4)
    engine = service.engine
    engine.gate.clear()  # the first generation waits at its first step

    def broken(*a, **k):
        raise RuntimeError("bookkeeping exploded")

    with uvicorn_on_loopback(build_app(service)) as port:
        answers: dict[str, tuple[int, dict]] = {}

        def ask(name: str, body: dict) -> None:
            status, _, reply = post(port, "/v1/chat/completions", body)
            answers[name] = (status, reply)

        threads = [threading.Thread(target=ask, args=("running", {**CHAT, "max_tokens": 3}))]
        threads[0].start()
        assert wait_for(lambda: service.worker.busy)
        for name in ("queued1", "queued2"):  # their run times their wait (outside any generation)
            threads.append(threading.Thread(target=ask, args=(name, {**CHAT, "temperature": 0.5})))
            threads[-1].start()
        assert wait_for(lambda: service.worker.depth == 2)
        monkeypatch.setattr(service.worker.metrics.queue_seconds, "observe", broken)
        engine.gate.set()
        for t in threads:
            t.join(30)
        assert answers["running"][0] == 200  # it ended before the worker died
        for name in ("queued1", "queued2"):
            status, reply = answers[name]
            assert status == 503 and "bookkeeping exploded" in reply["error"]["message"], answers
        assert service.worker.failure.startswith("the generation worker failed: RuntimeError: bookkeeping exploded")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        health = json.loads(resp.read())
        conn.close()
        assert resp.status == 503 and health["status"] == "failed" and "bookkeeping exploded" in health["error"]
        status, _, reply = post(port, "/v1/chat/completions", CHAT)  # new requests: 503 at once, no hang
        assert status == 503 and reply["error"]["message"].startswith("server unavailable: the generation worker failed")
        assert 'outcome="failed"} 3.0' in service.metrics.render().decode()


def test_a_dead_worker_answers_a_stream_and_a_job_submitted_after_it_died(monkeypatch):
    import asyncio

    from adaptivespec.server.worker import Job

    monkeypatch.setattr(worker_mod, "trim_heap", lambda: (_ for _ in ()).throw(OSError("trim failed")))
    service = make_service(trim=True)
    with TestClient(build_app(service)) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # answered, then the trim kills it
        assert wait_for(lambda: service.worker.failure is not None)
        assert client.get("/health").status_code == 503
        loop = asyncio.new_event_loop()
        try:
            job = Job(prompt_ids=[1], max_tokens=2, loop=loop)
            service.worker.submit(job)  # the lead's race: submitted just after the death, answered at once
            kind, message = loop.run_until_complete(asyncio.wait_for(job.events.get(), 5))
        finally:
            loop.close()
        assert kind == "error" and message == "the generation worker failed: OSError: trim failed"


# -- the flags ---------------------------------------------------------------------------------------
def test_serve_flags_strict_fields_and_api_key(monkeypatch):
    from adaptivespec.cli import build_parser
    from adaptivespec.server import launch

    base = ["serve", "--config", str(HYBRID), "--runtime", "torch"]
    args = build_parser().parse_args([*base, "--strict-fields", "--api-key", "abc"])
    assert args.strict_fields is True and launch.api_key_of(args) == "abc"
    monkeypatch.setenv(launch.API_KEY_ENV, "from-env")
    assert launch.api_key_of(build_parser().parse_args(base)) == "from-env"
    assert launch.api_key_of(args) == "abc"  # the flag wins
    monkeypatch.setenv(launch.API_KEY_ENV, "")
    assert launch.api_key_of(build_parser().parse_args(base)) is None
    assert "strict_fields" in launch.TORCH_ONLY and "api_key" in launch.TORCH_ONLY


@pytest.mark.parametrize("flag", [["--strict-fields"], ["--api-key", "abc"]])
def test_the_torch_runtimes_flags_are_refused_with_sglang(flag, capsys):
    from adaptivespec.cli import main

    assert main(["serve", "--config", str(HYBRID), "--runtime", "sglang", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"adaptivespec: error: {flag[0]}: only with --runtime torch") and "\n" not in err
    assert "abc" not in err
