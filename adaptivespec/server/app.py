"""The torch server's HTTP side: a FastAPI app over one :class:`~adaptivespec.server.worker.Worker`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's, streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). A request is read and checked (:mod:`adaptivespec.server.schema`; its response
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
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adaptivespec.server.metrics import ServerMetrics
from adaptivespec.server.output import Envelope, TextAssembler, finish_reason, speculation, usage
from adaptivespec.server.schema import GenRequest, RequestError, parse_json, parse_request
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
    started: int = attrs.Factory(lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.context_length or model_context(self.engine)

    def encode(self, req: GenRequest) -> list[int]:
        """The prompt's ids: chat messages through the target tokenizer's chat template."""
        tok = self.engine.tokenizer
        if req.messages is None:
            return list(req.prompt) if isinstance(req.prompt, tuple) else tok(req.prompt, add_special_tokens=True)["input_ids"]
        if not getattr(tok, "chat_template", None):
            raise RequestError("messages", "messages: the target's tokenizer has no chat template; "
                                           "send raw text to /v1/completions")
        try:
            ids = tok.apply_chat_template(list(req.messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # jinja's TemplateError and friends: the template refused the messages
            raise RequestError("messages", f"messages: the chat template refused them: {str(exc).splitlines()[0]}") from None
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
                            vocab_size=int(self.engine.target.config.vocab_size))
        ids = self.encode(req)
        return req, ids, self.limit(req, len(ids))

    def stats_of(self, done: Finished, n_prompt: int, completion: int) -> dict[str, Any]:
        config = self.engine.config
        return {"usage": usage(n_prompt, completion),
                "speculation": speculation(done.stats, lossless=self.engine.lossless, policy=config.policy.name,
                                           verifier=config.verifier.name)}


def error_response(err: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "runtime": "torch", "model": service.model, "queue": service.worker.depth,
                "running": service.worker.busy}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model, "object": "model", "created": service.started,
                                            "owned_by": "adaptivespec", "max_model_len": service.context}]}

    if metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(service, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(service, request, chat=False)

    return app


async def complete(service: Service, request: Request, *, chat: bool) -> Response:
    """One chat or text completion: checked, queued, answered (streamed or whole)."""
    raw = await request.body()
    try:
        req, ids, max_tokens = await asyncio.to_thread(service.prepare, raw, chat)
    except RequestError as err:
        service.metrics.outcome("bad")
        return error_response(err)
    seed = 0
    if req.sampling is not None:
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
    job = Job(prompt_ids=ids, max_tokens=max_tokens, sampling=req.sampling, seed=seed,
              response_format=req.response_format, loop=asyncio.get_running_loop())
    try:
        service.worker.submit(job)
    except QueueFull as full:
        service.metrics.outcome("rejected")
        err = RequestError(None, f"server busy: one generation runs at a time and {service.worker.queue_size} may "
                                 f"wait (--queue-size); retry after {full.retry_after} s", status=503)
        return error_response(err, {"Retry-After": str(full.retry_after)})
    envelope = Envelope(chat, req.model or service.model)
    text = TextAssembler(service.engine.tokenizer, req.stop, incremental=req.stream)
    if req.stream:
        return StreamingResponse(_stream(service, job, text, envelope, len(ids)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(service, request, job, text, envelope, len(ids))


def _tokens(job: Job, text: TextAssembler, ids: list[int]) -> str:
    """One step's ids through ``text``; a stop string found cancels the job."""
    delta = text.add(ids)
    if text.stopped:
        job.cancel()
    return delta


def _final(service: Service, done: Finished, text: TextAssembler, job: Job, n_prompt: int) -> tuple[str, dict]:
    completion = text.stop_tokens if text.stopped else len(done.token_ids)
    reason = finish_reason(done, text, job.max_tokens, service.engine.eos)
    return reason, service.stats_of(done, n_prompt, completion)


async def _whole(service: Service, request: Request, job: Job, text: TextAssembler, envelope: Envelope,
                 n_prompt: int) -> Response:
    get: asyncio.Future | None = None
    try:
        while True:
            get = asyncio.ensure_future(job.events.get())
            while not get.done():
                await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
                if not get.done() and await request.is_disconnected():
                    job.cancel()
            kind, payload = get.result()
            if kind == "tokens":
                _tokens(job, text, payload)
                continue
            if kind == "error":
                return error_response(RequestError(None, payload, status=500))
            if kind == "cancelled" and not text.stopped:  # the client is gone: nobody reads this
                return error_response(RequestError(None, "request cancelled: the client disconnected", status=499))
            text.finish(payload.token_ids)
            reason, extra = _final(service, payload, text, job, n_prompt)
            return JSONResponse(envelope.response(text.text, reason, extra))
    finally:
        job.cancel()  # a no-op once the job ended
        if get is not None and not get.done():
            get.cancel()


async def _stream(service: Service, job: Job, text: TextAssembler, envelope: Envelope, n_prompt: int) -> AsyncIterator[str]:
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "tokens":
                delta = _tokens(job, text, payload)
                if delta:
                    yield _sse(envelope.chunk(delta))
                continue
            if kind == "error":
                yield _sse(RequestError(None, payload, status=500).body())
                break
            rest = text.finish(payload.token_ids)
            if rest:
                yield _sse(envelope.chunk(rest))
            reason, extra = _final(service, payload, text, job, n_prompt)
            yield _sse(envelope.chunk("", reason, extra))
            break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client went away mid-stream (or the stream ended): stop at the next step


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
