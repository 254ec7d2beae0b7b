"""The served soak: a mixed request load against a served config, on loopback, bounded in count and time.

``adaptivespec soak --config configs/cost-aware.yaml --requests 1000 --concurrency 8`` starts
``adaptivespec serve`` for the config on a free loopback port, sends ``--requests`` requests
``--concurrency`` at a time, stops the server and reports:

- **valid** requests (plain and streamed chat, streams the client drops after 3 chunks -- cancelled
  while their policy state is live --, ``json_schema`` output, sampled output at temperature 0.7)
  that completed with HTTP 200 (``json_schema`` outputs are also checked against their schema);
- **bad** requests (a schema the grammar compiler refuses, negative ``max_tokens``, no
  ``messages``, negative ``temperature``, an unknown role, a prompt past the context) answered with
  a 4xx whose message names the field;
- 5xx answers, hangs (no answer within ``--request-timeout``), whether the server answers afterwards;
- the server's resident memory (all its processes) over the run, its growth from the first tenth of
  the run to the end, and a plot (``soak-rss.png``);
- the ``adaptivespec_*`` series of its ``/metrics`` after the traffic, and the controller's
  per-request state (pending steps, tracked requests), which must stay within the batch.

One in five requests is bad; the order is fixed (a schedule of ten slots), so two runs send the
same requests. Exit status 0 when every target holds, 1 when one does not.

With ``--runtime torch`` the server decodes ``--parallel`` requests together (default: the
concurrency, at most 16) and its ``--queue-size`` is the concurrency (at least serve's default), so
the soak's own clients never meet a full queue: a 503 is a 5xx like any other, a failure
(``http_503`` counts them apart). ``--max-rss-growth`` sets the memory target (default 10%).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import attrs

SCHEDULE = ("chat", "stream", "chat", "json_schema", "stream_dropped", "sampled", "chat", "stream", "bad", "bad")
"""The kinds of requests ``i % 10`` sends (``bad`` cycles through :data:`BAD_KINDS`)."""
BAD_KINDS = ("bad_schema", "bad_max_tokens", "bad_messages", "bad_temperature", "bad_role", "bad_context")
FIELD_WORDS = {
    "bad_schema": ("schema", "grammar", "response_format"),
    "bad_max_tokens": ("max_tokens", "max_new_tokens"),
    "bad_messages": ("messages",),
    "bad_temperature": ("temperature",),
    "bad_role": ("role",),
    "bad_context": ("context length",),
}
"""What a 4xx body must say (any one of these words) to name the field that was wrong."""
DROP_AFTER_CHUNKS = 3
RSS_GROWTH_LIMIT = 0.10


@attrs.frozen(kw_only=True)
class Outcome:
    """One request's result."""

    index: int
    kind: str
    status: int | None
    """HTTP status; None when no answer came (a hang or a refused connection)."""
    ok: bool
    """Valid kinds: completed as asked; bad kinds: a 4xx naming the field."""
    seconds: float
    detail: str = ""
    schema_valid: bool | None = None
    """``json_schema`` kinds: the output validates (None: cut at the token limit, or not checked)."""


