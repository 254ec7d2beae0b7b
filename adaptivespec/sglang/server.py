"""A local SGLang server as a context manager: started in its own process group on loopback, waited
for with a bound, always stopped (the whole group), its log kept. Used by the real-server tests, the
bench's SGLang peers and backend, and ``scripts/sglang_load.py``.

Three ways to build the command, all on the same weights:

* :func:`served_command` -- ``adaptivespec serve`` for a config (our policy inside SGLang's
  EAGLE-3 worker, through the plugin);
* :func:`peer_command` -- SGLang alone: ``sglang`` (plain decoding), ``sglang-eagle3`` (its static
  EAGLE-3 with the shipped head at ``configs/eagle3.yaml``'s shape) or ``sglang-ngram`` (its n-gram
  drafting), with the same device flags and environment ``serve`` chooses, and the plugin off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

from adaptivespec.constraints import openai_response_format, sglang_sampling_params
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import CONFIG_ENV, serve
from adaptivespec.sglang.platform import cpu_args, cpu_env, detect_device

ROOT = Path(__file__).resolve().parents[2]
PEER_MODES = ("sglang", "sglang-eagle3", "sglang-ngram", "sglang-adaptive")
"""SGLang's own decoding modes, as ``bench --peers`` names them."""

NGRAM_DRAFT_TOKENS = 12
"""``--speculative-num-draft-tokens`` of the ``sglang-ngram`` peer (SGLang's CPU recipe's value)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_command(config: str | Path, port: int, *, trace: str | Path | None = None,
                   extra_args: Sequence[str] = (), device: str | None = None,
                   verify_budget: int | None = None, load_profile: str | None = None,
                   metrics: bool = True) -> tuple[list[str], dict[str, str]]:
    """argv and environment of ``adaptivespec serve --config CONFIG`` (what the CLI would exec);
    ``load_profile`` as ``serve --load-profile`` (None: ``auto``); ``metrics=False`` as ``--no-metrics``."""
    sc = serve.refuse_unservable(config)
    argv = serve.build_command(sc, port=port, extra_args=list(extra_args), device=device, metrics=metrics)
    env = serve.build_env(sc, device=device, trace=trace, verify_budget=verify_budget,
                          load_profile=serve.load_profile(sc, load_profile, device=device), metrics=metrics)
    return argv, env


def peer_command(mode: str, port: int, *, config: str | Path | None = None, extra_args: Sequence[str] = (),
                 device: str | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of SGLang's own ``mode`` (:data:`PEER_MODES`) on the embedded pair (or
    ``config``'s model), with the plugin inactive (``ADAPTIVESPEC_CONFIG`` removed)."""
    if mode not in PEER_MODES:
        raise AdaptiveSpecError(f"--peers: unknown SGLang peer {mode!r}; expected one of: {', '.join(PEER_MODES)}")
    eagle3 = Path(config) if config is not None else ROOT / "configs" / "eagle3.yaml"
    target, drafter = serve._model_paths(ROOT / "configs" / "eagle3.yaml" if config is None else config, None, None)
    device = device or detect_device()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", target,
            "--host", "127.0.0.1", "--port", str(port), "--disable-overlap-schedule"]
    if mode in ("sglang-eagle3", "sglang-adaptive"):
        _, top = serve.bank_shapes(eagle3)
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
                 "--speculative-num-steps", str(top.nsteps), "--speculative-eagle-topk", str(top.topk),
                 "--speculative-num-draft-tokens", str(top.ndt)]
        if mode == "sglang-adaptive":  # SGLang's own per-step depth choice (topk 1 chains, from eagle3's start)
            argv.append("--speculative-adaptive")
    elif mode == "sglang-ngram":
        argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(NGRAM_DRAFT_TOKENS)]
    if device == "cpu":
        argv += cpu_args(target, extra_args)
    env = cpu_env() if device == "cpu" else dict(os.environ)
    env.pop(CONFIG_ENV, None)
    return argv + list(extra_args), env


