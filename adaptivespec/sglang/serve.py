"""``adaptivespec serve``: SGLang's HTTP server running adaptivespec's policy and verifier.

Builds ``python -m sglang.launch_server ... --speculative-algorithm EAGLE3`` with the speculative
flags set to the policy's largest shape (the start-up state every other shape's buffers fit in),
and points the SGLang plugin at the config through ``ADAPTIVESPEC_CONFIG``::

    adaptivespec serve --config configs/dcs-margin.yaml --target meta-llama/Llama-3.1-8B-Instruct \\
        --drafter yuhuili/EAGLE3-LLaMA3.1-Instruct-8B [--print-command] [-- --mem-fraction-static 0.8]

With the embedded pair (``model.target: smollm2-135m-instruct``, ``model.drafter: embedded``) no
flag is needed: SGLang gets the converted safetensors folder in the adaptivespec cache and the
shipped head folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import Mapping, Sequence

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import CONFIG_ENV, PLUGIN_NAME
from adaptivespec.sglang.api import SGLANG_VERSION, check_api, installed_version
from adaptivespec.sglang.policy_bridge import ShapeStateBank, build_strategies, sglang_shapes
from adaptivespec.types import TreeShape

INSTALL_HINT = (f"install it on a CUDA machine with: pip install 'adaptivespec[sglang]' (sglang=={SGLANG_VERSION}); "
                "on a Xeon with AMX: scripts/install_sglang_cpu.sh")

TRACE_ENV = "ADAPTIVESPEC_SGLANG_TRACE"
"""Environment variable naming a JSON-lines file the plugin appends one record per decode step to
(``serve --trace``): the step's shape, batch size and accepted drafted tokens."""

VERIFY_BUDGET_ENV = "ADAPTIVESPEC_SGLANG_VERIFY_BUDGET"
"""Environment variable of ``serve --verify-budget``: the load-aware cap on verified rows per step."""

LOAD_PROFILE_ENV = "ADAPTIVESPEC_SGLANG_LOAD_PROFILE"
"""Environment variable of ``serve --load-profile``: the served step's cost profile (load-aware trees)."""

SERVED_CPU_PROFILE = "sglang-cpu-smollm2-135m-bf16.json"
"""The shipped cost profile of the embedded pair served by SGLang's CPU backend (bf16), fitted from
a served trace on training prompts (``python -m adaptivespec.analysis.served_cost``)."""

