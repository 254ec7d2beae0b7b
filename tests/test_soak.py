"""The served soak's mix, its classification of answers (against a fake server on loopback) and its report.
The soak against a real SGLang server runs in test_sglang_real.py."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adaptivespec.cli import main
from adaptivespec.evaluation import soak
from adaptivespec.evaluation.soak import BAD_KINDS, SCHEDULE, Outcome, group_rss_mib, kind_of, request_body, rss_growth, send
from adaptivespec.evaluation.soak_report import SoakReport, figure

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_one_in_five_is_bad_and_every_bad_kind_is_sent_alike():
    kinds = Counter(kind_of(i) for i in range(1000))
    assert sum(n for k, n in kinds.items() if k.startswith("bad_")) == 200
    assert {k: kinds[k] for k in BAD_KINDS} == {k: pytest.approx(200 / 6, abs=1) for k in BAD_KINDS}
    valid = {k for k in SCHEDULE if k != "bad"}
    assert valid <= set(kinds) and kinds["chat"] == 300 and kinds["stream_dropped"] == 100
    assert [kind_of(i) for i in range(30)] == [kind_of(i) for i in range(30)]  # a fixed order


@pytest.mark.parametrize("kind, check", [
    ("chat", lambda b: b["temperature"] == 0.0 and "stream" not in b),
    ("stream", lambda b: b["stream"] is True),
    ("sampled", lambda b: b["temperature"] == 0.7 and b["seed"] == 7),
    ("json_schema", lambda b: b["response_format"]["json_schema"]["schema"] == SCHEMA),
    ("bad_schema", lambda b: b["response_format"]["json_schema"]["schema"]["properties"]["a"]["type"] == "no-such-type"),
    ("bad_max_tokens", lambda b: b["max_tokens"] < 0),
    ("bad_messages", lambda b: "messages" not in b),
    ("bad_temperature", lambda b: b["temperature"] < 0),
    ("bad_role", lambda b: b["messages"][0]["role"] not in ("user", "system", "assistant")),
    ("bad_context", lambda b: len(b["messages"][0]["content"].split()) > 100),
])
def test_request_bodies(kind, check):
    body = request_body(kind, 7, ["p0", "p1"], [SCHEMA], max_tokens=16, context_tokens=64)
    assert check(body)


class FakeServer(BaseHTTPRequestHandler):
    """Answers by the request's ``model`` field: how the real server would, or how it must not."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = body["model"]
        if mode == "hang":
            time.sleep(3)
            return
        if mode == "error":
            return self._send(500, {"message": "boom"})
        if mode == "bad":
            return self._send(400, {"message": "temperature must be a non-negative finite number, got -1.0."})
        if mode == "bad-unnamed":
            return self._send(400, {"message": "something was wrong"})
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for i in range(6):
                    self.wfile.write(f'data: {{"i": {i}}}\n\n'.encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        content = '{"name": "Ada"}' if mode == "json" else ('{"nome": 1}' if mode == "json-wrong" else "hello")
        self._send(200, {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]})

    def _send(self, status, obj):
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture(scope="module")
def fake_port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _send(port, kind, model, timeout=10.0, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    return send(port, 0, kind, body, SCHEMA if kind == "json_schema" else None, timeout)


def test_answers_are_classified(fake_port):
    assert _send(fake_port, "chat", "ok").ok
    assert _send(fake_port, "json_schema", "json").schema_valid is True
    wrong = _send(fake_port, "json_schema", "json-wrong")
    assert wrong.schema_valid is False and not wrong.ok
    stream = _send(fake_port, "stream", "ok", stream=True)
    assert stream.ok and stream.detail == "6 chunks, [DONE]"
    dropped = _send(fake_port, "stream_dropped", "ok", stream=True)
    assert dropped.ok and dropped.detail == "3 chunks"  # the client left after three
    assert _send(fake_port, "bad_temperature", "bad").ok  # a 4xx naming the field
    unnamed = _send(fake_port, "bad_temperature", "bad-unnamed")
    assert unnamed.status == 400 and not unnamed.ok
    error = _send(fake_port, "chat", "error")
    assert error.status == 500 and not error.ok
    hang = _send(fake_port, "chat", "hang", timeout=0.5)
    assert hang.status is None and hang.detail.startswith("hang") and not hang.ok


def _outcome(i, kind, ok=True, status=200, **kw):
    return Outcome(index=i, kind=kind, status=status, ok=ok, seconds=0.1, **kw)


def _report(outcomes, series=((0.0, 0, 1000.0), (1.0, 1, 1000.0), (2.0, 10, 1010.0)), metrics=None, after=True):
    return SoakReport(config="configs/x.yaml", requests=10, concurrency=2, seconds=2.0, outcomes=tuple(outcomes),
                      rss_series=tuple(series), metrics=metrics or {}, answered_after=after)


def test_a_clean_report_has_no_failures_and_a_bad_one_says_each():
    good = _report([_outcome(0, "chat"), _outcome(1, "bad_role", status=400)],
                   metrics={"adaptivespec_controller_pending_steps": 0.0, "adaptivespec_controller_tracked_requests": 2.0})
    assert good.failures() == [] and good.state_bounded() is True and good.rss_growth == pytest.approx(0.01)
    data = good.to_json()
    assert data["valid_completed"] == 1 and data["bad_4xx_naming_field"] == 1 and data["by_kind"]["chat"] == {"sent": 1, "ok": 1}
    bad = _report([_outcome(0, "chat", ok=False, status=500), _outcome(1, "bad_role", ok=False, status=200),
                   _outcome(2, "chat", ok=False, status=None, detail="hang: timed out")],
                  series=((0.0, 1, 1000.0), (1.0, 10, 1200.0)),
                  metrics={"adaptivespec_controller_pending_steps": 40.0, "adaptivespec_controller_tracked_requests": 2.0},
                  after=False)
    text = "\n".join(bad.failures())
    for expected in ("2 of 2 valid requests did not complete", "1 of 1 bad requests got no 4xx", "http_5xx: 1", "hangs: 1",
                     "resident memory grew 20.0%", "per-request state exceeds", "did not answer after"):
        assert expected in text, expected


def test_rss_growth_starts_after_the_first_tenth():
    # a start-up climb before the first tenth of the requests is warm-up, not growth
    assert rss_growth([(0, 0, 500.0), (1, 10, 1000.0), (2, 100, 1050.0)], 100) == pytest.approx(0.05)
    assert rss_growth([], 100) is None


def test_group_rss_counts_this_process_group():
    assert group_rss_mib(os.getpgrp()) >= 10
    assert group_rss_mib(2 ** 22 + 12345) == 0.0  # no such group


def test_the_plot_draws_rss_against_requests_finished():
    report = _report([_outcome(0, "chat")])
    (ax,) = figure(report).axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 1, 10] and list(line.get_ydata()) == [1000.0, 1000.0, 1010.0]
    assert "growth +1.0%" in ax.get_title() and ax.get_xlabel() == "requests finished"