def kind_of(index: int) -> str:
    kind = SCHEDULE[index % len(SCHEDULE)]
    if kind == "bad":
        return BAD_KINDS[(index // len(SCHEDULE) * 2 + (index % len(SCHEDULE) == 9)) % len(BAD_KINDS)]
    return kind


def request_body(kind: str, index: int, prompts: list[str], schemas: list[dict], max_tokens: int,
                 context_tokens: int) -> dict[str, Any]:
    """The chat-completions body for request ``index`` of ``kind``."""
    prompt = prompts[index % len(prompts)]
    body: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0.0}
    if kind in ("stream", "stream_dropped"):
        body["stream"] = True
    elif kind == "sampled":
        body.update(temperature=0.7, seed=index)
    elif kind == "json_schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "record", "schema": schemas[index % len(schemas)]}}
    elif kind == "bad_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "broken", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    elif kind == "bad_max_tokens":
        body["max_tokens"] = -5
    elif kind == "bad_messages":
        del body["messages"]
    elif kind == "bad_temperature":
        body["temperature"] = -1.0
    elif kind == "bad_role":
        body["messages"] = [{"role": "wizard", "content": prompt}]
    elif kind == "bad_context":
        body["messages"] = [{"role": "user", "content": "word " * (2 * context_tokens)}]
    return body


def send(port: int, index: int, kind: str, body: dict[str, Any], schema: dict | None, timeout: float) -> Outcome:
    """Send one request and classify its answer (see :class:`Outcome`)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = resp.status
        if kind.startswith("bad_"):
            text = resp.read().decode(errors="replace")
            named = any(w in text.lower() for w in FIELD_WORDS[kind])
            return Outcome(index=index, kind=kind, status=status, ok=400 <= status < 500 and named,
                           seconds=time.perf_counter() - t0, detail=text[:200])
        if status != 200:
            return Outcome(index=index, kind=kind, status=status, ok=False, seconds=time.perf_counter() - t0,
                           detail=resp.read().decode(errors="replace")[:200])
        if body.get("stream"):
            chunks, done = 0, False
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks += 1
                if kind == "stream_dropped" and chunks >= DROP_AFTER_CHUNKS:
                    break  # the client goes away mid-generation: the connection closes below
            ok = chunks >= DROP_AFTER_CHUNKS if kind == "stream_dropped" else (done and chunks > 0)
            return Outcome(index=index, kind=kind, status=status, ok=ok, seconds=time.perf_counter() - t0,
                           detail=f"{chunks} chunks{', [DONE]' if done else ''}")
        out = json.loads(resp.read())
        choice = out["choices"][0]
        content = choice["message"].get("content") or ""
        valid = _schema_valid(content, schema, choice.get("finish_reason")) if kind == "json_schema" else None
        return Outcome(index=index, kind=kind, status=status, ok=bool(content) and valid is not False,
                       seconds=time.perf_counter() - t0, schema_valid=valid, detail=content[:80])
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        hang = isinstance(exc, TimeoutError) or "timed out" in str(exc)
        return Outcome(index=index, kind=kind, status=None, ok=False, seconds=time.perf_counter() - t0,
                       detail=("hang: " if hang else "") + f"{type(exc).__name__}: {exc}"[:200])
    finally:
        conn.close()


def _schema_valid(content: str, schema: dict | None, finish_reason: str | None) -> bool | None:
    if finish_reason == "length" or schema is None:
        return None  # cut at the token limit: a prefix the grammar accepts, not a whole record
    try:
        record = json.loads(content)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(record, schema)
        return True
    except jsonschema.ValidationError:
        return False


def group_rss_mib(leader: int) -> float:
    """Resident memory of every process in ``leader``'s process group (the server and its
    scheduler and detokenizer), in MiB."""
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != leader:  # pgrp
                continue
            for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


class RssSampler(threading.Thread):
    """Samples :func:`group_rss_mib` every ``interval`` seconds with the count of finished requests."""

    def __init__(self, leader: int, done: list, interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.leader, self.done, self.interval = leader, done, interval
        self.series: list[tuple[float, int, float]] = []  # (seconds, requests finished, MiB)
        self._halt = threading.Event()
        self._t0 = time.perf_counter()

    def sample(self) -> None:
        self.series.append((round(time.perf_counter() - self._t0, 2), len(self.done), round(group_rss_mib(self.leader), 1)))

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=self.interval * 2)
        self.sample()


def rss_growth(series: list[tuple[float, int, float]], total: int) -> float | None:
    """Growth of resident memory from the end of the first tenth of the requests (warm: kernels
    compiled, caches sized) to the end of the run, as a fraction; None without samples."""
    if not series:
        return None
    warm = [mib for _, n, mib in series if n >= max(1, total // 10)] or [series[-1][2]]
    return (series[-1][2] - warm[0]) / warm[0] if warm[0] else None
