"""``adaptivespec serve``: one front door over both engines.

The command's flags are assembled here: the common ones, then each engine's own, which the engine
declares (:func:`adaptivespec.sglang.serve.add_sglang_arguments` with
:data:`~adaptivespec.sglang.serve.SGLANG_ONLY`; :func:`adaptivespec.server.launch.add_runtime_arguments`
with :data:`~adaptivespec.server.launch.TORCH_ONLY`). Then the runtime is chosen and the command
handed over:

* ``--runtime sglang``: SGLang's server with adaptivespec's plugin in its EAGLE-3 worker
  (:func:`adaptivespec.sglang.serve.run_sglang`: it replaces this process; ``--print-command``
  prints the command instead);
* ``--runtime torch``: adaptivespec's own engine behind an OpenAI-compatible server, in this process
  (:func:`adaptivespec.server.launch.run_torch`);
* ``--runtime llamacpp``: the same server with the config on the llama.cpp runtime (the target a GGUF
  file: docs/llamacpp.md), one generation at a time (``--parallel`` above 1 is not built on it yet: a
  one-line error);
* ``--runtime auto`` (the default): a flag only one runtime has picks that one; otherwise SGLang where
  it can serve here (:func:`adaptivespec.sglang.platform.sglang_unavailable_reason` says None) and can
  serve the config (a draft head for its sources), else torch.

A flag of the runtime not chosen is a one-line error. The first line ``serve`` prints says which
runtime started and why::

    adaptivespec serve: runtime torch (sglang not installed) on http://127.0.0.1:30000

The two engines never import each other, nor this module; the speculation metrics both export on
``/metrics`` live below them (:mod:`adaptivespec.metrics`).
"""

from __future__ import annotations

import argparse

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.server.launch import TORCH_ONLY, add_runtime_arguments, run_torch
from adaptivespec.sglang.platform import sglang_unavailable_reason
from adaptivespec.sglang.serve import SGLANG_ONLY, add_sglang_arguments, run_sglang
from adaptivespec.sglang.served_config import unservable

RUNTIMES = ("auto", "sglang", "torch", "llamacpp")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The ``serve`` subcommand: the common flags, then SGLang's and the torch runtime's, each in
    its own group of ``--help``."""
    p = subparsers.add_parser("serve", help="serve the config over OpenAI-compatible HTTP: SGLang's server with the "
                                            "config's tree policy and verifier (CUDA, or a CPU with AMX), or "
                                            "adaptivespec's torch engine (--runtime torch)")
    p.add_argument("--config", required=True, help="YAML config (its policy and verifier are served)")
    p.add_argument("--target", help="target model folder or Hugging Face id (default: the config's model.target)")
    p.add_argument("--drafter", help="EAGLE-3 drafter folder or Hugging Face id (default: the config's model.drafter)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default: %(default)s)")
    p.add_argument("--runtime", choices=RUNTIMES, default="auto",
                   help="sglang: SGLang's server with the plugin (batching; CUDA, or a CPU with AMX); torch: "
                        "adaptivespec's own engine behind an OpenAI-compatible server; llamacpp: that server on the "
                        "llama.cpp runtime (a GGUF target, one generation at a time); auto (default): sglang where "
                        "it can serve here, else torch; a flag only one runtime has picks that one")
    p.add_argument("--no-metrics", action="store_true",
                   help="no /metrics: leave out SGLang's --enable-metrics (on by default) and the adaptivespec_* series")
    add_sglang_arguments(p.add_argument_group("SGLang's server (--runtime sglang)"))
    add_runtime_arguments(p.add_argument_group("the torch runtime (--runtime torch)"))
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Choose the runtime and hand ``serve`` over to it."""
    if args.sglang_args and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    runtime, why = choose_runtime(args)
    line = first_line(runtime, why, args.host, args.port)
    if runtime == "llamacpp":
        if (getattr(args, "parallel", None) or 1) > 1:
            raise AdaptiveSpecError(f"--parallel: {args.parallel} with --runtime llamacpp; expected 1 (the llama.cpp runtime "
                                    "serves one generation at a time; --runtime torch batches)")
        args.parallel = 1
        args.overrides = [*(args.overrides or []), "runtime.name=llamacpp"]
    return run_torch(args, line) if runtime in ("torch", "llamacpp") else run_sglang(args, line)


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest, None)
    return bool(value) if isinstance(value, (bool, list)) else value is not None


def choose_runtime(args: argparse.Namespace) -> tuple[str, str]:
    """(runtime, why) for ``serve``'s arguments; a flag of the other runtime is a one-line error."""
    sglang_flags = [flag for dest, flag in SGLANG_ONLY.items() if _given(args, dest)]
    torch_flags = [flag for dest, flag in TORCH_ONLY.items() if _given(args, dest)]
    runtime = getattr(args, "runtime", "auto") or "auto"
    if runtime == "auto":
        if sglang_flags and not torch_flags:
            return "sglang", f"{sglang_flags[0]} is SGLang's"
        if torch_flags and not sglang_flags:
            return "torch", f"{torch_flags[0]} is the torch runtime's"
        reason = sglang_reason() or sglang_cannot_serve(getattr(args, "config", None))
        runtime, why = ("torch", reason.rstrip(".")) if reason else ("sglang", "sglang can serve here")
    else:
        why = f"--runtime {runtime}"
    wrong = torch_flags if runtime == "sglang" else sglang_flags
    if wrong:
        other = "torch" if runtime == "sglang" else "sglang"  # (llamacpp is served by the torch runtime's server)
        raise AdaptiveSpecError(f"{wrong[0]}: only with --runtime {other} (serving with the {runtime} runtime: {why}); "
                                "drop the flag or pass --runtime " + other)
    return runtime, why


def sglang_reason() -> str | None:
    """Why SGLang cannot serve here (None: it can)."""
    return sglang_unavailable_reason(None)


def sglang_cannot_serve(config: str | None) -> str | None:
    """Why SGLang cannot serve this config (sources without a draft head), None where it can or the
    config does not load (``serve`` then reports that as it would)."""
    if config is None:
        return None
    try:
        reason = unservable(config)
    except AdaptiveSpecError:
        return None
    return reason and "SGLang's worker needs a draft head for this config's sources"


def first_line(runtime: str, why: str, host: str, port: int) -> str:
    """The line ``serve`` prints first: which runtime it started and why."""
    return f"adaptivespec serve: runtime {runtime} ({why}) on http://{host}:{port}"
