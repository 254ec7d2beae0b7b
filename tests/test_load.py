"""``adaptivespec bench --concurrency``: the statistics of synthetic streams, the closed loop, the
schedule, the flag's errors, and a whole run against stand-in servers (tests/fake_load_server.py,
real processes on loopback: started once, paused between turns, stopped by PID)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import attrs
import pytest

from adaptivespec.cli import main
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import load, load_contenders, served_contenders
from adaptivespec.evaluation.load import Stream, chunk_tokens, level_stats, parse_levels, percentile, schedule, window_end
from adaptivespec.evaluation.load_contenders import Reply, find_llama_server, serve_accepts

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "fake_load_server.py"
HYBRID = str(ROOT / "configs" / "hybrid.yaml")
AR = str(ROOT / "configs" / "ar.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- statistics ------------------------------------------------------------------------------------
def synthetic() -> list[Stream]:
    """Two prompts at concurrency 2: the window closes at 1.0 s, when both have been answered."""
    return [
        Stream(prompt=0, sent=0.0, times=(0.5, 0.6, 0.8), tokens=(1, 2, 1), done=0.8),
        Stream(prompt=1, sent=0.0, times=(0.2, 0.3, 0.4, 0.6, 1.0), tokens=(1, 0, 1, 1, 1), done=1.0),
        Stream(prompt=0, sent=0.8, times=(0.9, 1.3), tokens=(2, 2), done=1.3),  # in flight at the close
    ]


def test_level_statistics_of_synthetic_streams():
    streams = synthetic()
    assert window_end(streams, prompts=2, concurrency=2) == 1.0
    row = level_stats("x", 2, streams, 0.0, 1.0).to_json()
    assert row["contender"] == "x" and row["concurrency"] == 2
    assert row["requests_sent"] == 3 and row["requests_answered"] == 2
    assert row["window_seconds"] == 1.0
    assert row["tokens"] == 10  # 4 + 4 + the 2 the third request streamed before the close
    assert row["total_tokens_per_second"] == pytest.approx(10.0)
    assert row["per_request_tokens_per_second"] == pytest.approx((4 / 0.8 + 4 / 1.0) / 2)
    # per token: 0.1 s / 2 twice, 0.2 s once (first stream); 0.2, 0.2, 0.4 (second; its empty chunk is not one)
    assert row["itl_p50_ms"] == pytest.approx(200.0) and row["itl_p90_ms"] == pytest.approx(300.0)
    assert row["ttft_p50_ms"] == pytest.approx(350.0) and row["ttft_p90_ms"] == pytest.approx(470.0)
    assert row["latency_mean_seconds"] == pytest.approx(0.9)
    assert list(row) == ["contender", "concurrency", "requests_sent", "requests_answered", "window_seconds", "tokens",
                         "total_tokens_per_second", "per_request_tokens_per_second", "itl_p50_ms", "itl_p90_ms",
                         "ttft_p50_ms", "ttft_p90_ms", "latency_mean_seconds", "prompt_cached_share"]
    assert row["prompt_cached_share"] is None  # the server did not say
    told = [attrs.evolve(s, prompt_tokens=100, cached_tokens=c) for s, c in zip(streams, (30, 50, 99))]
    assert level_stats("x", 2, told, 0.0, 1.0).prompt_cached_share == pytest.approx(0.4)  # answered ones only


def test_the_window_waits_for_every_prompt_and_for_max_of_c_and_p_answers():
    streams = synthetic()
    assert window_end(streams, prompts=2, concurrency=3) == 1.3  # a third answer is needed
    assert window_end(streams[:1] + streams[2:], prompts=2, concurrency=2) is None  # prompt 1 never answered
    assert window_end(streams, prompts=1, concurrency=1) == 0.8


def test_percentiles_interpolate_between_ranks():
    assert percentile([4, 1, 3, 2], 0.5) == 2.5 and percentile([1, 2, 3, 4], 0.9) == pytest.approx(3.7)
    assert percentile([7.0], 0.9) == 7.0 and percentile([], 0.5) is None


def test_chunk_tokens_from_running_counts():
    assert chunk_tokens([1, 3, 3, 7], total=6) == [1, 2, 0, 3]  # clamped to the server's total
    assert chunk_tokens([2, 1, 4], total=5) == [2, 0, 3]  # never backwards; the last takes the rest
    assert chunk_tokens([], total=0) == []
    reply = Reply(prompt=3, sent=0.0, times=[0.1, 0.2], running=[None, None], texts=["ab", "cde"], total=6, done=0.3)
    stream = reply.count(len)  # one "token" per character, then the server's total
    assert stream.tokens == (2, 4) and stream.prompt == 3 and stream.done == 0.3
    with pytest.raises(AdaptiveSpecError, match="tokenizer"):
        reply.count()


# -- the loop and the schedule ---------------------------------------------------------------------
@pytest.mark.parametrize("prompts, concurrency", [(5, 3), (2, 4), (1, 1)])
def test_the_loop_keeps_c_requests_in_flight_until_every_prompt_is_answered(prompts, concurrency):
    lock = threading.Lock()
    state = {"in_flight": 0, "most": 0, "calls": 0}
    first_round = threading.Barrier(concurrency, timeout=30)  # breaks unless C requests are in flight together
    answered = []

    def send(prompt: int) -> Stream:
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
            state["calls"] += 1
            first = state["calls"] <= concurrency
        if first:
            first_round.wait()
        with lock:
            state["in_flight"] -= 1
        return Stream(prompt=prompt, sent=0.0, times=(), tokens=(), done=float(state["calls"]))

    streams, _ = load.run_level(send, prompts, concurrency, on_answer=answered.append)
    assert state["most"] == concurrency
    assert len(streams) >= max(prompts, concurrency) and {s.prompt for s in streams} == set(range(prompts))
    assert answered[-1] == len(streams)


def test_a_failed_request_stops_the_level_and_is_raised():
    def send(prompt: int):
        raise AdaptiveSpecError("x: /v1/completions returned 500")

    with pytest.raises(AdaptiveSpecError, match="returned 500"):
        load.run_level(send, 3, 2)


def test_levels_alternate_contenders():
    assert schedule(["a", "b"], (1, 2, 4)) == [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (4, "a"), (4, "b")]


# -- the flag -------------------------------------------------------------------------------------
def test_parse_levels():
    assert parse_levels("1,2,4,8,16") == (1, 2, 4, 8, 16) and parse_levels(" 3 ") == (3,)


@pytest.mark.parametrize("value", ["1,x", "0,2", "2,-1", "", "1,1", "1,,2"])
def test_bad_levels_are_a_one_line_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--served-configs", HYBRID, "--dataset", "gsm8k", "--concurrency", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--concurrency" in err and repr(value) in err and "positive integers" in err


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "gsm8k"], "--configs: expected one or more config files"),
    (["--configs", AR, "--dataset", "gsm8k", "--llama-server", "x"], "--llama-server x: only with --concurrency"),
    (["--configs", AR, "--dataset", "gsm8k", "--concurrency", "1", "--limit", "1", "--llama-server", "off"],
     "--concurrency: no contender is served over HTTP"),
    (["--served-configs", HYBRID, "--dataset", "gsm8k", "--concurrency", "1", "--backend", "sglang"],
     "--backend sglang: --concurrency measures servers"),
])
def test_load_run_errors_are_one_line(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().splitlines()[-1].startswith("adaptivespec: error:"), err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_llama_server_is_found_named_or_skipped(tmp_path, monkeypatch):
    monkeypatch.delenv(load_contenders.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    binary, why = find_llama_server(None)
    assert binary is None and "no llama-server on PATH" in why and "--llama-server" in why
    assert find_llama_server("off") == (None, "--llama-server off")
    with pytest.raises(AdaptiveSpecError, match="--llama-server: /nope/llama-server: expected the path of an executable"):
        find_llama_server("/nope/llama-server")
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_llama_server(None) == (str(exe), "PATH")
    monkeypatch.setenv(load_contenders.LLAMA_SERVER_ENV, "/nope/x")
    with pytest.raises(AdaptiveSpecError, match=load_contenders.LLAMA_SERVER_ENV):
        find_llama_server(None)


def test_serve_accepts_reads_the_serve_parser():
    assert serve_accepts("--queue-size") and not serve_accepts("--no-such-flag")


# -- a whole run against stand-in servers ----------------------------------------------------------------
@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Every server the run starts is tests/fake_load_server.py (with the real server's flags); each
    reports its pid and the most requests it had in flight to a folder; returns that folder."""
    from adaptivespec.server.launch import torch_command
    from adaptivespec.sglang import server as sglang_server

    folder = tmp_path / "fakes"
    folder.mkdir()
    monkeypatch.setenv("FAKE_LOAD_DIR", str(folder))
    monkeypatch.setattr(served_contenders, "torch_command",
                        lambda config, port, **kw: [sys.executable, str(FAKE), *torch_command(config, port, **kw)[1:]])
    monkeypatch.setattr(sglang_server, "peer_command", lambda mode, port, extra_args=(), **kw: (
        [sys.executable, str(FAKE), "--mode", mode, "--port", str(port), *extra_args], dict(os.environ)))
    llama = tmp_path / "bin" / "llama-server"
    llama.parent.mkdir()
    llama.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    llama.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv(load_contenders.LLAMA_MODEL_ENV, str(model))
    monkeypatch.setattr(load_contenders, "serve_accepts", lambda flag: flag == "--parallel")  # a batching server
    return folder, str(llama)


