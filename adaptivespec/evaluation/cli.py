"""The ``bench`` and ``sweep`` subcommands (added to ``adaptivespec``'s parser by ``adaptivespec.cli``).

::

    adaptivespec bench --configs configs/ar.yaml configs/eagle3.yaml --dataset gsm8k --limit 20 \\
        --peers hf-generate,hf-prompt-lookup --out runs/gsm8k
    adaptivespec sweep --config configs/adaptivespec-lossy.yaml --param verifier.kappa=0.1,0.3,0.5 \\
        --dataset gsm8k --limit 20 --reference configs/eagle3.yaml
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from adaptivespec.cli import positive_int
from adaptivespec.evaluation.load import parse_levels


def _add_common(p: argparse.ArgumentParser) -> None:
    from adaptivespec.evaluation.datasets import DATASETS
    from adaptivespec.evaluation.spec import DEFAULT_MAX_NEW_TOKENS

    p.add_argument("--dataset", required=True, metavar="NAME", help=f"evaluation set: {', '.join(DATASETS)}")
    p.add_argument("--data", metavar="FILE.jsonl", help="read the dataset from this JSON-lines file (same fields)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="the first N problems only")
    p.add_argument("--categories", metavar="A,B", help="only these categories (specbench: mt_bench, translation, "
                   "summarization, qa, math_reasoning, rag; mtbench: its eight; math500: subjects; "
                   "structured: extract-bio, extract-plot, function-call)")
    p.add_argument("--per-category", type=positive_int, metavar="N",
                   help="the first N problems of each category (balanced small runs)")
    defaults = ", ".join(f"{k} {v}" for k, v in DEFAULT_MAX_NEW_TOKENS.items())
    p.add_argument("--max-new-tokens", type=positive_int, metavar="M", help=f"generation limit per prompt (default per dataset: {defaults})")
    p.add_argument("--out", metavar="DIR", help="run folder (resumable; default runs/<command>-...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key in every config, e.g. --set runtime.dtype=float32 (repeatable); "
                   "model.drafter=DIR leaves autoregressive configs (drafter: null) autoregressive")
    p.add_argument("--runtime", metavar="NAME", help="run every config on this registered runtime (runtime.name=NAME), "
                   "e.g. llamacpp (the target a GGUF file: docs/llamacpp.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark configs (and peers) on an evaluation set: speed, accuracy, retention")
    p.add_argument("--configs", nargs="+", default=[], metavar="FILE",
                   help="YAML configs; each is named by its file stem (required, except with --concurrency and --served-configs)")
    _add_common(p)
    p.add_argument("--peers", metavar="NAMES", help="comma-separated baselines run alongside: hf-generate, "
                   "hf-prompt-lookup (transformers); sglang, sglang-eagle3, sglang-ngram, sglang-adaptive (SGLang servers; sglang-adaptive is reported as not supported where it cannot start)")
    p.add_argument("--served-configs", nargs="+", default=[], metavar="FILE",
                   help="configs also run over HTTP, each served by `adaptivespec serve --runtime torch` (one server "
                        "per config, started and stopped by the bench), named <stem>-served: beside --configs on the "
                        "engine they measure what HTTP and streaming cost")
    p.add_argument("--backend", choices=("torch", "sglang"), default="torch",
                   help="run the configs on adaptivespec's torch engine (default) or served by SGLang with the "
                        "plugin (adaptivespec serve; one server per config, started and stopped by the bench)")
    p.add_argument("--concurrency", type=parse_levels, metavar="C1,C2,...",
                   help="measure the contenders served over HTTP (--served-configs, SGLang --peers, llama-server) "
                        "under load instead: at each level C, C streamed requests in flight at all times; prints "
                        "total and per-request tok/s and inter-token latency per contender and level, writes "
                        "load.json, load.md and load.png (e.g. 1,2,4,8,16)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="with --concurrency: llama.cpp's llama-server binary to measure beside the others (default: "
                        "$ADAPTIVESPEC_LLAMA_SERVER, else llama-server on PATH; off: leave it out)")
    p.set_defaults(func=run_bench_command)


def add_sweep_parser(sub) -> None:
    p = sub.add_parser("sweep", help="benchmark one config over the values of a numeric parameter (Pareto plot)")
    p.add_argument("--config", required=True, metavar="FILE", help="YAML config to sweep")
    p.add_argument("--param", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="parameter and values, e.g. verifier.kappa=0.1,0.3,0.5 (repeat for a grid)")
    p.add_argument("--reference", metavar="FILE", help="lossless reference config (default: --config with verifier: strict)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="leave out grid points whose config is invalid (e.g. a tree shape whose ndt exceeds what "
                        "nsteps and topk can draft) instead of stopping; they are listed")
    _add_common(p)
    p.set_defaults(func=run_sweep_command)


def _problems(args):
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.evaluation.categories import parse_categories, select
    from adaptivespec.evaluation.datasets import DATASETS, DatasetError, load_dataset
    from adaptivespec.evaluation.spec import DEFAULT_MAX_NEW_TOKENS

    if args.dataset not in DATASETS:
        raise AdaptiveSpecError(f"--dataset: unknown dataset {args.dataset!r}; expected one of: {', '.join(DATASETS)}")
    wanted = parse_categories(getattr(args, "categories", None))
    per_category = getattr(args, "per_category", None)
    chosen = wanted is not None or per_category is not None
    try:
        problems = load_dataset(args.dataset, args.data, None if chosen else args.limit)
    except DatasetError as exc:
        raise DatasetError(f"--data: {exc}" if args.data else str(exc)) from None
    if chosen:  # categories first, then --limit of what they leave
        problems = select(problems, wanted, per_category, args.dataset)[: args.limit]
    if not problems:
        raise AdaptiveSpecError(f"--dataset {args.dataset}: no problems in {args.data or 'the packaged file'}")
    max_new = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS.get(args.dataset, 1024)
    runtime = [f"runtime.name={args.runtime}"] if getattr(args, "runtime", None) else []
    return problems, max_new, [*args.overrides, *runtime, f"generation.max_new_tokens={max_new}"]


def _selection(args) -> dict:
    """``{"selection": ...}`` for ``results.json`` when --categories / --per-category chose the prompts."""
    if args.categories is None and args.per_category is None:
        return {}
    from adaptivespec.evaluation.categories import parse_categories

    return {"selection": {"categories": parse_categories(args.categories), "per_category": args.per_category}}


def _finish(results, out: Path, columns=()) -> int:
    from adaptivespec.evaluation.report import markdown

    print(markdown(results, list(columns)))
    plots = "speedup_retention.png, accept_lengths.png" + (", pareto.png" if "sweep" in results else "")
    plots += ", category_speedup.png" if results.get("categories") else ""
    print(f"wrote {out}/results.json, results.md, {plots}", file=sys.stderr)
    return 0


def run_bench_command(args) -> int:
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.evaluation.bench import run_bench
    from adaptivespec.evaluation.peers import parse_peers
    from adaptivespec.evaluation.spec import BenchSpec, Entry, load_bench_config

    levels = getattr(args, "concurrency", None)
    if getattr(args, "llama_server", None) and not levels:
        raise AdaptiveSpecError(f"--llama-server {args.llama_server}: only with --concurrency (a load run)")
    served = getattr(args, "served_configs", None) or []
    if not args.configs and not (levels and served):
        raise AdaptiveSpecError("--configs: expected one or more config files (only --concurrency with "
                                "--served-configs runs without them)")
    if levels and getattr(args, "backend", "torch") != "torch":
        raise AdaptiveSpecError(f"--backend {args.backend}: --concurrency measures servers the bench starts itself; "
                                "drop --backend")
    problems, max_new, overrides = _problems(args)
    entries = tuple(Entry(name=Path(c).stem, config=load_bench_config(c, overrides)) for c in args.configs)
    entries += tuple(Entry(name=Path(c).stem + "-served", config=load_bench_config(c, overrides), served=True)
                     for c in served)
    spec = BenchSpec(entries=entries, peers=parse_peers(args.peers), dataset=args.dataset, data=args.data,
                     limit=args.limit, max_new_tokens=max_new, extra=_selection(args),
                     backend=getattr(args, "backend", "torch"))
    if levels:
        from adaptivespec.evaluation.load_bench import LOAD_JSON, LOAD_MD, LOAD_PNG, markdown, run_load

        out = Path(args.out or f"runs/load-{args.dataset}")
        results = run_load(spec, problems, out, levels, llama_server=getattr(args, "llama_server", None),
                           progress=not args.no_progress, command=shlex.join(sys.argv))
        print(markdown(results))
        print(f"wrote {out}/{LOAD_JSON}, {LOAD_MD}, {LOAD_PNG}", file=sys.stderr)
        return 0
    out = Path(args.out or f"runs/bench-{args.dataset}")
    results = run_bench(spec, problems, out, progress=not args.no_progress)
    return _finish(results, out)


def run_sweep_command(args) -> int:
    from adaptivespec.evaluation.bench import run_bench
    from adaptivespec.evaluation.spec import BenchSpec
    from adaptivespec.evaluation.sweep import reference_entry, sweep_entries

    problems, max_new, overrides = _problems(args)
    points, params, skipped = sweep_entries(args.config, args.param, overrides, skip_invalid=args.skip_invalid)
    for s in skipped:
        print(f"sweep: skipped {s['point']}: {s['error']}", file=sys.stderr)
    ref = reference_entry(args.config, args.reference, overrides)
    spec = BenchSpec(entries=(ref, *points), dataset=args.dataset, data=args.data, limit=args.limit,
                     max_new_tokens=max_new, reference=ref.name, command="sweep", columns=tuple(params),
                     extra={"sweep": {"config": args.config, "params": params, "reference": ref.name,
                                      "skipped": [s["point"] for s in skipped]}, **_selection(args)})
    keys = "-".join(k.split(".")[-1] for k in params)
    out = Path(args.out or f"runs/sweep-{Path(args.config).stem}-{keys}-{args.dataset}")
    results = run_bench(spec, problems, out, progress=not args.no_progress)
    return _finish(results, out, spec.columns)
