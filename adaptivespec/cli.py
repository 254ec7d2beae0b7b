"""Command line: ``adaptivespec generate | plugins | plot-trace | train-drafter | bench | sweep | serve | calibrate | soak``.

Every user error (config, arguments, paths, plugin names) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from adaptivespec import __version__, hardware
from adaptivespec.errors import AdaptiveSpecError

# Subcommands contributed by other modules: (module, function adding the subparser, which sets
# ``func`` through ``set_defaults``). A module missing from a partial installation is skipped.
EXTRA_COMMANDS = [
    ("adaptivespec.training.cli", "add_parser"),
    ("adaptivespec.training.policy_cli", "add_parser"),
    ("adaptivespec.analysis.post_draft_fit", "add_parser"),
    ("adaptivespec.evaluation.cli", "add_bench_parser"),
    ("adaptivespec.evaluation.cli", "add_sweep_parser"),
    ("adaptivespec.serve", "add_serve_parser"),
    ("adaptivespec.calibrate", "add_parser"),
    ("adaptivespec.evaluation.soak_cli", "add_soak_parser"),
]


class ArgParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SystemExit(_fail(f"{self.prog}: {message} (see --help)"))


def _fail(message: str) -> int:
    print(f"adaptivespec: error: {message}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# -- generate -------------------------------------------------------------------------------------
def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt or a JSONL file of prompts")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (a user message)")
    src.add_argument("--prompts", help='JSONL file, one {"prompt": ..., "id"?: ..., "seed"?: ..., "response_format"?: {...}} '
                     'per line (at temperature > 0 record i uses generation.seed + i unless it has its own "seed"; '
                     'a record\'s "response_format" replaces generation.response_format for it)')
    p.add_argument("--max-new-tokens", type=positive_int, help="override generation.max_new_tokens")
    p.add_argument("--runtime", metavar="NAME", help="run on this registered runtime (runtime.name): torch, llamacpp "
                   "(the target a GGUF file: --set model.target=PATH.gguf; the embedded target's shipped file by default), "
                   "or auto (llamacpp where installed and faster on this CPU, else torch: docs/llamacpp.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set verifier.kappa=0.5 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON line per prompt instead of streaming")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--trace", metavar="FILE.jsonl", help="write every decode step's record to this file")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE.json",
                     help="constrain the output to this JSON schema (generation.response_format={type: json_schema, schema: FILE})")
    fmt.add_argument("--regex", metavar="PATTERN",
                     help="constrain the output to this regular expression (generation.response_format={type: regex, pattern: ...})")
    p.set_defaults(func=run_generate)


def read_prompts(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise AdaptiveSpecError(f"--prompts: {path}: file not found")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AdaptiveSpecError(f"--prompts: {path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise AdaptiveSpecError(f'--prompts: {path}:{n}: expected an object with a string "prompt", got {line[:60]!r}')
        seed = item.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise AdaptiveSpecError(f'--prompts: {path}:{n}: "seed": expected a non-negative integer, got {seed!r}')
        if item.get("response_format") is not None:
            from adaptivespec.response_format import parse_response_format

            item["response_format"] = parse_response_format(item["response_format"], f"--prompts: {path}:{n}")
        prompts.append(item)
    if not prompts:
        raise AdaptiveSpecError(f"--prompts: {path}: no prompts in the file")
    return prompts


class _Streamer:
    """Prints decoded text as token ids arrive (decoding the whole output, printing the delta)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


