"""``adaptivespec soak``: start a served config on loopback, send :mod:`adaptivespec.evaluation.soak`'s mix
to it (:func:`run_soak`), stop it, write ``soak.json`` and ``soak-rss.png``; exit 0 when every target holds, 1 when
one does not, 2 for bad arguments."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.datasets import load_dataset
from adaptivespec.evaluation.soak import RSS_GROWTH_LIMIT, Outcome, RssSampler, kind_of, request_body, send
from adaptivespec.evaluation.soak_report import SoakReport, figure, metrics_figure
from adaptivespec.server.launch import DEFAULT_QUEUE_SIZE, torch_command
from adaptivespec.sglang import serve
from adaptivespec.sglang.metrics import parse_metrics
from adaptivespec.sglang.server import SGLangServer, free_port, served_command

MAX_PARALLEL = 16
"""The torch runtime's ``--parallel`` when ``--parallel`` is not given: the concurrency, at most this
(the issue's soak level, the load bench's top level; every slot reserves ``--context-length``
positions of KV at start-up)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_soak_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("soak", help="a mixed request load (valid, bad, streamed, dropped, json_schema, sampled) against "
                       "a served config on loopback: 4xx/5xx, hangs, memory, /metrics")
    p.add_argument("--config", required=True, help="YAML config to serve (adaptivespec serve --config)")
    p.add_argument("--requests", type=_positive_int, default=1000, help="requests to send (default 1000; one in five is bad)")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--max-seconds", type=_positive_float, default=1800.0,
                   help="stop sending after this many seconds (default 1800); requests not sent count as failures")
    p.add_argument("--max-tokens", type=_positive_int, default=48, help="max_tokens of the valid requests (default 48)")
    p.add_argument("--request-timeout", type=_positive_float, default=180.0,
                   help="seconds without an answer after which a request counts as a hang (default 180)")
    p.add_argument("--out", default="runs/soak", help="folder for soak.json, soak-rss.png and server.log (default runs/soak)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--runtime", choices=("sglang", "torch"), default="sglang",
                   help="serve the config with SGLang (default) or with `adaptivespec serve --runtime torch` "
                        "(--parallel requests decoded together; its --queue-size is --concurrency, at least serve's "
                        "default, so the soak's clients never meet a full queue: a 503 is a failure)")
    p.add_argument("--parallel", type=_positive_int, metavar="N",
                   help=f"torch runtime: serve --parallel N, requests decoded together (default: --concurrency, at "
                        f"most {MAX_PARALLEL}; 1: one generation at a time)")
    p.add_argument("--max-rss-growth", type=_positive_float, default=RSS_GROWTH_LIMIT * 100, metavar="PERCENT",
                   help=f"the resident-memory growth after warm-up that fails the soak (default "
                        f"{RSS_GROWTH_LIMIT * 100:.0f}; issue 52's target: 5)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, metavar="-- SGLANG_ARGS",
                   help="further sglang.launch_server arguments, after --")
    p.set_defaults(func=run_soak_command)
    return p


def _inputs() -> tuple[list[str], list[dict]]:
    """Prompts (Spec-Bench's, every category) and schemas (the structured set's)."""
    prompts = [p.prompt for p in load_dataset("specbench")]
    schemas = [p.meta["response_format"]["schema"] for p in load_dataset("structured")]
    return prompts, schemas


