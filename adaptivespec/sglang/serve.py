"""``adaptivespec serve``: SGLang's HTTP server running adaptivespec's policy and verifier.

Builds ``python -m sglang.launch_server ... --speculative-algorithm EAGLE3`` with the speculative
flags set to the policy's largest shape (the start-up state every other shape's buffers fit in),
and points the SGLang plugin at the config through ``ADAPTIVESPEC_CONFIG``::

    adaptivespec serve --config configs/dcs-margin.yaml --target meta-llama/Llama-3.1-8B-Instruct \\
        --drafter yuhuili/EAGLE3-LLaMA3.1-Instruct-8B [--print-command] [-- --mem-fraction-static 0.8]

With the embedded pair (``model.target: smollm2-135m-instruct``, ``model.drafter: embedded``) no
flag is needed: SGLang gets the converted safetensors folder in the adaptivespec cache and the
shipped head folder.

``serve``'s front door (:mod:`adaptivespec.serve`) assembles the command from this module's flags
(:func:`add_sglang_arguments`) and the torch runtime's, chooses the runtime and, for SGLang, hands
over to :func:`run_sglang`. This module never imports the torch runtime's server.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Mapping, Sequence

from adaptivespec.constraints import sglang_sampling_params
from adaptivespec.costmodel import CostModel, resolve_profile
from adaptivespec.drafter import resolve_drafter_path
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.models import EMBEDDED, embedded_folder
from adaptivespec.sglang import CONFIG_ENV, LOAD_PROFILE_ENV, METRICS_ENV, PLUGIN_NAME, TRACE_ENV, VERIFY_BUDGET_ENV
from adaptivespec.sglang.controller import step_level_notice
from adaptivespec.sglang.platform import CPU_MODE_ENV, cpu_args, cpu_env, detect_device, preflight
from adaptivespec.sglang.served_config import ServedConfig, served_config, unservable  # noqa: F401 - re-exported
from adaptivespec.types import TreeShape

SERVED_CPU_PROFILE = "sglang-cpu-smollm2-135m-bf16.json"
"""The shipped cost profile of the embedded pair served by SGLang's CPU backend (bf16), fitted from
a served trace on training prompts (``python -m adaptivespec.analysis.served_cost``)."""


def bank_shapes(config: "str | Path | ServedConfig") -> tuple[tuple[TreeShape, ...], TreeShape]:
    """The config's policy shapes as SGLang runs them (:func:`~adaptivespec.sglang.shapes.sglang_shape`)
    and the largest, which the server starts at."""
    bank = served_config(config).bank()
    return bank.shapes, bank.max_shape()


def _target_path(config: "str | Path | ServedConfig", target: str | None) -> str:
    """The target SGLang loads: the embedded target is its converted safetensors folder (converted
    first if needed, as ``generate`` does)."""
    target = target or served_config(config).config.model.target
    return str(embedded_folder()) if target == EMBEDDED else target  # the GGUF is an adaptivespec-only alias


def _model_paths(config: "str | Path | ServedConfig", target: str | None, drafter: str | None) -> tuple[str, str]:
    """Paths SGLang loads: the embedded target is its converted safetensors folder (converted
    first if needed, as ``generate`` does), ``embedded`` the shipped head's folder."""
    model = served_config(config).config.model
    target = _target_path(config, target)
    drafter = drafter or model.drafter
    if drafter is None:
        raise AdaptiveSpecError(
            f"--drafter: SGLang needs an EAGLE-3 checkpoint folder or Hugging Face id (the config says {drafter!r})"
        )
    if drafter == "embedded":
        drafter = str(resolve_drafter_path(drafter))
    return target, drafter


def sampling_args(config: "str | Path | ServedConfig", extra_args: Sequence[str] = ()) -> list[str]:
    """SGLang flags for the config's sampling settings, or a refusal where SGLang cannot serve them.

    SGLang samples with its own tree-sampling verify kernel (lossless, the rule of the ``strict``
    verifier) and the plugin keeps the policy adapting. A lossy verifier (``margin``: its class says
    ``lossless = False``) has no form in that kernel: at ``generation.temperature > 0`` the
    combination is refused rather than served as something else. With a lossless verifier, the
    settings become the server's default sampling parameters (``--preferred-sampling-params``; each
    request may still set its own), unless the extra arguments already pass that flag. A
    ``generation.response_format`` joins them as SGLang's own constrained-decoding parameter
    (``json_schema``, ``regex`` or ``ebnf``: its grammar backend, xgrammar by default, masks the
    tree): the default of requests that set none.
    """
    sc = served_config(config)
    g = sc.config.generation
    fmt = sglang_sampling_params(g.response_format) if g.response_format is not None and "--preferred-sampling-params" not in extra_args else {}
    if g.temperature == 0:
        return ["--preferred-sampling-params", json.dumps(fmt)] if fmt else []
    if not sc.verifier_cls.lossless:
        raise AdaptiveSpecError(
            f"{sc.path}: verifier {sc.config.verifier.name!r} at generation.temperature {g.temperature}: SGLang samples "
            "with its own lossless tree-sampling kernel, where this rule has no form; serve it at temperature 0 or "
            "with verifier strict"
        )
    if "--preferred-sampling-params" in extra_args:
        return []
    params = {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k or -1, "min_p": g.min_p or 0.0, **fmt}
    return ["--preferred-sampling-params", json.dumps(params)]


