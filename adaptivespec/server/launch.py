"""``adaptivespec serve --runtime torch``: the torch runtime's flags and start-up.

``serve``'s front door (:mod:`adaptivespec.serve`) adds :func:`add_runtime_arguments` to the
command, holds :data:`TORCH_ONLY` against SGLang's flags when it chooses the runtime, and hands the
torch runtime to :func:`run_torch`: this package's server in this process, the config's
:class:`~adaptivespec.decode.Engine` (``structured=True``: any request may bring a response format),
one worker thread, uvicorn on the asked host and port. This module never imports SGLang's side.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from adaptivespec.errors import AdaptiveSpecError

DEFAULT_PARALLEL = 8
DEFAULT_QUEUE_SIZE = 16
LISTEN_BACKLOG = 2048  # uvicorn's default
TORCH_ONLY = {"parallel": "--parallel", "queue_size": "--queue-size", "overrides": "--set", "no_trim": "--no-trim",
              "strict_fields": "--strict-fields", "api_key": "--api-key"}
"""``serve`` flags (argparse dest: flag) that only the torch runtime has."""
API_KEY_ENV = "ADAPTIVESPEC_API_KEY"
"""The torch runtime's API key when ``--api-key`` is not given (keeps the key out of ``ps``)."""


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """The torch runtime's ``serve`` flags (:data:`TORCH_ONLY`), and ``--context-length``, which
    SGLang gets too; onto a parser or an argument group."""
    from adaptivespec.cli import positive_int

    p.add_argument("--parallel", type=positive_int, metavar="N",
                   help=f"torch runtime: requests decoded together by continuous batching (default {DEFAULT_PARALLEL})")
    p.add_argument("--queue-size", type=positive_int, metavar="N",
                   help=f"torch runtime: requests that may wait beyond the --parallel running ones (FIFO); more get a "
                        f"503 with Retry-After (default {DEFAULT_QUEUE_SIZE})")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   help="torch runtime: override a config key, e.g. --set runtime.dtype=float32 (repeatable)")
    p.add_argument("--context-length", type=positive_int, metavar="TOKENS",
                   help="the longest prompt plus max_tokens a request may ask for (default: the model's context "
                        "length); the torch runtime reserves its caches for it at start-up, SGLang gets its own "
                        "--context-length")
    p.add_argument("--no-trim", action="store_true",
                   help="torch runtime: do not hand the C heap's free pages back to the system after each generation "
                        "(malloc_trim, glibc only; a few ms per generation)")
    p.add_argument("--strict-fields", action="store_true",
                   help="torch runtime: refuse request fields the server ignores or does not know with a 400 (default: "
                        "accept them and log each name once, as vLLM does)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"torch runtime: every route but /health answers 401 without 'Authorization: Bearer KEY' "
                        f"(default: ${API_KEY_ENV} if set, else no key; SGLang: pass -- --api-key KEY)")


def api_key_of(args: argparse.Namespace) -> str | None:
    """The torch runtime's API key: ``--api-key``, else ``$ADAPTIVESPEC_API_KEY``; None (or empty): none."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AdaptiveSpecError(f"--port: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def announce_ready(sock: socket.socket, line: str) -> None:
    """Listen, then say so: a client that connects once it reads ``line`` waits in the backlog until
    uvicorn accepts, instead of being refused in the moment before uvicorn's own ``listen``. Until
    then the port is bound but refuses, so nobody waits through the model's load."""
    sock.listen(LISTEN_BACKLOG)
    print(line, file=sys.stderr, flush=True)


