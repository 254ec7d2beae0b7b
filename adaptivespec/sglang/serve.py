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
from adaptivespec.sglang.policy_bridge import ShapeStateBank, build_strategies
from adaptivespec.types import TreeShape

INSTALL_HINT = f"install it on a CUDA machine with: pip install 'adaptivespec[sglang]' (sglang=={SGLANG_VERSION})"


def bank_shapes(config_path: str | Path) -> tuple[tuple[TreeShape, ...], TreeShape]:
    """The config's policy shapes and the largest, which the server starts at."""
    from adaptivespec.config import load_config

    bank = ShapeStateBank(build_strategies(load_config(config_path))[0].shapes())
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
    extra arguments already pass that flag.
    """
    import json

    from adaptivespec.config import load_config

    config = load_config(config_path)
    g = config.generation
    if g.temperature == 0:
        return []
    if config.verifier.name != "strict":
        raise AdaptiveSpecError(
            f"{config_path}: verifier {config.verifier.name!r} at generation.temperature {g.temperature}: SGLang samples "
            "with its own lossless tree-sampling kernel, where this rule has no form; serve it at temperature 0 or "
            "with verifier strict"
        )
    if "--preferred-sampling-params" in extra_args:
        return []
    params = {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k or -1, "min_p": g.min_p or 0.0}
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
) -> list[str]:
    """argv of the SGLang server (``target`` / ``drafter`` default to the config's ``model``).

    ``overlap=False`` adds ``--disable-overlap-schedule``: the policy then sees each step's accept
    length before it picks the next shape, as in the paper (the shape choice reads the draft's
    top-1 probability on the host every step anyway). ``extra_args`` go last, verbatim.
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
    return argv + sampling + list(extra_args)


def build_env(config_path: str | Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``ADAPTIVESPEC_CONFIG`` (absolute), and our plugin added to
    ``SGLANG_PLUGINS`` when that whitelist is set (unset, SGLang loads every plugin)."""
    env = dict(os.environ if base is None else base)
    env[CONFIG_ENV] = str(Path(config_path).resolve())
    allowed = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        env["SGLANG_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


def preflight() -> None:
    """Fail in one line unless the installed SGLang is there and has the API the plugin needs."""
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
    argv = build_command(args.config, args.target, args.drafter, args.host, args.port, args.sglang_args, overlap=args.overlap)
    env = build_env(args.config)
    preflight()
    os.execvpe(argv[0], argv, env)


# -- CLI ------------------------------------------------------------------------------------------
def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run SGLang's server with the config's tree policy and verifier (CUDA)")
    p.add_argument("--config", required=True, help="YAML config (its policy and verifier are served)")
    p.add_argument("--target", help="target model folder or Hugging Face id (default: the config's model.target)")
    p.add_argument("--drafter", help="EAGLE-3 drafter folder or Hugging Face id (default: the config's model.drafter)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default: %(default)s)")
    p.add_argument("--overlap", action="store_true",
                   help="keep SGLang's overlap scheduler (the policy then sees accept lengths one step late)")
    p.add_argument("--print-command", action="store_true", help="print the environment and command, run nothing")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, metavar="-- SGLANG_ARGS",
                   help="further sglang.launch_server arguments, after --")
    p.set_defaults(func=run_serve)
    return p


def format_command(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One shell line: the plugin's environment variables, then the command."""
    shown = [f"{k}={shlex.quote(env[k])}" for k in (CONFIG_ENV, "SGLANG_PLUGINS") if k in env]
    return " ".join(shown + [shlex.join(argv)])


def run_serve(args: argparse.Namespace) -> int:
    if args.sglang_args and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    if args.print_command:
        argv = build_command(args.config, args.target, args.drafter, args.host, args.port, args.sglang_args, overlap=args.overlap)
        env = build_env(args.config, {k: v for k, v in os.environ.items() if k == "SGLANG_PLUGINS"})
        print(format_command(argv, env))
        return 0
    serve(args)
    return 0