def build_command(
    config: "str | Path | ServedConfig",
    target: str | None = None,
    drafter: str | None = None,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra_args: Sequence[str] = (),
    *,
    overlap: bool = False,
    metrics: bool = True,
    python: str | None = None,
    device: str | None = None,
) -> list[str]:
    """argv of the SGLang server (``target`` / ``drafter`` default to the config's ``model``).

    ``overlap=False`` adds ``--disable-overlap-schedule``: the policy then sees each step's accept
    length before it picks the next shape, as in the paper (the shape choice reads the draft's
    top-1 probability on the host every step anyway). ``metrics`` adds ``--enable-metrics``
    (SGLang's ``/metrics``, where the worker's ``adaptivespec_*`` series join SGLang's own; see
    :mod:`adaptivespec.sglang.metrics`). ``extra_args`` go last, verbatim. ``device``: ``cuda`` or
    ``cpu`` (default: :func:`~adaptivespec.sglang.platform.detect_device`); on ``cpu`` the flags of
    :func:`~adaptivespec.sglang.platform.cpu_args` come before ``extra_args``.
    """
    sc = served_config(config)
    sampling = sampling_args(sc, extra_args)
    if sc.config.autoregressive:  # plain decoding: SGLang alone, no speculative worker
        target = _target_path(sc, target)
        argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", target,
                "--host", host, "--port", str(port)]
    else:
        _, top = bank_shapes(sc)
        target, drafter = _model_paths(sc, target, drafter)
        argv = [
            python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", target,
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", drafter,
            "--speculative-num-steps", str(top.nsteps),
            "--speculative-eagle-topk", str(top.topk),
            "--speculative-num-draft-tokens", str(top.ndt),
            "--host", host,
            "--port", str(port),
        ]
    if not overlap and not sc.config.autoregressive:  # plain decoding has no policy to feed: SGLang's default
        argv.append("--disable-overlap-schedule")
    if metrics and "--enable-metrics" not in extra_args:
        argv.append("--enable-metrics")
    if (device or detect_device()) == "cpu":
        argv += cpu_args(target, extra_args)
    return argv + sampling + list(extra_args)


def load_profile(config: "str | Path | ServedConfig", value: str | None = None, *, device: str | None = None) -> Path | None:
    """The cost profile the served controller shrinks trees under load with (``serve
    --load-profile``): ``value`` a file or a shipped profile name, ``none`` for no load model, or
    ``auto``/None: the shipped :data:`SERVED_CPU_PROFILE` when serving the embedded target on a CPU
    with a policy that adapts its shape (``adapts_shape``; ``static`` does not: it is the baseline), else none."""
    if value is not None and value.lower() == "none":
        return None
    if value is None or value.lower() == "auto":
        sc = served_config(config)
        if ((device or detect_device()) != "cpu" or sc.config.model.target != EMBEDDED or not sc.policy.adapts_shape
                or sc.config.autoregressive):
            return None
        value = SERVED_CPU_PROFILE
    try:
        path = resolve_profile(value, SERVED_CPU_PROFILE, "--load-profile")
        CostModel.load(path)
    except ValueError as exc:
        raise AdaptiveSpecError(str(exc)) from None
    return path.resolve()


