"""The contenders of a load run (``adaptivespec bench --concurrency``): servers the bench starts
once, keeps up across the levels (paused with SIGSTOP between their turns, as in a side-by-side
bench) and stops by their process group at the end, read as streams by
:func:`adaptivespec.evaluation.load.run_level`.

* a served config (``--served-configs``): ``adaptivespec serve --runtime torch`` (``TorchServedContender``),
  ``POST /v1/completions``; its chunks carry text, so their tokens are counted by re-tokenizing it (after the level;
  the last chunk takes what ``usage.completion_tokens`` leaves). ``--parallel <highest level>`` where ``serve``
  has that flag (:func:`serve_accepts`), ``--queue-size`` at least that;
* an SGLang peer (``--peers sglang,...``, ``SGLangContender``): native ``POST /generate`` streamed, each chunk's
  ``meta_info.completion_tokens`` the running count; KV pool sized for all of a level, prefix cache flushed per pass;
* ``llama-server`` (llama.cpp), where a binary is found (:func:`find_llama_server`): the configs' GGUF (or the
  embedded one's), ``--parallel <highest level>`` slots, ``POST /completion`` streamed (a chunk per token, or its ``tokens``).

Every request: greedy, the bench's own prompt ids, ``max_new_tokens`` as given, a ``response_format`` in each
server's own form (``adaptivespec.constraints``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

from adaptivespec.config import Config
from adaptivespec.constraints import llama_server_format, served_format, sglang_sampling_params
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.load import Stream, chunk_tokens, post_stream
from adaptivespec.evaluation.served_contenders import TorchServedContender
from adaptivespec.evaluation.sglang_contenders import (BENCH_KV_TOKENS, MAY_BE_UNSUPPORTED, ConfigPrompts,
                                                       SGLangContender)
from adaptivespec.server.launch import DEFAULT_QUEUE_SIZE

LLAMA_SERVER_ENV = "ADAPTIVESPEC_LLAMA_SERVER"  # the llama-server binary (else --llama-server, else PATH)
LLAMA_MODEL_ENV = "ADAPTIVESPEC_LLAMA_MODEL"
"""The GGUF ``llama-server`` loads (default: the configs' GGUF ``model.target``, else the embedded one's)."""
LLAMA_ARGS_ENV = "ADAPTIVESPEC_LLAMA_ARGS"
"""Further ``llama-server`` arguments, split as a shell would (e.g. a draft model: ``-md draft.gguf``)."""
CONTEXT_MARGIN = 64
"""Tokens added to the longest prompt plus ``max_new_tokens`` when sizing a server's context."""


@attrs.define
class Reply:
    """One streamed answer as read, before its chunks' tokens are counted (:meth:`count`)."""

    prompt: int
    sent: float
    times: list[float] = attrs.field(factory=list)
    running: list[int | None] = attrs.field(factory=list)
    """Running token count after each chunk; None where the chunk does not say (text only)."""
    texts: list[str] = attrs.field(factory=list)
    total: int | None = None
    """The server's count of completion tokens, where it sends one."""
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    """Prompt tokens the server took from its prefix cache, where it says."""

    def count(self, tokenize: Callable[[str], int] | None = None) -> Stream:
        """The :class:`Stream`: the running counts the server sent, else ``tokenize`` (a string's
        token count) of the text streamed up to each chunk."""
        running = list(self.running)
        if any(r is None for r in running):
            if tokenize is None:
                raise AdaptiveSpecError("a stream without token counts needs a tokenizer to count them")
            running = [tokenize("".join(self.texts[: k + 1])) for k in range(len(self.texts))]
        total = self.total if self.total is not None else (running[-1] if running else 0)
        return Stream(prompt=self.prompt, sent=self.sent, times=tuple(self.times),
                      tokens=tuple(chunk_tokens(running, total)), done=self.done, prompt_tokens=self.prompt_tokens,
                      cached_tokens=self.cached_tokens)


class LoadContender:
    """The interface :mod:`adaptivespec.evaluation.load_bench` drives; subclasses say how to ask."""

    name: str
    kind: str
    server: Any
    """The process-group server (:class:`adaptivespec.sglang.server.SGLangServer` or compatible)."""
    config: Config

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def begin(self) -> None:
        """Resume the server before its turn."""
        self.server.resume()

    def end(self) -> None:
        """Pause the server after its turn (SIGSTOP: an idle server must not slow the next one)."""
        self.server.pause()

    def reset(self) -> None:
        """Forget what earlier requests left (a prefix cache) before a pass; nothing by default."""

    def send(self, ids: list[int], max_new_tokens: int, prompt: int, response_format=None) -> Reply:
        raise NotImplementedError

    def count(self, reply: Reply) -> Stream:
        return reply.count()

    def describe(self) -> dict[str, Any]:
        """What ``load.json`` says about this contender: its kind and the server's command line."""
        return {"kind": self.kind, "argv": list(self.server.argv)}

    def close(self) -> None:
        self.server.stop()

    def ignore_eos(self) -> dict[str, Any]:
        return {} if self.config.generation.stop_at_eos else {"ignore_eos": True}