def run_generate(args) -> int:
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    overrides = list(args.overrides)
    if args.max_new_tokens:
        overrides.append(f"generation.max_new_tokens={args.max_new_tokens}")
    if getattr(args, "runtime", None):
        overrides.append(f"runtime.name={args.runtime}")
    if getattr(args, "json_schema", None) is not None:
        overrides.append("generation.response_format=" + json.dumps({"type": "json_schema", "schema": args.json_schema}))
    if getattr(args, "regex", None) is not None:
        overrides.append("generation.response_format=" + json.dumps({"type": "regex", "pattern": args.regex}))
    config = load_config(args.config, overrides)
    prompts = [{"prompt": args.prompt}] if args.prompt is not None else read_prompts(args.prompts)
    engine = Engine(config, structured=any(item.get("response_format") is not None for item in prompts))
    describe = getattr(engine.runtime, "describe", None)  # a runtime that names what it ran (llamacpp: the GGUF file)
    ran = describe() if describe is not None else f"{config.runtime.name} {config.runtime.precision}"
    trace = open(args.trace, "w") if args.trace else None
    try:
        for i, item in enumerate(prompts):
            pid = item.get("id")
            seed = item.get("seed", config.generation.seed + i)
            on_step = None
            if trace is not None:
                def on_step(record, pid=pid):
                    trace.write(json.dumps({"id": pid, **record.to_dict()}) + "\n")
            streamer = None if args.json else _Streamer(engine.tokenizer)
            ids = engine.encode(item["prompt"], raw=args.raw)
            result = engine.generate_ids(ids, on_tokens=streamer, on_step=on_step, seed=seed,
                                         response_format=item.get("response_format"))
            s = result.stats
            if args.json:
                print(json.dumps({"id": pid, "text": result.text, "token_ids": result.token_ids, "stats": s}), flush=True)
            else:
                print(f"\n[{s['new_tokens']} tokens in {s['wall_seconds']:.2f} s ({s['prefill_seconds']:.2f} s to the first), "
                      f"{s['tokens_per_second']:.2f} tok/s, "
                      f"{s['target_forwards']} target forwards, accept length {s['accept_length_mean']:.2f}, "
                      f"{s['promoted_tokens']} promoted, {config.policy.name}+{config.verifier.name}"
                      f"{'' if engine.lossless else ' (lossy)'}, {ran} on {hardware.isa()}]", flush=True)
    finally:
        if trace is not None:
            trace.close()
    return 0


# -- plugins --------------------------------------------------------------------------------------
def add_plugins_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list every registered strategy and where it comes from")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=run_plugins)


def run_plugins(args) -> int:
    from adaptivespec.plugins import get_plugin_host

    host = get_plugin_host()
    entries = [e.to_dict() for e in host.entries()] + [f.to_dict() for f in host.failed]
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    rows = [("KIND", "NAME", "ACCEPTANCE", "PROVIDED BY", "DESCRIPTION")]
    rows += [(e["kind"], e["name"], {True: "lossless", False: "lossy", None: "-"}[e["lossless"]], e["provider"], e["description"]) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


# -- plot-trace -----------------------------------------------------------------------------------
def add_plot_trace_parser(sub) -> None:
    p = sub.add_parser("plot-trace", help="plot tree shape and accepted length over the steps of a trace")
    p.add_argument("trace", help="JSONL written by generate --trace")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.set_defaults(func=run_plot_trace)


def run_plot_trace(args) -> int:
    from adaptivespec.trace import plot_trace

    plot_trace(args.trace, args.output)
    print(f"wrote {args.output}")
    return 0


# -- main -----------------------------------------------------------------------------------------
def build_parser() -> ArgParser:
    parser = ArgParser(prog="adaptivespec", description="Per-step adaptive speculative decoding.")
    parser.add_argument("--version", action="version", version=f"adaptivespec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgParser, metavar="COMMAND")
    add_generate_parser(sub)
    add_plugins_parser(sub)
    add_plot_trace_parser(sub)
    for module, add in EXTRA_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
            continue
        if hasattr(mod, add):
            getattr(mod, add)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except AdaptiveSpecError as exc:
        return _fail(str(exc))
    except hardware.IsaCapError as exc:  # a malformed $ADAPTIVESPEC_CPU_ISA read before any config
        return _fail(str(exc))
    except KeyboardInterrupt:
        print("adaptivespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
