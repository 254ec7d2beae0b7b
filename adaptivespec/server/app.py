"""The torch server's HTTP side: a FastAPI app over one generation worker: a
:class:`~adaptivespec.server.batch_worker.BatchWorker` (``--parallel N``: up to N requests decoded
together, more wait in a FIFO queue) or, with ``--parallel 1``, a :class:`~adaptivespec.server.worker.Worker`
(one generation at a time); both have the same surface.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's, streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` (vLLM's), ``GET /health`` (503 once the worker has died: its ``failure``),
``GET /metrics`` (Prometheus text). Every error, FastAPI's own 404, 405 and 422 included, is
OpenAI's error body; with an API key every route but ``/health`` answers 401 without
``Authorization: Bearer KEY``. A request is read and checked (:mod:`adaptivespec.server.schema`; its response
format compiled), tokenized (chat: the target tokenizer's chat template), checked against the
context and the config, queued, and answered from its job's events: the event loop itself never
runs a forward (the worker thread does) and never waits on one. A client that goes away cancels its
generation: a stream when the next chunk cannot be sent, a plain request at the next poll
(:data:`DISCONNECT_POLL_S`).

Every response carries ``usage`` and ``speculation`` (accept length, target forwards, promoted
tokens, lossless, queue and generation seconds ...); a stream carries them on its last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any, AsyncIterator

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.output import Envelope, TextAssembler, finish_reason, logprobs_object, speculation, usage
from adaptivespec.server.schema import (GenRequest, RequestError, parse_detokenize, parse_json, parse_request,
                                        parse_tokenize)
from adaptivespec.server.worker import Finished, Job, QueueFull, Worker

DISCONNECT_POLL_S = 0.25
"""How often a non-streamed request checks whether its client is still there."""


def model_context(engine) -> int:
    """The target's context length (``max_position_embeddings``; 8192 where its config has none)."""
    return int(getattr(engine.target.config, "max_position_embeddings", 0) or 8192)