class TorchLoad(LoadContender):
    """A served config: ``adaptivespec serve --runtime torch``."""

    kind = "served-config"

    def __init__(self, name: str, config: Config, config_path: str, *, parallel: int, context: int | None) -> None:
        batching = serve_accepts("--parallel")
        extra = ["--parallel", str(parallel)] if batching else []
        if context is not None:
            extra += ["--context-length", str(context)]
        self.name, self.config, self.parallel = name, config, parallel if batching else None
        self.served = TorchServedContender(name, config, config_path, queue_size=max(DEFAULT_QUEUE_SIZE, parallel),
                                           extra_args=extra)
        self.server = self.served.server

    def encode(self, text: str) -> list[int]:
        return self.served.encode(text)

    def reset(self) -> None:
        self.server.flush_cache()  # the prefix cache (batch.prefix_cache_mb), as SGLang's radix cache

    def send(self, ids: list[int], max_new_tokens: int, prompt: int, response_format=None) -> Reply:
        body = {"prompt": list(ids), "max_tokens": max_new_tokens, "stream": True, "temperature": 0.0}
        body.update(served_format(response_format))
        reply = Reply(prompt=prompt, sent=time.perf_counter(), prompt_tokens=len(ids))
        for t, obj in _named(self.name, post_stream(self.served.port, "/v1/completions", body)):
            text = (obj.get("choices") or [{}])[0].get("text") or ""
            if text:
                reply.times.append(t)
                reply.texts.append(text)
                reply.running.append(None)
            if obj.get("usage"):
                reply.total = int(obj["usage"].get("completion_tokens") or 0)
                reply.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        reply.done = time.perf_counter()
        return reply

    def count(self, reply: Reply) -> Stream:
        tok = self.served.tokenizer
        return reply.count(lambda text: len(tok(text, add_special_tokens=False)["input_ids"]))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "parallel": self.parallel}


