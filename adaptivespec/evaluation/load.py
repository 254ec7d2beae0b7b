"""Served contenders under concurrent load (``adaptivespec bench --concurrency 1,2,4,8,16``): the
closed-loop client of one level and the statistics of what it read.

At concurrency ``C`` the level is a closed loop: ``C`` client threads each send a streamed request,
and send the next one the moment the previous answer ends, so ``C`` requests are in flight the
whole time. Request ``i`` carries prompt ``i mod P`` (``P`` prompts). The level's *window* starts
with the first request and ends when every prompt has been answered at least once **and** at least
``max(C, P)`` requests have been answered (:func:`window_end`): until then every client is busy, so
every level, the highest included, is measured under full load. No request is sent after that;
the ones still in flight are read to their end (the server is idle before the next contender's
turn) but count only with the tokens they streamed inside the window.

What a level reports (:func:`level_stats`, :class:`LevelStats`), all on the client's clock:

* ``total_tokens_per_second``: tokens streamed inside the window / the window's seconds;
* ``per_request_tokens_per_second``: mean over the requests answered inside the window of their
  tokens / their latency (request sent to the end of its stream);
* ``itl_p50_ms`` / ``itl_p90_ms``: inter-token latency. The gap between two consecutive chunks
  that carry tokens is divided by the tokens of the later chunk and counted once per token (a
  speculative step that streams 4 tokens 40 ms after the previous chunk gives four 10 ms samples),
  pooled over the answered requests;
* ``ttft_p50_ms`` / ``ttft_p90_ms``: request sent to its first chunk that carries a token;
* ``prompt_cached_share``: of the answered requests' prompt tokens, the share the server took from
  its prefix cache (our ``usage.prompt_tokens_details.cached_tokens``, SGLang's ``cached_tokens``).

Percentiles interpolate linearly between the two nearest ranks (numpy's default).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import attrs

from adaptivespec.errors import AdaptiveSpecError


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,2,4,8,16"`` -> ``(1, 2, 4, 8, 16)``: positive integers, each once (an argparse ``type``)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        levels = tuple(int(p) for p in parts)
    except ValueError:
        levels = ()
    if not levels or any(c < 1 for c in levels) or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of distinct positive integers such as 1,2,4,8,16, got {text!r}")
    return levels


def schedule(names: Sequence[str], levels: Sequence[int]) -> list[tuple[int, str]]:
    """The run's order: level by level, every contender in turn at each (A at 1, B at 1, A at 2, ...),
    so a drift of the machine over the run hits every contender's levels alike."""
    return [(c, name) for c in levels for name in names]


# -- one request, as the client read it ------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class Stream:
    """One streamed request of a level, on the client's clock (``time.perf_counter`` seconds)."""

    prompt: int
    """Index of its prompt."""
    sent: float
    """When the request was sent."""
    times: tuple[float, ...]
    """When each chunk that carried text or tokens arrived."""
    tokens: tuple[int, ...]
    """Tokens carried by each of those chunks (same length as ``times``; they sum to the server's
    count of completion tokens)."""
    done: float | None
    """When the stream ended; None: it did not end."""
    prompt_tokens: int = 0
    """Tokens of its prompt."""
    cached_tokens: int | None = None
    """Of those, the ones the server took from its prefix cache (None: it does not say)."""


def chunk_tokens(running: Sequence[int], total: int) -> list[int]:
    """Tokens carried by each chunk, from the running token counts after each chunk: made
    non-decreasing and at most ``total``, the last chunk taking what is left of ``total`` (a count
    read off re-tokenized text may part from the server's by a token at a seam)."""
    out, seen = [], 0
    for count in running:
        count = min(max(int(count), seen), total)
        out.append(count - seen)
        seen = count
    if out:
        out[-1] += total - seen
    return out


# -- the statistics -----------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values``, linear between the two nearest ranks; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window_end(streams: Sequence[Stream], prompts: int, concurrency: int) -> float | None:
    """When the level's window closes: the end of the answer by which every one of the ``prompts``
    has been answered and at least ``max(concurrency, prompts)`` requests have (None: never)."""
    need = max(concurrency, prompts)
    answered: set[int] = set()
    for n, s in enumerate(sorted((s for s in streams if s.done is not None), key=lambda s: s.done), 1):
        answered.add(s.prompt)
        if n >= need and len(answered) == prompts:
            return s.done
    return None


def inter_token_gaps(stream: Stream) -> list[float]:
    """Seconds per token between consecutive token-carrying chunks, one sample per token (the gap
    before a chunk of ``n`` tokens divided by ``n``, ``n`` times); the first chunk has none."""
    out: list[float] = []
    prev = None
    for t, n in zip(stream.times, stream.tokens):
        if n <= 0:
            continue
        if prev is not None:
            out += [(t - prev) / n] * n
        prev = t
    return out