def run_torch(args: argparse.Namespace, first_line: str) -> int:
    """Serve the config on the torch runtime until interrupted; ``first_line`` (the front door's:
    which runtime and why) is printed once the config has loaded and the port is bound."""
    import uvicorn

    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.server.app import Service, build_app
    from adaptivespec.server.metrics import ServerMetrics
    from adaptivespec.batch import BatchEngine
    from adaptivespec.server.batch_worker import BatchWorker
    from adaptivespec.server.worker import Worker

    overrides = list(args.overrides or [])
    if args.target:
        overrides.append(f"model.target={args.target}")
    if args.drafter:
        overrides.append(f"model.drafter={args.drafter}")
    config = load_config(args.config, overrides)
    sock = _bind(args.host, args.port)
    print(first_line, file=sys.stderr, flush=True)
    parallel = getattr(args, "parallel", None) or DEFAULT_PARALLEL

    def build():  # in the worker thread, where every forward runs (see Worker)
        if parallel == 1:
            engine = Engine(config, structured=True)
            context = served_context(engine, args.context_length)
            engine.reserve(context)  # every cache sized for the longest request now: memory at its high-water mark
            warm_up(engine, context)
            return engine
        engine = BatchEngine(config, parallel, measure=True, log=lambda line: print(f"adaptivespec serve: {line}", file=sys.stderr,
                                                                     flush=True))
        context = served_context(engine, args.context_length)
        engine.reserve(context)  # parallel x context positions in every lane's caches, now
        warm_up_batch(engine, context)
        return engine

    metrics = ServerMetrics(tuple(s.name for s in config.sources) + (("head",) if config.model.drafter else ()))
    metrics.describe(config)
    queue = args.queue_size or DEFAULT_QUEUE_SIZE
    trim = not getattr(args, "no_trim", False)
    worker = (Worker(None, queue, metrics, build=build, trim=trim) if parallel == 1
              else BatchWorker(None, queue, metrics, build=build, trim=trim)).start()
    engine = worker.wait_ready()
    service = Service(engine=engine, worker=worker, metrics=metrics, model=Path(args.config).stem,
                      strict_fields=getattr(args, "strict_fields", False), api_key=api_key_of(args),
                      context_length=args.context_length)
    app = build_app(service, metrics=not getattr(args, "no_metrics", False))
    how = ("one generation at a time" if parallel == 1 else
           f"{parallel} decoded together, KV reserved {reserved_bytes(engine) / 2**20:,.0f} MiB "
           f"({parallel} x {served_context(engine, args.context_length)} positions)"
           + (f", prefix cache {prefix.nbytes / 2**20:,.0f} MiB" if (prefix := getattr(engine, "prefix", None)) else ""))
    announce_ready(sock, f"adaptivespec serve: ready: {service.model} ({config.policy.name}+{config.verifier.name}"
                         f"{'' if engine.lossless else ', lossy'}), {how}, "
                         f"{worker.queue_size} may wait{', API key required' if service.api_key else ''}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           backlog=LISTEN_BACKLOG))
    server.run(sockets=[sock])
    return 0


def served_context(engine, asked: int | None) -> int:
    """The context the server takes requests for: ``--context-length``, at most the model's."""
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.server.app import model_context

    limit = model_context(engine)
    if asked is not None and asked > limit:
        raise AdaptiveSpecError(f"--context-length: expected at most {limit} (the model's context length), got {asked}")
    return asked or limit


def warm_up(engine, context: int) -> None:
    """Untimed generations before the port answers: the first-call allocations (packed weights, kernel
    code), then a prompt of two prefill chunks, so the largest per-forward buffers are taken once."""
    engine.generate_ids(engine.encode("Hello"), max_new_tokens=4)
    chunk = engine.config.runtime.prefill_chunk or 1024
    n = min(2 * chunk, context - 8)
    if n > 16:
        filler = engine.encode("Hello", raw=True) or [0]
        engine.generate_ids((filler * n)[:n], max_new_tokens=4)


def warm_up_batch(engine, context: int) -> None:
    """:func:`warm_up` for a batch engine: every lane at once, then a prompt of two prefill chunks beside
    short ones (the packed forward's largest buffers taken once)."""
    hello = engine.encode("Hello")
    engine.generate_many([hello] * len(engine.lanes), max_new_tokens=4)
    chunk = engine.config.runtime.prefill_chunk or 1024
    n = min(2 * chunk, context - 8)
    if n > 16:
        filler = engine.encode("Hello", raw=True) or [0]
        engine.generate_many([(filler * n)[:n], hello], max_new_tokens=4)


def reserved_bytes(engine) -> int:
    """Bytes of the KV caches a batch engine reserved (the target's and the draft head's, every lane,
    and the head's input states each lane keeps for the prefix cache; the cache's pool apart)."""
    total = 0
    for lane in engine.lanes:
        cache = lane.engine.runtime.cache
        for layer in getattr(cache, "layers", ()):
            for t in (getattr(layer, "_k", None), getattr(layer, "_v", None)):
                total += t.numel() * t.element_size() if t is not None else 0
        for t in (lane.kv.k, lane.kv.v, getattr(lane, "states", None)):
            total += t.numel() * t.element_size() if t is not None else 0
    return total


def torch_command(config: str | Path, port: int, *, host: str = "127.0.0.1", queue_size: int | None = None,
                  parallel: int | None = None, overrides: tuple[str, ...] = (), runtime: str = "torch") -> list[str]:
    """argv of ``adaptivespec serve --runtime torch`` for ``config`` (the bench's and the soak's);
    ``queue_size``, ``parallel``: None leaves ``serve``'s defaults; ``runtime``: ``llamacpp`` for a
    config on the llama.cpp runtime (the same server, one generation at a time)."""
    argv = [sys.executable, "-m", "adaptivespec.cli", "serve", "--runtime", runtime, "--config", str(config),
            "--host", host, "--port", str(port)]
    if parallel is not None:
        argv += ["--parallel", str(parallel)]
    if queue_size is not None:
        argv += ["--queue-size", str(queue_size)]
    for item in overrides:
        argv += ["--set", item]
    return argv
