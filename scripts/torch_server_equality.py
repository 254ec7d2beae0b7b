"""Served greedy output equals ``adaptivespec generate`` for every shipped config (float32).

For each ``configs/*.yaml``: the engine ``generate`` builds (``Engine(config)``) and the torch
server's app (``Engine(config, structured=True)`` behind :func:`adaptivespec.server.app.build_app`,
in process through FastAPI's TestClient) answer the same prompts greedily; the texts must be equal
(free text, and one ``json_schema`` request). Lossy configs are reported too: their rule is
deterministic, so they are expected to match as well. Prints one line per config and a summary;
exit status 1 when a strict config differs::

    python scripts/torch_server_equality.py [--tokens 24] [configs/hybrid.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from shared_prompts import PROMPTS  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def check(path: Path, tokens: int) -> tuple[bool, bool, str]:
    """(lossless, all equal, detail) of one config."""
    from fastapi.testclient import TestClient

    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.response_format import ResponseFormat
    from adaptivespec.server.app import Service, build_app
    from adaptivespec.server.metrics import ServerMetrics
    from adaptivespec.server.worker import Worker

    config = load_config(path, ["runtime.dtype=float32"])
    reference = Engine(config)
    served = Engine(config, structured=True)
    metrics = ServerMetrics()
    service = Service(engine=served, worker=Worker(served, 2, metrics), metrics=metrics, model=path.stem)
    fmt = ResponseFormat(type="json_schema", schema=SCHEMA)
    cases = [(p, None, tokens) for p in PROMPTS[:2]] + [("Give me a person record.", fmt, 2 * tokens)]
    same = 0
    with TestClient(build_app(service)) as client:
        for prompt, rf, n in cases:
            want = reference.generate(prompt, max_new_tokens=n, response_format=rf).text
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
            if rf is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            r = client.post("/v1/chat/completions", json=body)
            got = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text}"
            same += got == want
    return reference.lossless, same == len(cases), f"{same}/{len(cases)} equal"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="configs (default: every configs/*.yaml)")
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens of the free-text prompts (default 24)")
    args = ap.parse_args(argv)
    paths = [Path(c) for c in args.configs] or sorted((ROOT / "configs").glob("*.yaml"))
    failed = []
    for path in paths:
        try:
            lossless, ok, detail = check(path, args.tokens)
        except Exception as exc:  # a plugin not installed here, a config that does not load
            print(f"{path.name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})", flush=True)
            continue
        print(f"{path.name}: {'lossless' if lossless else 'lossy'}: {detail}", flush=True)
        if lossless and not ok:
            failed.append(path.name)
    print(json.dumps({"strict_configs_differing": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