def _context_tokens(target: str) -> int:
    try:
        cfg = json.loads((Path(target) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings") or 8192)
    except (OSError, ValueError):
        return 8192


def run_soak(port: int, leader: int, *, config: str, requests: int, concurrency: int, max_seconds: float,
             max_tokens: int, request_timeout: float, context_tokens: int, prompts: list[str], schemas: list[dict],
             progress: bool = True, rss_limit: float = RSS_GROWTH_LIMIT) -> SoakReport:
    """Send the mix to a server already listening on ``port`` (process group ``leader``)."""
    done: list[Outcome] = []
    sampler = RssSampler(leader, done)
    sampler.sample()
    sampler.start()
    deadline = time.monotonic() + max_seconds
    bar = tqdm(total=requests, desc="soak", unit="req", disable=not progress)

    def one(i: int) -> Outcome | None:
        if time.monotonic() > deadline:
            return None
        kind = kind_of(i)
        schema = schemas[i % len(schemas)] if kind == "json_schema" else None
        body = request_body(kind, i, prompts, schemas, max_tokens, context_tokens)
        out = send(port, i, kind, body, schema, request_timeout)
        done.append(out)
        bar.update(1)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    seconds = time.perf_counter() - t0
    bar.close()
    sampler.stop()
    after = send(port, requests, "chat", request_body("chat", 0, prompts, schemas, 8, context_tokens), None, request_timeout)
    metrics: dict[str, float] = {}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        if resp.status == 200:
            metrics = parse_metrics(resp.read().decode(errors="replace"))
        conn.close()
    except OSError:
        pass
    outcomes = tuple(o for o in results if o is not None)
    return SoakReport(config=config, requests=requests, concurrency=concurrency, seconds=seconds, outcomes=outcomes,
                      rss_series=tuple(sampler.series), metrics=metrics, answered_after=after.ok,
                      not_run=requests - len(outcomes), rss_limit=rss_limit)


def run_soak_command(args: argparse.Namespace) -> int:
    extra = [a for a in (args.sglang_args or []) if a != "--"]
    if not Path(args.config).is_file():
        raise AdaptiveSpecError(f"--config: {args.config}: config file not found")
    runtime = getattr(args, "runtime", "sglang")
    if runtime == "torch" and extra:
        raise AdaptiveSpecError(f"{extra[0]}: SGLang's arguments only with --runtime sglang")
    if runtime != "torch" and getattr(args, "parallel", None) is not None:
        raise AdaptiveSpecError("--parallel: only with --runtime torch (SGLang batches on its own)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    how = f"{runtime} runtime"
    if runtime == "torch":
        parallel = getattr(args, "parallel", None) or min(args.concurrency, MAX_PARALLEL)
        queue = max(DEFAULT_QUEUE_SIZE, args.concurrency)  # >= the clients beyond the slots: never a 503
        argv = torch_command(args.config, port, queue_size=queue, parallel=parallel)
        env = dict(os.environ)
        how += f", --parallel {parallel}, --queue-size {queue}"
    else:
        serve.preflight()
        argv, env = served_command(args.config, port, extra_args=extra)
    target = serve._target_path(args.config, None)
    prompts, schemas = _inputs()
    print(f"soak: serving {args.config} ({how}) on 127.0.0.1:{port} (log {out / 'server.log'})", flush=True)
    with SGLangServer(argv, env, out / "server.log", timeout=600) as server:
        report = run_soak(port, server.proc.pid, config=args.config, requests=args.requests,
                          concurrency=args.concurrency, max_seconds=args.max_seconds, max_tokens=args.max_tokens,
                          request_timeout=args.request_timeout, context_tokens=_context_tokens(target),
                          prompts=prompts, schemas=schemas, progress=not args.quiet,
                          rss_limit=getattr(args, "max_rss_growth", RSS_GROWTH_LIMIT * 100) / 100)
    data = report.to_json()
    (out / "soak.json").write_text(json.dumps(data, indent=1) + "\n")
    figure(report).savefig(out / "soak-rss.png", dpi=110)
    if report.metrics:
        metrics_figure(report.metrics, f"{Path(args.config).stem}: /metrics after {args.requests} requests, "
                       f"{args.concurrency} at a time").savefig(out / "soak-metrics.png", dpi=110)
    growth = "n/a" if data["rss_growth"] is None else f"{data['rss_growth']:+.1%}"
    print(f"soak: {data['valid_completed']}/{data['valid']} valid completed, {data['bad_4xx_naming_field']}/{data['bad']} bad "
          f"got a 4xx naming the field, {data['http_5xx']} 5xx ({data['http_503']} 503), {data['hangs']} hangs, "
          f"RSS growth {growth} (limit {data['rss_limit']:.0%}), "
          f"state bounded: {data['state_bounded']}, answered after: {data['answered_after']} "
          f"({data['seconds']:.0f} s; {out / 'soak.json'})")
    for line in data["failures"]:
        print(f"soak: FAILED: {line}")
    return 1 if data["failures"] else 0