def first_token(stream: Stream) -> float | None:
    """Seconds from sending to the first chunk that carries a token."""
    return next((t - stream.sent for t, n in zip(stream.times, stream.tokens) if n > 0), None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


@attrs.frozen(kw_only=True)
class LevelStats:
    """One contender at one concurrency level: the row ``load.json`` keeps (field names are stable)."""

    contender: str
    concurrency: int
    requests_sent: int
    """Requests sent in the level (the window's and the few sent just before it closed)."""
    requests_answered: int
    """Requests whose stream ended inside the window: the per-request figures are theirs."""
    window_seconds: float
    tokens: int
    """Tokens streamed inside the window, by every request."""
    total_tokens_per_second: float
    per_request_tokens_per_second: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    latency_mean_seconds: float | None
    prompt_cached_share: float | None = None
    """Of the prompt tokens of the requests answered inside the window, the share the server took
    from its prefix cache instead of reading them (None: it does not say). The bench empties every
    server's cache before each pass; within a level, a prompt sent again may find itself there."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def level_stats(contender: str, concurrency: int, streams: Sequence[Stream], start: float, end: float) -> LevelStats:
    """The figures of one level whose window is ``[start, end]`` (see the module's docstring)."""
    tokens = sum(n for s in streams for t, n in zip(s.times, s.tokens) if t <= end)
    answered = [s for s in streams if s.done is not None and s.done <= end]
    rates = [sum(s.tokens) / (s.done - s.sent) for s in answered if s.done > s.sent]
    gaps = [g for s in answered for g in inter_token_gaps(s)]
    firsts = [f for f in map(first_token, answered) if f is not None]
    seconds = end - start
    told = [s for s in answered if s.cached_tokens is not None]
    prompt = sum(s.prompt_tokens for s in told)
    return LevelStats(
        contender=contender, concurrency=concurrency, requests_sent=len(streams), requests_answered=len(answered),
        window_seconds=seconds, tokens=tokens, total_tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
        per_request_tokens_per_second=sum(rates) / len(rates) if rates else None,
        itl_p50_ms=_ms(percentile(gaps, 0.5)), itl_p90_ms=_ms(percentile(gaps, 0.9)),
        ttft_p50_ms=_ms(percentile(firsts, 0.5)), ttft_p90_ms=_ms(percentile(firsts, 0.9)),
        latency_mean_seconds=sum(s.done - s.sent for s in answered) / len(answered) if answered else None,
        prompt_cached_share=sum(s.cached_tokens for s in told) / prompt if prompt else None)


# -- the closed loop ----------------------------------------------------------------------------------
def run_level(send: Callable[[int], Any], prompts: int, concurrency: int, *,
              on_answer: Callable[[int], None] | None = None) -> tuple[list[Any], float]:
    """Keep ``concurrency`` requests in flight: ``send(prompt_index)`` (blocking, thread-safe) is
    called by ``concurrency`` threads, request ``i`` with prompt ``i mod prompts``, until every
    prompt has been answered and at least ``max(concurrency, prompts)`` requests have; then the
    requests in flight are read to their end. Returns what ``send`` returned for every request
    (each must have ``prompt`` and ``done``, as :class:`Stream` has), and when the first was sent.

    A failed request stops the level and is raised at once, as Ctrl-C is (the caller stops the
    servers, which ends the requests still in flight)."""
    need = max(concurrency, prompts)
    lock = threading.Lock()
    stop = threading.Event()
    results: list[Any] = []
    failures: list[BaseException] = []
    answered: set[int] = set()
    issued = [0]

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = issued[0]
                issued[0] += 1
            try:
                reply = send(i % prompts)
            except BaseException as exc:  # noqa: BLE001 -- raised by the main thread below
                failures.append(exc)
                stop.set()
                return
            with lock:
                results.append(reply)
                answered.add(reply.prompt)
                if len(results) >= need and len(answered) == prompts:
                    stop.set()
                n = len(results)
            if on_answer is not None:
                on_answer(n)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True, name=f"load-{k}") for k in range(concurrency)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive() and not failures:
                t.join(0.5)
    except BaseException:
        stop.set()
        raise
    if failures:  # raised at once: the caller stops the servers, which ends the requests still in flight
        raise failures[0]
    return results, start


# -- streaming over HTTP --------------------------------------------------------------------------------
def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data: {...}`` lines, up to ``data: [DONE]``;
    an object with an ``error`` is raised."""
    for raw in lines:
        line = raw.strip()
        if line == b"data: [DONE]":
            return
        if not line.startswith(b"data: {"):
            continue
        obj = json.loads(line[6:])
        if isinstance(obj, dict) and obj.get("error"):
            err = obj["error"]
            raise AdaptiveSpecError(f"the server failed: {err.get('message') if isinstance(err, dict) else err}")
        yield obj


def post_stream(port: int, path: str, body: dict[str, Any], *, timeout: float = 900.0) -> Iterator[tuple[float, dict]]:
    """``POST`` ``body`` to ``127.0.0.1:port`` ``path`` and yield (arrival time, object) for each
    streamed event; a status other than 200 is raised with the start of its body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise AdaptiveSpecError(f"{path} returned {resp.status}: {resp.read()[:300]!r}")
        for obj in sse_events(resp):
            yield time.perf_counter(), obj
    finally:
        conn.close()