@pytest.mark.parametrize("argv, expected", [
    (["soak", "--config", "configs/cost-aware.yaml", "--requests", "0"], "argument --requests: expected a positive integer, got '0'"),
    (["soak", "--config", "configs/cost-aware.yaml", "--max-seconds", "-1"], "argument --max-seconds: expected a positive number"),
    (["soak", "--config", "no-such.yaml"], "--config: no-such.yaml: config file not found"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1


def test_the_module_documents_its_targets():
    assert "Exit status 0 when every target holds" in soak.__doc__


def test_the_metrics_plot_draws_steps_per_shape_and_the_accept_distribution():
    from adaptivespec.evaluation.soak_report import metrics_figure

    metrics = {'adaptivespec_steps_total{shape="3,4,8"}': 5.0, 'adaptivespec_steps_total{shape="1,4,2"}': 7.0,
               'adaptivespec_accepted_tokens_per_step_bucket{le="0.0"}': 4.0,
               'adaptivespec_accepted_tokens_per_step_bucket{le="1.0"}': 10.0,
               'adaptivespec_accepted_tokens_per_step_bucket{le="2.0"}': 12.0,
               'adaptivespec_accepted_tokens_per_step_bucket{le="+Inf"}': 12.0,
               "adaptivespec_accepted_tokens_per_step_count": 12.0, "adaptivespec_accepted_tokens_per_step_sum": 8.0}
    left, right = metrics_figure(metrics).axes
    assert [t.get_text() for t in left.get_xticklabels()] == ["1,4,2", "3,4,8"]
    assert [p.get_height() for p in left.patches] == [7.0, 5.0]
    assert [p.get_height() for p in right.patches] == [4.0, 6.0, 2.0]  # per value, from the cumulative buckets
    assert "mean 0.67" in right.get_title()