CPU_PRELOADS = ("libiomp5.so", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtbbmalloc.so.2")
"""Libraries SGLang's CPU recipe preloads (Intel OpenMP from the venv, tcmalloc, TBB's malloc); each
only where present."""

KV_BUDGET_BYTES = 1 << 30
"""At most this much memory (and 5% of the available memory) for the CPU server's KV cache."""


def detect_device() -> str:
    """``cuda`` when torch sees a CUDA device, else ``cpu`` (SGLang's Intel AMX backend)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX (``amx_bf16`` in /proc/cpuinfo): SGLang's CPU speculative path needs it."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def kv_tokens(target: str, available: int | None = None, budget: int = KV_BUDGET_BYTES) -> int:
    """``--max-total-tokens`` for a CPU server: the KV cache of ``target`` (a folder with a
    ``config.json``; bf16 K and V of every layer) in min(``budget``, 5% of the available memory),
    in multiples of 1024, at least 8192 (what one 8k-context request needs) and at most 262144.
    Without it SGLang sizes the cache as for a GPU (18 GB for the embedded model)."""
    import json

    per_token = 30 * 2 * 3 * 64 * 2  # the embedded model's, when the folder cannot be read
    try:
        c = json.loads((Path(target) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        per_token = c["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    avail = _available_memory() if available is None else available
    tokens = min(budget, avail // 20) // per_token // 1024 * 1024
    return max(8192, min(tokens, 262144))


def cpu_args(target: str, extra_args: Sequence[str] = ()) -> list[str]:
    """The flags a CPU server needs (those the user already passes after ``--`` are left out):
    ``--device cpu``, ``--dtype bfloat16`` (the draft otherwise runs float16 against a bf16 target
    and the AMX GEMM refuses the mix), ``--max-total-tokens`` (:func:`kv_tokens`) and
    ``--sleep-on-idle`` (an idle scheduler otherwise busy-polls 20-40% of a core, taken from
    whatever else runs on the machine; it wakes on the next request)."""
    given = {a.split("=", 1)[0] for a in extra_args if a.startswith("--")}
    for i, a in enumerate(extra_args):
        value = a.split("=", 1)[1] if a.startswith("--dtype=") else (
            extra_args[i + 1] if a == "--dtype" and i + 1 < len(extra_args) else None)
        if value in ("float32", "float"):
            raise AdaptiveSpecError(f"--dtype {value}: SGLang's CPU kernels run bfloat16 only (their RMSNorm has no "
                                    "float32 kernel); drop --dtype, serve picks bfloat16")
    out: list[str] = []
    for flag, value in (("--device", "cpu"), ("--dtype", "bfloat16"), ("--max-total-tokens", None)):
        if flag not in given:
            out += [flag, value if value is not None else str(kv_tokens(target))]
    if "--sleep-on-idle" not in given:
        out.append("--sleep-on-idle")
    return out


def cpu_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What SGLang's CPU engine reads: ``SGLANG_USE_CPU_ENGINE=1``, OpenMP threads bound to this
    process's CPUs (``SGLANG_CPU_OMP_THREADS_BIND``), and ``LD_PRELOAD`` of Intel OpenMP, tcmalloc
    and tbbmalloc where present. Values already in ``base`` are kept."""
    env = dict(os.environ if base is None else base)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["SGLANG_CPU_OMP_THREADS_BIND"] = _ranges(cpus)
    if "LD_PRELOAD" not in env:
        prefix = Path(sys.prefix) / "lib"
        libs = [str(prefix / p) if "/" not in p else p for p in CPU_PRELOADS]
        present = [p for p in libs if Path(p).is_file()]
        if present:
            env["LD_PRELOAD"] = ":".join(present)
    return env


def _ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = None
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


def unservable(config_path: str | Path) -> str | None:
    """What in the config SGLang's EAGLE-3 worker cannot run, as one sentence (None: servable).

    Candidate sources (``sources:``, e.g. ``retrieval``) add nodes to the drafted tree: SGLang builds
    its tree from the head's beam only, in its tree kernel, so they have no place there. Verifiers
    run through the plugin's ``eagle_sample`` hook (greedy batches)."""
    from adaptivespec.config import load_config

    config = load_config(config_path)
    if config.autoregressive:
        return (f"{config_path}: model.drafter is null (autoregressive): serve runs SGLang's EAGLE-3 worker; "
                "serve plain decoding with python -m sglang.launch_server")
    if config.sources:
        names = ", ".join(s.name for s in config.sources)
        return (f"{config_path}: sources [{names}]: SGLang's EAGLE-3 worker builds its tree from the draft head's "
                "beam only (no candidate-source hook); serve without sources (e.g. configs/cost-aware.yaml)")
    return None


def bank_shapes(config_path: str | Path) -> tuple[tuple[TreeShape, ...], TreeShape]:
    """The config's policy shapes as SGLang runs them (:func:`sglang_shape`) and the largest, which
    the server starts at."""
    from adaptivespec.config import load_config

    bank = ShapeStateBank(sglang_shapes(build_strategies(load_config(config_path))[0].shapes()))
    return bank.shapes, bank.max_shape()


def _model_paths(config_path: str | Path, target: str | None, drafter: str | None) -> tuple[str, str]:
    """Paths SGLang loads: the embedded target is its converted safetensors folder (converted
    first if needed, as ``generate`` does), ``embedded`` the shipped head's folder."""
    from adaptivespec.config import load_config
    from adaptivespec.drafter import resolve_drafter_path
    from adaptivespec.models import EMBEDDED, embedded_folder

    model = load_config(config_path).model
    target = target or model.target
    drafter = drafter or model.drafter
    if target == EMBEDDED:  # the GGUF is an adaptivespec-only alias; SGLang reads the converted folder
        target = str(embedded_folder())
    if drafter is None:
        raise AdaptiveSpecError(
            f"--drafter: SGLang needs an EAGLE-3 checkpoint folder or Hugging Face id (the config says {drafter!r})"
        )
    if drafter == "embedded":
        drafter = str(resolve_drafter_path(drafter))
    return target, drafter


def sampling_args(config_path: str | Path, extra_args: Sequence[str] = ()) -> list[str]:
    """SGLang flags for the config's sampling settings, or a refusal where SGLang cannot serve them.

    SGLang samples with its own tree-sampling verify kernel (lossless, the rule of the ``strict``
    verifier) and the plugin keeps the policy adapting. A lossy verifier (``margin``) has no form
    in that kernel: at ``generation.temperature > 0`` the combination is refused rather than
    served as something else. With ``strict``, the settings become the server's default sampling
    parameters (``--preferred-sampling-params``; each request may still set its own), unless the
    extra arguments already pass that flag. A ``generation.response_format`` joins them as
    SGLang's own constrained-decoding parameter (``json_schema``, ``regex`` or ``ebnf``: its
    grammar backend, xgrammar by default, masks the tree): the default of requests that set none.
    """
    import json

    from adaptivespec.config import load_config

    config = load_config(config_path)
    g = config.generation
    if g.response_format is not None and "--preferred-sampling-params" not in extra_args:
        from adaptivespec.constraints import sglang_sampling_params

        fmt = sglang_sampling_params(g.response_format)
    else:
        fmt = {}
    if g.temperature == 0:
        return ["--preferred-sampling-params", json.dumps(fmt)] if fmt else []
    if config.verifier.name != "strict":
        raise AdaptiveSpecError(
            f"{config_path}: verifier {config.verifier.name!r} at generation.temperature {g.temperature}: SGLang samples "
            "with its own lossless tree-sampling kernel, where this rule has no form; serve it at temperature 0 or "
            "with verifier strict"
        )
    if "--preferred-sampling-params" in extra_args:
        return []
    params = {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k or -1, "min_p": g.min_p or 0.0, **fmt}
    return ["--preferred-sampling-params", json.dumps(params)]


def build_command(
    config_path: str | Path,
    target: str | None = None,
    drafter: str | None = None,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra_args: Sequence[str] = (),
    *,
    overlap: bool = False,
    python: str | None = None,
    device: str | None = None,
) -> list[str]:
    """argv of the SGLang server (``target`` / ``drafter`` default to the config's ``model``).

    ``overlap=False`` adds ``--disable-overlap-schedule``: the policy then sees each step's accept
    length before it picks the next shape, as in the paper (the shape choice reads the draft's
    top-1 probability on the host every step anyway). ``extra_args`` go last, verbatim.
    ``device``: ``cuda`` or ``cpu`` (default: :func:`detect_device`); on ``cpu`` the flags of
    :func:`cpu_args` come before ``extra_args``.
    """
    _, top = bank_shapes(config_path)
    target, drafter = _model_paths(config_path, target, drafter)
    sampling = sampling_args(config_path, extra_args)
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
    if not overlap:
        argv.append("--disable-overlap-schedule")
    if (device or detect_device()) == "cpu":
        argv += cpu_args(target, extra_args)
    return argv + sampling + list(extra_args)


def load_profile(config_path: str | Path, value: str | None = None, *, device: str | None = None) -> Path | None:
    """The cost profile the served controller shrinks trees under load with (``serve
    --load-profile``): ``value`` a file or a shipped profile name, ``none`` for no load model, or
    ``auto``/None: the shipped :data:`SERVED_CPU_PROFILE` when serving the embedded target on a CPU
    with an adaptive policy (``static`` stays static: it is the baseline), else none."""
    from adaptivespec.config import load_config
    from adaptivespec.costmodel import CostModel, resolve_profile
    from adaptivespec.models import EMBEDDED

    if value is not None and value.lower() == "none":
        return None
    if value is None or value.lower() == "auto":
        config = load_config(config_path)
        if ((device or detect_device()) != "cpu" or config.model.target != EMBEDDED or config.policy.name == "static"
                or config.autoregressive):
            return None
        value = SERVED_CPU_PROFILE
    try:
        path = resolve_profile(value, SERVED_CPU_PROFILE, "--load-profile")
        CostModel.load(path)
    except ValueError as exc:
        raise AdaptiveSpecError(str(exc)) from None
    return path.resolve()


def build_env(config_path: str | Path, base: Mapping[str, str] | None = None, *, device: str | None = None,
              trace: str | Path | None = None, verify_budget: int | None = None,
              load_profile: str | Path | None = None) -> dict[str, str]:
    """The server's environment: ``ADAPTIVESPEC_CONFIG`` (absolute), and our plugin added to
    ``SGLANG_PLUGINS`` when that whitelist is set (unset, SGLang loads every plugin); on a CPU
    (``device``, default :func:`detect_device`) :func:`cpu_env`'s; ``trace``: the per-step trace
    file (:data:`TRACE_ENV`); ``verify_budget`` and ``load_profile``: the load-aware controls
    (:data:`VERIFY_BUDGET_ENV`, :data:`LOAD_PROFILE_ENV`; resolve the profile with :func:`load_profile`)."""
    env = dict(os.environ if base is None else base)
    if (device or detect_device()) == "cpu":
        env = cpu_env(env)
    if trace is not None:
        env[TRACE_ENV] = str(Path(trace).resolve())
    if verify_budget is not None:
        env[VERIFY_BUDGET_ENV] = str(verify_budget)
    if load_profile is not None:
        env[LOAD_PROFILE_ENV] = str(Path(load_profile).resolve())
    env[CONFIG_ENV] = str(Path(config_path).resolve())
    allowed = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        env["SGLANG_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


def preflight(device: str | None = None) -> None:
    """Fail in one line unless the installed SGLang is there and has the API the plugin needs
    (and, on a CPU, the CPU has AMX)."""
    if (device or detect_device()) == "cpu" and not cpu_has_amx():
        raise AdaptiveSpecError("no CUDA device and this CPU has no AMX (amx_bf16 in /proc/cpuinfo): SGLang's CPU "
                                "backend runs speculative decoding only with AMX; serve on a CUDA machine")
    if importlib.util.find_spec("sglang") is None:
        raise AdaptiveSpecError(f"sglang is not installed; {INSTALL_HINT}")
    problems = check_api()
    if problems:
        raise AdaptiveSpecError(
            f"the installed sglang {installed_version() or '?'} lacks what the plugin (written for "
            f"{SGLANG_VERSION}) needs: {'; '.join(problems)}"
        )
    version = installed_version()
    if version != SGLANG_VERSION:
        print(f"adaptivespec: warning: sglang {version} installed, the plugin is checked against {SGLANG_VERSION}", file=sys.stderr)


def serve(args: argparse.Namespace) -> None:
    """Replace this process with the SGLang server (returns only by raising)."""
    refuse_unservable(args.config)
    argv = build_command(args.config, args.target, args.drafter, args.host, args.port, args.sglang_args, overlap=args.overlap)
    env = build_env(args.config, trace=args.trace, verify_budget=args.verify_budget,
                    load_profile=load_profile(args.config, args.load_profile))
    preflight()
    os.execvpe(argv[0], argv, env)


def refuse_unservable(config_path: str | Path) -> None:
    """Raise for what SGLang cannot serve; print one notice for a policy served by its shape choice only."""
    reason = unservable(config_path)
    if reason:
        raise AdaptiveSpecError(f"cannot serve {reason}")
    from adaptivespec.config import load_config
    from adaptivespec.sglang.policy_bridge import step_level_notice

    notice = step_level_notice(build_strategies(load_config(config_path))[0])
    if notice:
        print(f"adaptivespec serve: note: {notice}", file=sys.stderr)


# -- CLI ------------------------------------------------------------------------------------------
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run SGLang's server with the config's tree policy and verifier "
                                            "(CUDA, or a CPU with AMX)")
    p.add_argument("--config", required=True, help="YAML config (its policy and verifier are served)")
    p.add_argument("--target", help="target model folder or Hugging Face id (default: the config's model.target)")
    p.add_argument("--drafter", help="EAGLE-3 drafter folder or Hugging Face id (default: the config's model.drafter)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default: %(default)s)")
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
    p.set_defaults(func=run_serve)
    return p


def format_command(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One shell line: the plugin's environment variables, then the command."""
    keys = (CONFIG_ENV, "SGLANG_PLUGINS", TRACE_ENV, VERIFY_BUDGET_ENV, LOAD_PROFILE_ENV, "SGLANG_USE_CPU_ENGINE", "SGLANG_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
    shown = [f"{k}={shlex.quote(env[k])}" for k in keys if k in env]
    return " ".join(shown + [shlex.join(argv)])


def run_serve(args: argparse.Namespace) -> int:
    if args.sglang_args and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    if args.print_command:
        refuse_unservable(args.config)
        argv = build_command(args.config, args.target, args.drafter, args.host, args.port, args.sglang_args, overlap=args.overlap)
        env = build_env(args.config, {k: v for k, v in os.environ.items() if k == "SGLANG_PLUGINS"}, trace=args.trace,
                        verify_budget=args.verify_budget, load_profile=load_profile(args.config, args.load_profile))
        print(format_command(argv, env))
        return 0
    serve(args)
    return 0