@attrs.define(eq=False)
class Service:
    """What the routes share: the engine (read-only here), its worker and metrics, the model's name."""

    engine: Any
    worker: Worker
    metrics: ServerMetrics
    model: str
    context_length: int | None = None
    """The served context (prompt plus generated tokens); None: the model's (:func:`model_context`)."""
    strict_fields: bool = False
    """``serve --strict-fields``: ignored and unknown request fields are a 400, not a logged warning."""
    api_key: str | None = None
    """``serve --api-key``: every route but ``/health`` wants ``Authorization: Bearer <api_key>``."""
    started: int = attrs.Factory(lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.context_length or model_context(self.engine)

    def encode(self, req: GenRequest) -> list[int]:
        """The prompt's ids: chat messages through the target tokenizer's chat template."""
        tok = self.engine.tokenizer
        if req.messages is None:
            return list(req.prompt) if isinstance(req.prompt, tuple) else tok(req.prompt, add_special_tokens=True)["input_ids"]
        return self.apply_template(req.messages, req.chat_template_kwargs)

    def apply_template(self, messages, kwargs: dict[str, Any], *, generation_prompt: bool = True,
                       continue_final: bool = False) -> list[int]:
        """Chat messages' ids through the target tokenizer's chat template; ``kwargs``: the request's
        ``chat_template_kwargs`` (template variables, e.g. Qwen3's ``enable_thinking``)."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise RequestError("messages", "messages: the target's tokenizer has no chat template; "
                                           "send raw text to /v1/completions")
        if continue_final:  # only when asked: older tokenizers lack the parameter
            kwargs = {**kwargs, "continue_final_message": True}
        try:
            ids = tok.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True,
                                          return_dict=False, **kwargs)
        except Exception as exc:  # jinja's TemplateError and friends: the template refused the messages
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise RequestError("messages", f"messages: the chat template refused them: {lines[0]}") from None
        return list(ids["input_ids"] if hasattr(ids, "get") else ids)

    def limit(self, req: GenRequest, n_prompt: int) -> int:
        """The request's token limit, checked against the context and the config."""
        field, ctx = ("messages" if req.messages is not None else "prompt"), self.context
        if n_prompt >= ctx:
            raise RequestError(field, f"{field}: the prompt is {n_prompt} tokens; expected fewer than the served "
                                      f"context length of {ctx} tokens")
        room = ctx - n_prompt
        if req.max_tokens is not None and req.max_tokens > room:
            raise RequestError("max_tokens", f"max_tokens: expected at most {room} (the context length {ctx} less "
                                             f"the prompt's {n_prompt} tokens), got {req.max_tokens}")
        config = self.engine.config
        if req.sampling is not None and not config.autoregressive and \
                not getattr(type(self.engine.verifier), "supports_sampling", False):
            raise RequestError("temperature", f"temperature: expected 0 with verifier {config.verifier.name!r} "
                                              f"(it has no sampling form), got {req.sampling.temperature}")
        return req.max_tokens or min(config.generation.max_new_tokens, room)

    def prepare(self, raw: bytes, chat: bool) -> tuple[GenRequest, list[int], int]:
        """Read, check and tokenize a request (in a thread: a schema compiles here)."""
        req = parse_request(parse_json(raw), chat=chat, defaults=self.engine.config.generation,
                            vocab_size=int(self.engine.target.config.vocab_size), strict=self.strict_fields)
        ids = self.encode(req)
        return req, ids, self.limit(req, len(ids))

    def stats_of(self, done: Finished, n_prompt: int, completion: int) -> dict[str, Any]:
        config = self.engine.config
        return {"usage": usage(n_prompt, completion, done.stats.get("cached_tokens")),
                "speculation": speculation(done.stats, lossless=self.engine.lossless, policy=config.policy.name,
                                           verifier=config.verifier.name)}


def error_response(err: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class ApiKeyGate:
    """ASGI middleware: 401 in OpenAI's error body for any route but ``open_paths`` without
    ``Authorization: Bearer <key>`` (compared in constant time). Plain ASGI, not Starlette's
    ``BaseHTTPMiddleware``, so streams and disconnect polling pass through untouched."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        got = "no Authorization header" if given is None else "a different key" if scheme.lower() == b"bearer" \
            else "another scheme"
        err = RequestError("Authorization", f"Authorization: expected 'Bearer <the server's API key>' (serve --api-key), "
                                            f"got {got}", status=401)
        await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _route_list(app: FastAPI) -> str:
    return ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in app.routes
                     if getattr(r, "methods", None) and r.path not in ("/openapi.json", "/docs", "/redoc",
                                                                      "/docs/oauth2-redirect"))


def add_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors (unknown route, wrong method, a typed body that fails) and anything
    unexpected, in OpenAI's error body instead of ``{"detail": ...}`` or plain text."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{where}: no such route; expected one of: {_route_list(app)}"
        elif exc.status_code == 405:
            message = f"{where}: method not allowed; expected {(exc.headers or {}).get('Allow', 'another method')}"
        else:
            message = f"{where}: {exc.detail}"
        return error_response(RequestError(None, message, status=exc.status_code), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{field or 'request body'}: {first.get('msg', 'invalid')}, got {str(first.get('input'))[:80]!r}"
        return error_response(RequestError(field, message, status=422))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        lines = str(exc).strip().splitlines() or [""]
        return error_response(RequestError(None, f"internal error: {type(exc).__name__}: {lines[0]}", status=500))


def build_app(service: Service, *, metrics: bool = True) -> FastAPI:
    """The FastAPI app; the worker is started and stopped with it (its lifespan). ``metrics=False``
    (``serve --no-metrics``): no ``/metrics`` route."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        service.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.stop)

    app = FastAPI(title="adaptivespec (torch runtime)", lifespan=lifespan)
    add_error_handlers(app)
    if service.api_key:
        app.add_middleware(ApiKeyGate, key=service.api_key)

    @app.get("/health")
    async def health() -> Response:
        failure = getattr(service.worker, "failure", None)
        body = {"status": "failed" if failure else "ok", "runtime": "torch", "model": service.model,
                "queue": service.worker.depth, "running": service.worker.busy}
        return JSONResponse({**body, "error": failure} if failure else body, status_code=503 if failure else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": service.started,
                                            "owned_by": "adaptivespec", "max_model_len": service.context}]}

    if metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """Forget the kept prefixes (SGLang's route): requests from the next step on read their prompts whole."""
        flush = getattr(service.engine, "flush_prefix", None)
        if flush is not None:
            flush()
        return JSONResponse({"flushed": flush is not None})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(service, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(service, request, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            return JSONResponse(await asyncio.to_thread(_tokenize, service, await request.body()))
        except RequestError as err:
            return error_response(err)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            return JSONResponse(await asyncio.to_thread(_detokenize, service, await request.body()))
        except RequestError as err:
            return error_response(err)

    return app


def _tokenize(service: Service, raw: bytes) -> dict[str, Any]:
    """vLLM's ``/tokenize`` (:func:`~adaptivespec.server.schema.parse_tokenize`): ``{count, max_model_len,
    tokens, token_strs}``; chat messages go through the template as a chat request's do."""
    req, tok = parse_tokenize(parse_json(raw), strict=service.strict_fields), service.engine.tokenizer
    if req.messages is None:
        ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    else:
        ids = service.apply_template(req.messages, req.chat_template_kwargs, generation_prompt=req.add_generation_prompt,
                                     continue_final=req.continue_final_message)
        bos = getattr(tok, "bos_token_id", None)
        if req.add_special_tokens and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": service.context, "tokens": ids, "token_strs": strs}


def _detokenize(service: Service, raw: bytes) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``{prompt}``, special tokens kept."""
    ids = parse_detokenize(parse_json(raw), vocab_size=int(service.engine.target.config.vocab_size),
                           strict=service.strict_fields)
    return {"prompt": service.engine.tokenizer.decode(ids, skip_special_tokens=False)}


async def complete(service: Service, request: Request, *, chat: bool) -> Response:
    """One chat or text completion: checked, queued, answered (streamed or whole)."""
    raw = await request.body()
    try:
        req, ids, max_tokens = await asyncio.to_thread(service.prepare, raw, chat)
    except RequestError as err:
        service.metrics.outcome("bad")
        return error_response(err)
    failure = getattr(service.worker, "failure", None)
    if failure:
        service.metrics.outcome("failed")
        return error_response(RequestError(None, f"server unavailable: {failure}; restart it", status=503))
    seed = 0
    if req.sampling is not None:
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
    loop = asyncio.get_running_loop()
    # n choices: n generations of the prompt, choice i seeded seed + i (vLLM's children's seeds)
    jobs = [Job(prompt_ids=ids, max_tokens=max_tokens, sampling=req.sampling, seed=(seed + i) % 2**63,
                response_format=req.response_format, stop_ids=req.stop_token_ids, logprobs=req.logprobs, loop=loop)
            for i in range(req.n)]
    try:
        for job in jobs:
            service.worker.submit(job)
    except QueueFull as full:
        for job in jobs:
            job.cancel()
        service.metrics.outcome("rejected")
        q = service.worker.queue_size
        err = RequestError(None, f"server busy: {_running(service.worker)} and {q} more may wait (--queue-size {q}); "
                                 f"all are taken, retry after {full.retry_after} s", status=503)
        return error_response(err, {"Retry-After": str(full.retry_after)})
    envelope = Envelope(chat, req.model or service.model)
    texts = [TextAssembler(service.engine.tokenizer, req.stop, incremental=req.stream) for _ in jobs]
    if req.stream:
        return StreamingResponse(_stream(service, jobs, texts, envelope, len(ids), req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(service, request, jobs, texts, envelope, len(ids))


class _Events:
    """The events of a request's jobs (its ``n`` choices) as they come: ``(choice, kind, payload)``,
    each job's in its order, until every job has ended."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.gets = {i: asyncio.ensure_future(job.events.get()) for i, job in enumerate(jobs)}

    async def next(self, timeout: float | None = None) -> list[tuple[int, str, Any]]:
        """The events ready within ``timeout`` seconds (an empty list: none came)."""
        done, _ = await asyncio.wait(set(self.gets.values()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        out = []
        for i in sorted(i for i, f in self.gets.items() if f in done):
            kind, payload = self.gets[i].result()
            out.append((i, kind, payload))
            if kind in ("tokens", "logprobs"):
                self.gets[i] = asyncio.ensure_future(self.jobs[i].events.get())
            else:
                del self.gets[i]
        return out

    @property
    def open(self) -> bool:
        return bool(self.gets)

    def close(self) -> None:
        for job in self.jobs:
            job.cancel()  # a no-op once the job ended
        for f in self.gets.values():
            f.cancel()
        self.gets.clear()


def _running(worker) -> str:
    """What runs at once: ``--parallel`` requests decoded together (a batching worker), or one."""
    n = getattr(worker, "parallel", 1)
    return "one generation runs at a time (--parallel 1)" if n == 1 else f"{n} requests decode together (--parallel {n})"


def _tokens(job: Job, text: TextAssembler, ids: list[int]) -> str:
    """One step's ids through ``text``; a stop string found ends the job (complete, not cancelled)."""
    delta = text.add(ids)
    if text.stopped:
        job.stop()
    return delta


def _failed(service: Service, message: str) -> RequestError:
    """A generation's error event: 503 when the worker died (``failure``), else 500."""
    return RequestError(None, message, status=503 if getattr(service.worker, "failure", None) else 500)


def _final(service: Service, done: Finished, text: TextAssembler, job: Job, n_prompt: int) -> tuple[str, dict]:
    completion = text.stop_tokens if text.stopped else len(done.token_ids)
    reason = finish_reason(done, text, job.max_tokens, service.engine.eos)
    return reason, service.stats_of(done, n_prompt, completion)


def _choice_logprobs(service: Service, done: Finished, text: TextAssembler, chat: bool) -> dict[str, Any] | None:
    """A finished choice's ``logprobs`` (its tokens up to a stop string's), or None when not asked."""
    if done.logprobs is None:
        return None
    n = text.stop_tokens if text.stopped else len(done.token_ids)
    return logprobs_object(done.logprobs[:n], service.engine.tokenizer, chat)


def _merge_extra(extras: list[dict[str, Any]]) -> dict[str, Any]:
    """One response's usage over its choices (OpenAI's: completion tokens of all of them; the
    prompt once) and the first choice's speculation stats."""
    first = dict(extras[0])
    if len(extras) > 1:
        u = dict(first["usage"])
        u["completion_tokens"] = sum(e["usage"]["completion_tokens"] for e in extras)
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        first["usage"] = u
    return first


async def _whole(service: Service, request: Request, jobs: list[Job], texts: list[TextAssembler], envelope: Envelope,
                 n_prompt: int) -> Response:
    events = _Events(jobs)
    choices: dict[int, dict[str, Any]] = {}
    extras: dict[int, dict[str, Any]] = {}
    try:
        while events.open:
            ready = await events.next(DISCONNECT_POLL_S)
            if not ready and await request.is_disconnected():
                for job in jobs:
                    job.cancel()
            for i, kind, payload in ready:
                job, text = jobs[i], texts[i]
                if kind == "tokens":
                    _tokens(job, text, payload)
                    continue
                if kind == "logprobs":
                    continue
                if kind == "error":
                    return error_response(_failed(service, payload))
                if kind == "cancelled" and not text.stopped:  # the client is gone: nobody reads this
                    return error_response(RequestError(None, "request cancelled: the client disconnected", status=499))
                text.finish(payload.token_ids)
                reason, extras[i] = _final(service, payload, text, job, n_prompt)
                choices[i] = envelope.choice(text.text, reason, i, _choice_logprobs(service, payload, text, envelope.chat))
        extra = _merge_extra([extras[i] for i in range(len(jobs))])
        return JSONResponse(envelope.response("", "", extra, [choices[i] for i in range(len(jobs))]))
    finally:
        events.close()


async def _stream(service: Service, jobs: list[Job], texts: list[TextAssembler], envelope: Envelope, n_prompt: int,
                  include_usage: bool = False) -> AsyncIterator[str]:
    """The chunks (each choice's with its ``index``); the usage and speculation on the last finishing
    chunk, or with ``include_usage`` on one more chunk of no choices after them all (OpenAI's
    ``stream_options.include_usage``). With log-probabilities, a chunk carries those of the tokens
    whose text it is the first to send (those of held-back text go with a later one)."""
    events = _Events(jobs)
    pending: dict[int, list] = {i: [] for i in range(len(jobs))}
    offsets = [0] * len(jobs)
    extras: dict[int, dict[str, Any]] = {}
    chat = envelope.chat

    def logprobs(i: int, upto: int | None = None):
        if jobs[i].logprobs is None:
            return None
        take = pending[i] if upto is None else pending[i][:upto]
        pending[i] = pending[i][len(take):]
        obj = logprobs_object(take, service.engine.tokenizer, chat, offsets[i])
        if not chat:
            offsets[i] += sum(len(t) for t in obj["tokens"])
        return obj

    try:
        while events.open:
            for i, kind, payload in await events.next():
                job, text = jobs[i], texts[i]
                if kind == "logprobs":
                    pending[i].extend(payload)
                    continue
                if kind == "tokens":
                    delta = _tokens(job, text, payload)
                    if delta:
                        yield _sse(envelope.chunk(delta, index=i, logprobs=logprobs(i)))
                    continue
                if kind == "error":
                    yield _sse(_failed(service, payload).body())
                    events.close()
                    break
                rest = text.finish(payload.token_ids)
                sent = len(payload.token_ids) - len(pending[i])  # tokens whose log-probabilities went out
                n = (text.stop_tokens if text.stopped else len(payload.token_ids)) - sent
                if rest:
                    yield _sse(envelope.chunk(rest, index=i, logprobs=logprobs(i, max(n, 0))))
                    n = 0
                reason, extras[i] = _final(service, payload, text, job, n_prompt)
                last = not events.open
                extra = _merge_extra([extras[k] for k in sorted(extras)]) if last and not include_usage else None
                yield _sse(envelope.chunk("", reason, extra, index=i, logprobs=logprobs(i, max(n, 0)) if n > 0 else None))
                if last and include_usage:
                    yield _sse(envelope.usage_chunk(_merge_extra([extras[k] for k in sorted(extras)])))
        yield "data: [DONE]\n\n"
    finally:
        events.close()  # the client went away mid-stream (or the stream ended): stop at the next step


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