class SGLangServer:
    """``with SGLangServer(argv, env, log) as server: server.generate(...)``.

    Starts ``argv`` in a new session (its own process group), polls ``GET /health_generate``-free
    ``GET /v1/models`` until it answers or ``timeout`` seconds pass (then the log's tail is in the
    error), and on exit sends SIGTERM to the group, then SIGKILL after ``grace`` seconds."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None, log: str | Path | None = None,
                 *, timeout: float = 240.0, grace: float = 10.0) -> None:
        self.argv, self.env = list(argv), dict(env if env is not None else os.environ)
        self.port = int(self.argv[self.argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log) if log else Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-{self.port}.log"
        self.timeout, self.grace = timeout, grace
        self.proc: subprocess.Popen | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> "SGLangServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise AdaptiveSpecError(f"SGLang server exited with {self.proc.returncode} at start-up: {self.tail()}")
            try:
                self.request("GET", "/v1/models", timeout=5)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(1.0)
        self.stop()
        raise AdaptiveSpecError(f"SGLang server not ready after {self.timeout:.0f} s: {self.tail()}")

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            self.resume()  # a paused group would not act on SIGTERM
            for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            try:  # children that outlived the leader (scheduler, detokenizer) share its group
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pause(self) -> None:
        """SIGSTOP the server's process group: an idle SGLang scheduler busy-polls (~15% of a core
        here), which would slow whichever server a bench is measuring beside it."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        keep = [line for line in text if "server_args=" not in line][-lines:]
        return " | ".join(keep)

    # -- requests ---------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
        """(HTTP status, decoded JSON or text); HTTP errors return their status and body."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, timeout: float = 600.0,
                 **sampling: Any) -> dict[str, Any]:
        """SGLang's native ``POST /generate`` on token ids, greedy unless ``sampling`` says otherwise;
        the response (``text``, ``output_ids``, ``meta_info``) with ``wall_seconds`` added."""
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}
        t0 = time.perf_counter()
        status, out = self.request("POST", "/generate", {"input_ids": list(input_ids), "sampling_params": params},
                                   timeout=timeout)
        wall = time.perf_counter() - t0
        if status != 200 or not isinstance(out, dict):
            raise AdaptiveSpecError(f"SGLang /generate returned {status}: {str(out)[:300]}")
        out["wall_seconds"] = wall
        return out

    def chat(self, messages: Sequence[dict[str, Any]], max_tokens: int, *, response_format=None,
             timeout: float = 600.0, **extra: Any) -> dict[str, Any]:
        """SGLang's OpenAI ``POST /v1/chat/completions`` (greedy unless ``extra`` says otherwise),
        ``response_format`` passed through for SGLang's own constrained decoding (see
        :func:`chat_request`); the response with ``wall_seconds`` added."""
        t0 = time.perf_counter()
        status, out = self.request("POST", "/v1/chat/completions",
                                   chat_request(messages, max_tokens, response_format=response_format, **extra),
                                   timeout=timeout)
        if status != 200 or not isinstance(out, dict):
            raise AdaptiveSpecError(f"SGLang /v1/chat/completions returned {status}: {str(out)[:300]}")
        out["wall_seconds"] = time.perf_counter() - t0
        return out

    def flush_cache(self, timeout: float = 60.0) -> None:
        """Empty SGLang's prefix (radix) cache: the next request prefills from scratch.

        SGLang refuses a flush (HTTP 400) while a request is still running or queued, which
        includes the moments after a response was sent and before the scheduler retired it, so
        the flush waits for idle (SGLang's ``timeout`` query) and is retried until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            status, out = self.request("POST", f"/flush_cache?timeout={min(left, 10.0):.1f}", timeout=left + 30)
            if status == 200:
                return
            if time.monotonic() >= deadline:
                raise AdaptiveSpecError(f"SGLang /flush_cache returned {status} for {timeout:.0f} s: {str(out)[:200]}")
            time.sleep(0.1)


def chat_request(messages: Sequence[dict[str, Any]], max_tokens: int, *, response_format=None,
                 model: str = "default", **extra: Any) -> dict[str, Any]:
    """The body of an OpenAI chat-completions request to SGLang.

    ``response_format`` (a :class:`~adaptivespec.config.ResponseFormat`) becomes the OpenAI
    ``response_format`` (``json_schema``, ``json_object``); ``regex`` and ``ebnf``, which OpenAI's
    API lacks, go as SGLang's extra request fields of the same names."""
    body: dict[str, Any] = {"model": model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if response_format is not None:
        if response_format.type in ("json_schema", "json_object"):
            body["response_format"] = openai_response_format(response_format)
        else:
            body.update(sglang_sampling_params(response_format))
    return body