class SGLangLoad(LoadContender):
    """An SGLang peer (its own decoding: plain, stock EAGLE-3, n-gram)."""

    kind = "sglang-peer"

    def __init__(self, name: str, config: Config, *, kv_tokens: int, server_factory: Callable | None = None) -> None:
        self.name, self.config = name, config
        self.peer = SGLangContender(name, config, peer=name, kv_tokens=kv_tokens, server_factory=server_factory)
        self.server = self.peer.server
        self.server.pause()  # idle until its first turn

    def encode(self, text: str) -> list[int]:
        return self.peer.encode(text)

    def reset(self) -> None:
        self.server.flush_cache()

    def send(self, ids: list[int], max_new_tokens: int, prompt: int, response_format=None) -> Reply:
        body = {"input_ids": list(ids), "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **self.ignore_eos()}}
        body["sampling_params"].update(sglang_sampling_params(response_format) if response_format else {})
        reply = Reply(prompt=prompt, sent=time.perf_counter(), prompt_tokens=len(ids))
        for t, obj in _named(self.name, post_stream(self.server.port, "/generate", body)):
            meta = obj.get("meta_info") or {}
            reply.times.append(t)
            reply.running.append(int(meta.get("completion_tokens") or 0))
            reply.cached_tokens = meta.get("cached_tokens", reply.cached_tokens)
        reply.done = time.perf_counter()
        reply.total = reply.running[-1] if reply.running else 0
        return reply


class LlamaServerLoad(ConfigPrompts, LoadContender):
    """llama.cpp's ``llama-server`` with ``--parallel`` slots (continuous batching)."""

    kind = "llama-server"

    def __init__(self, binary: str, config: Config, *, parallel: int, context: int, model: str | None = None,
                 server_factory: Callable | None = None) -> None:
        from adaptivespec.models import embedded_gguf
        from adaptivespec.sglang.server import SGLangServer, free_port

        self.name, self.config, self._tokenizer = "llama-server", config, None
        own = str(config.model.target) if str(config.model.target).endswith(".gguf") else str(embedded_gguf())
        self.model = model or os.environ.get(LLAMA_MODEL_ENV) or own
        if not Path(self.model).is_file():
            raise AdaptiveSpecError(f"{LLAMA_MODEL_ENV}: {self.model}: GGUF file not found")
        argv = [binary, "--model", self.model, "--host", "127.0.0.1", "--port", str(free_port()),
                "--parallel", str(parallel), "--ctx-size", str(parallel * context),
                "--threads", str(config.runtime.threads or len(os.sched_getaffinity(0))),  # as the llamacpp runtime
                *shlex.split(os.environ.get(LLAMA_ARGS_ENV, ""))]
        log = Path(tempfile.mkdtemp(prefix="adaptivespec-llama-server-")) / "server.log"
        self.server = (server_factory or SGLangServer)(argv, dict(os.environ), log, timeout=600)
        self.server.start()
        try:
            wait_healthy(self.server, timeout=600)
            self.server.pause()
        except BaseException:
            self.server.stop()
            raise

    def send(self, ids: list[int], max_new_tokens: int, prompt: int, response_format=None) -> Reply:
        body = {"prompt": list(ids), "n_predict": max_new_tokens, "stream": True, "temperature": 0.0,
                "return_tokens": True, **self.ignore_eos()}
        body.update(llama_server_format(response_format))
        reply = Reply(prompt=prompt, sent=time.perf_counter())
        seen = 0
        for t, obj in _named(self.name, post_stream(self.server.port, "/completion", body)):
            n = len(obj["tokens"]) if isinstance(obj.get("tokens"), list) else int(bool(obj.get("content")))
            if n:
                seen += n
                reply.times.append(t)
                reply.running.append(seen)
            if obj.get("stop"):
                reply.total = int(obj.get("tokens_predicted") or seen)
        reply.done = time.perf_counter()
        return reply

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model": self.model}


def _named(name: str, events):
    """``events`` with a failure's message led by the contender's name."""
    try:
        yield from events
    except AdaptiveSpecError as exc:
        raise AdaptiveSpecError(f"{name}: {exc}") from None


def wait_healthy(server, timeout: float = 600.0) -> None:
    """Poll ``GET /health`` until 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _ = server.request("GET", "/health", timeout=5)
        except OSError:
            status = None
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise AdaptiveSpecError(f"llama-server not healthy after {timeout:.0f} s: {server.tail()}")
        time.sleep(0.5)


def find_llama_server(flag: str | None) -> tuple[str | None, str]:
    """(the ``llama-server`` binary, or None, and a line saying where it came from or why it is
    skipped): ``--llama-server PATH`` (``off``: skipped), else :data:`LLAMA_SERVER_ENV`, else
    ``PATH``. A named file that is not an executable is a one-line error."""
    if flag == "off":
        return None, "--llama-server off"
    for where, value in (("--llama-server", flag), (LLAMA_SERVER_ENV, os.environ.get(LLAMA_SERVER_ENV))):
        if value:
            path = shutil.which(value)
            if path is None:
                raise AdaptiveSpecError(f"{where}: {value}: expected the path of an executable llama-server, "
                                        "found no such executable")
            return path, where
    path = shutil.which("llama-server")
    if path is None:
        return None, (f"no llama-server on PATH (name one with --llama-server PATH or {LLAMA_SERVER_ENV})")
    return path, "PATH"


@functools.lru_cache(maxsize=None)
def serve_accepts(flag: str) -> bool:
    """Whether ``adaptivespec serve`` has ``flag`` (``--parallel`` arrives with continuous batching)."""
    from adaptivespec.cli import build_parser

    parser = build_parser()
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    serve = sub.choices.get("serve") if sub is not None else None
    return serve is not None and flag in serve._option_string_actions


def model_context(config: Config) -> int | None:
    """The target's ``max_position_embeddings`` (None where its config cannot be read)."""
    from transformers import AutoConfig

    from adaptivespec.models import EMBEDDED, embedded_folder

    target = config.model.target
    try:
        cfg = AutoConfig.from_pretrained(str(embedded_folder()) if target == EMBEDDED else target)
        return int(cfg.max_position_embeddings)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def kv_tokens_for(parallel: int, context: int) -> int:
    """An SGLang peer's ``--max-total-tokens`` for ``parallel`` requests of ``context`` tokens each."""
    return max(BENCH_KV_TOKENS, parallel * context)


def build_load_contenders(spec, names: Sequence[str], *, parallel: int, context: int, llama: str | None,
                          paths: dict[str, str], skipped: dict[str, str]) -> dict[str, LoadContender]:
    """The contenders of ``names`` (served configs, SGLang peers, ``llama-server``), each server
    started and paused; on a failure the ones already started are stopped. A peer of
    :data:`~adaptivespec.evaluation.sglang_contenders.MAY_BE_UNSUPPORTED` that cannot start is put in
    ``skipped`` with why."""
    entries = {e.name: e for e in spec.entries if e.served}
    peer_config = spec.entries[0].config
    out: dict[str, LoadContender] = {}
    try:
        for name in names:
            if name in entries:
                cfg = entries[name].config
                model = model_context(cfg)
                out[name] = TorchLoad(name, cfg, paths[name], parallel=parallel,
                                      context=None if model is not None and context > model else context)
            elif name == "llama-server":
                out[name] = LlamaServerLoad(llama, peer_config, parallel=parallel, context=context)
            else:
                try:
                    out[name] = SGLangLoad(name, peer_config, kv_tokens=kv_tokens_for(parallel, context))
                except AdaptiveSpecError as exc:
                    if name not in MAY_BE_UNSUPPORTED:
                        raise
                    skipped[name] = f"not supported here: {exc}"
    except BaseException:
        for c in out.values():
            c.close()
        raise
    return out