def _servers(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_load_run_measures_every_served_contender_at_every_level(fakes, tmp_path, capsys):
    folder, llama = fakes
    out = tmp_path / "run"
    rc = main(["bench", "--configs", AR, "--served-configs", HYBRID, "--peers", "sglang,hf-generate",
               "--llama-server", llama, "--dataset", "gsm8k", "--limit", "3", "--max-new-tokens", "6",
               "--concurrency", "1,2", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "bench: ar skipped: runs in process" in captured.err and "bench: hf-generate skipped" in captured.err
    res = json.loads((out / "load.json").read_text())
    names = ["hybrid-served", "sglang", "llama-server"]
    assert list(res["contenders"]) == names and set(res["skipped"]) == {"ar", "hf-generate"}
    assert [(r["concurrency"], r["contender"]) for r in res["levels"]] == schedule(names, (1, 2))
    meta = res["meta"]
    assert meta["levels"] == [1, 2] and meta["prompts"] == 3 and meta["max_new_tokens"] == 6
    for r in res["levels"]:
        assert r["requests_answered"] >= 3 and r["requests_sent"] >= r["requests_answered"]
        assert r["tokens"] >= 6 * r["requests_answered"] and r["total_tokens_per_second"] > 0
        assert r["per_request_tokens_per_second"] > 0 and r["itl_p50_ms"] > 0 and r["ttft_p50_ms"] > 0
    torch_argv = res["contenders"]["hybrid-served"]["argv"]
    assert torch_argv[torch_argv.index("--parallel") + 1] == "2" and torch_argv[torch_argv.index("--queue-size") + 1] == "16"
    assert res["contenders"]["hybrid-served"]["parallel"] == 2
    llama_argv = res["contenders"]["llama-server"]["argv"]
    assert llama_argv[0] == llama and llama_argv[llama_argv.index("--parallel") + 1] == "2"
    # three servers, each started once, each saw 2 requests in flight at level 2, all stopped
    servers = _servers(folder)
    assert len(servers) == 3 and all(s["max_in_flight"] == 2 for s in servers)
    assert sorted(p for s in servers for p in s["paths"]) == ["/completion", "/generate", "/v1/completions"]
    assert not any(_alive(s["pid"]) for s in servers)
    # each pass (warm-up, measured) starts with the prefix caches emptied; what each server said it took from its cache
    flushes = {next(iter(s["paths"])): s["flushes"] for s in servers}
    assert flushes == {"/v1/completions": 4, "/generate": 4, "/completion": 0}
    shares = {r["contender"]: r["prompt_cached_share"] for r in res["levels"] if r["concurrency"] == 2}
    assert shares["hybrid-served"] == pytest.approx(0.5, abs=0.05) and shares["sglang"] == pytest.approx(0.25, abs=0.05)
    assert shares["llama-server"] is None
    # the table, printed and written, and the plot
    table = (out / "load.md").read_text()
    assert "Prompt tokens taken from the server's prefix cache" in table and "| `llama-server` | – | – |" in table
    assert "| contender | 1 in flight | 2 in flight |" in table and "| `hybrid-served` |" in table
    assert table.strip() in captured.out
    assert (out / "load.png").read_bytes()[:8] == PNG_MAGIC


def test_structured_prompts_are_sent_with_their_own_response_format(fakes, tmp_path, capsys):
    """--dataset structured under load: every request to every server carries its prompt's JSON schema
    (ours as response_format, SGLang's as its json_schema sampling parameter, llama-server's as json_schema)."""
    folder, llama = fakes
    out = tmp_path / "run"
    rc = main(["bench", "--served-configs", HYBRID, "--peers", "sglang", "--llama-server", llama, "--dataset",
               "structured", "--limit", "2", "--max-new-tokens", "4", "--concurrency", "1", "--out", str(out),
               "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    servers = _servers(folder)
    assert len(servers) == 3 and all(s["formats"] == s["served"] > 0 for s in servers), servers
    res = json.loads((out / "load.json").read_text())
    assert res["meta"]["constrained"] == res["meta"]["prompts"] == 2
    assert "constrained by its prompt's own response format" in (out / "load.md").read_text()


def test_a_failing_server_stops_the_run_with_one_line_and_every_server(fakes, tmp_path, monkeypatch, capsys):
    folder, llama = fakes
    monkeypatch.setenv("FAKE_LOAD_FAIL_AFTER", "3")  # its timed pass's second request
    rc = main(["bench", "--served-configs", HYBRID, "--peers", "sglang", "--llama-server", "off", "--dataset", "gsm8k",
               "--limit", "2", "--max-new-tokens", "4", "--concurrency", "1", "--out", str(tmp_path / "run"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "hybrid-served: /v1/completions returned 500" in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    servers = _servers(folder)
    assert len(servers) == 2 and not any(_alive(s["pid"]) for s in servers)