def build_env(config: "str | Path | ServedConfig", base: Mapping[str, str] | None = None, *, device: str | None = None,
              trace: str | Path | None = None, verify_budget: int | None = None,
              load_profile: str | Path | None = None, metrics: bool = True) -> dict[str, str]:
    """The server's environment: ``ADAPTIVESPEC_CONFIG`` (absolute), and our plugin added to
    ``SGLANG_PLUGINS`` when that whitelist is set (unset, SGLang loads every plugin); on a CPU
    (``device``, default :func:`~adaptivespec.sglang.platform.detect_device`) the CPU engine's;
    ``trace``: the per-step trace file (:data:`~adaptivespec.sglang.TRACE_ENV`); ``verify_budget`` and
    ``load_profile``: the load-aware controls (resolve the profile with :func:`load_profile`);
    ``metrics=False``: the worker writes no ``adaptivespec_*`` series."""
    path = config.path if isinstance(config, ServedConfig) else Path(config)
    env = dict(os.environ if base is None else base)
    if (device or detect_device()) == "cpu":
        env = cpu_env(env)
    if trace is not None:
        env[TRACE_ENV] = str(Path(trace).resolve())
    if verify_budget is not None:
        env[VERIFY_BUDGET_ENV] = str(verify_budget)
    if load_profile is not None:
        env[LOAD_PROFILE_ENV] = str(Path(load_profile).resolve())
    if not metrics:
        env[METRICS_ENV] = "0"
    if served_config(config).config.autoregressive:
        return env  # plain decoding: the plugin stays out (it acts only where the config is set)
    env[CONFIG_ENV] = str(path.resolve())
    allowed = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        env["SGLANG_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


def refuse_unservable(config: "str | Path | ServedConfig") -> ServedConfig:
    """Raise for what SGLang cannot serve; print one notice for a policy served by its shape choice
    only. Returns the config read."""
    sc = served_config(config)
    reason = unservable(sc)
    if reason:
        raise AdaptiveSpecError(f"cannot serve {reason}")
    notice = step_level_notice(sc.policy)
    if notice:
        print(f"adaptivespec serve: note: {notice}", file=sys.stderr)
    return sc


def command_and_env(args: argparse.Namespace, base: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of ``serve``'s arguments, the config read once."""
    sc = refuse_unservable(args.config)
    metrics = not getattr(args, "no_metrics", False)
    extra = list(args.sglang_args or ())
    context = getattr(args, "context_length", None)
    if context and "--context-length" not in extra:  # SGLang's own flag
        extra += ["--context-length", str(context)]
    argv = build_command(sc, args.target, args.drafter, args.host, args.port, extra, overlap=args.overlap,
                         metrics=metrics)
    env = build_env(sc, base, trace=args.trace, verify_budget=args.verify_budget,
                    load_profile=load_profile(sc, args.load_profile), metrics=metrics)
    return argv, env


def serve(args: argparse.Namespace) -> None:
    """Replace this process with the SGLang server (returns only by raising)."""
    argv, env = command_and_env(args)
    preflight()
    os.execvpe(argv[0], argv, env)


# -- serve's SGLang side ----------------------------------------------------------------------------
SGLANG_ONLY = {"overlap": "--overlap", "trace": "--trace", "verify_budget": "--verify-budget",
               "load_profile": "--load-profile", "print_command": "--print-command", "sglang_args": "-- SGLANG_ARGS"}
"""``serve`` flags (argparse dest: flag) that only SGLang's server has."""


def add_sglang_arguments(p) -> None:
    """``serve``'s flags that only SGLang's server has (:data:`SGLANG_ONLY`), onto a parser or group."""
    p.add_argument("--overlap", action="store_true",
                   help="keep SGLang's overlap scheduler (the policy then sees accept lengths one step late)")
    p.add_argument("--trace", metavar="PATH",
                   help="append one JSON line per decode step (shape, batch size, accepted) to PATH")
    p.add_argument("--verify-budget", type=int, metavar="ROWS",
                   help="load-aware trees: when batch size x ndt would exceed ROWS verified rows per step, run a "
                        "smaller bank shape (down to one drafted token); default: no cap")
    p.add_argument("--load-profile", metavar="PROFILE",
                   help="load-aware trees from the served step's cost profile (a file or a shipped profile name): at "
                        "batch > 1 the controller runs the bank shape expected to give the most tokens/s; 'none' turns "
                        f"it off; default 'auto': {SERVED_CPU_PROFILE} for adaptive policies on the embedded pair on a "
                        "CPU, else none")
    p.add_argument("--print-command", action="store_true", help="print the environment and command, run nothing")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, metavar="-- SGLANG_ARGS",
                   help="further sglang.launch_server arguments, after --")


def format_command(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One shell line: the plugin's environment variables, then the command."""
    keys = (CONFIG_ENV, "SGLANG_PLUGINS", TRACE_ENV, VERIFY_BUDGET_ENV, LOAD_PROFILE_ENV, METRICS_ENV, "SGLANG_USE_CPU_ENGINE", "SGLANG_CPU_OMP_THREADS_BIND", "LD_PRELOAD",
            CPU_MODE_ENV, "PYTHONPATH")
    shown = [f"{k}={shlex.quote(env[k])}" for k in keys if k in env]
    return " ".join(shown + [shlex.join(argv)])


def run_sglang(args: argparse.Namespace, first_line: str) -> int:
    """``serve --runtime sglang``: print the environment and command (``--print-command``), or print
    ``first_line`` (which runtime and why) and replace this process with SGLang's server."""
    if args.print_command:
        argv, env = command_and_env(args, {k: v for k, v in os.environ.items() if k == "SGLANG_PLUGINS"})
        print(format_command(argv, env))
        return 0
    print(first_line, file=sys.stderr, flush=True)
    serve(args)
    return 0
