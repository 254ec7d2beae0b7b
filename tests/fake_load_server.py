"""A stand-in for the three servers a load run starts (``adaptivespec serve --runtime torch``,
SGLang, ``llama-server``), run as its own process by tests/test_load.py: the same routes and
streamed chunk formats, each request ``max_tokens`` one-word tokens in chunks of 1 and 2 tokens; the
torch server says half of each prompt came from its prefix cache, SGLang a quarter, llama-server
nothing (``/flush_cache`` calls are counted).

Takes any of the real servers' arguments and reads ``--port`` only. Environment:
``FAKE_LOAD_DIR``: it writes ``<pid>.json`` there (its pid, the most requests it had in flight at
once, requests served) after every request; ``FAKE_LOAD_FAIL_AFTER=N``: requests after the N-th get
a 500."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LOCK = threading.Lock()
STATE = {"pid": os.getpid(), "in_flight": 0, "max_in_flight": 0, "served": 0, "paths": {}, "flushes": 0,
         "formats": 0}


def save() -> None:
    folder = os.environ.get("FAKE_LOAD_DIR")
    if folder:
        tmp = Path(folder) / f"{os.getpid()}.tmp"
        tmp.write_text(json.dumps(STATE))
        os.replace(tmp, tmp.with_suffix(".json"))  # whole, even if the process is stopped mid-write


def chunks(n: int) -> list[int]:
    """Tokens per chunk: 1, 2, 1, 2, ... summing to ``n``."""
    out, left, k = [], n, 0
    while left > 0:
        out.append(min(left, 1 + k % 2))
        left -= out[-1]
        k += 1
    return out


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, status: int, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path in ("/v1/models", "/health"):
            return self._json(200, {"data": [{"id": "fake"}], "status": "ok"})
        return self._json(404, {"error": {"message": "no such route"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path.startswith("/flush_cache"):
            with LOCK:
                STATE["flushes"] += 1
                save()
            return self._json(200, {})
        with LOCK:
            STATE["served"] += 1
            n_served = STATE["served"]
            STATE["in_flight"] += 1
            STATE["max_in_flight"] = max(STATE["max_in_flight"], STATE["in_flight"])
            STATE["paths"][self.path] = STATE["paths"].get(self.path, 0) + 1
            sp = body.get("sampling_params") or {}
            STATE["formats"] += bool(body.get("response_format") or body.get("json_schema") or sp.get("json_schema"))
        fail_after = int(os.environ.get("FAKE_LOAD_FAIL_AFTER") or 0)
        if fail_after and n_served > fail_after:
            self.done()
            return self._json(500, {"error": {"message": "the fake server fails on purpose"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.path == "/v1/completions":  # adaptivespec serve --runtime torch
            n = body["max_tokens"]
            events = [{"choices": [{"text": " w" * k, "finish_reason": None}]} for k in chunks(n)]
            events.append({"choices": [{"text": "", "finish_reason": "length"}], "usage": {
                "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}})
        elif self.path == "/generate":  # SGLang
            n, seen, events = body["sampling_params"]["max_new_tokens"], 0, []
            for k in chunks(n):
                seen += k
                events.append({"text": " w" * seen, "meta_info": {"completion_tokens": seen,
                                                                  "cached_tokens": len(body["input_ids"]) // 4}})
        else:  # llama-server /completion: a chunk per token
            n = body["n_predict"]
            events = [{"content": " w", "stop": False} for _ in range(n)]
            events.append({"content": "", "stop": True, "tokens_predicted": n})
        for e in events:
            time.sleep(0.002)
            self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.flush()
        self.done()  # before the end of the stream: the client's next request may follow at once
        self.wfile.write(b"data: [DONE]\n\n")

    def done(self) -> None:
        with LOCK:
            STATE["in_flight"] -= 1
            save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    save()
    server.serve_forever()


if __name__ == "__main__":
    main()
