"""Batch > 1 through SGLang: total tokens/s and per-request latency at several concurrency levels.

For each contender, one local SGLang server is started (loopback), warmed up, then at each
concurrency level C the same Spec-Bench prompts are sent by C client threads at once (each thread
sends its next prompt as soon as its previous one finishes, greedy, ``--max-new-tokens`` each); the
prefix cache is flushed before each level. Contenders run one after another (one server alive at a
time), levels in the order given::

    python scripts/sglang_load.py --out runs/load --per-category 2 --max-new-tokens 96 \\
        --levels 1,2,4,8 --contenders sglang,sglang-eagle3,configs/adaptivespec-dynamic.yaml,\\
        configs/adaptivespec-dynamic.yaml@16

A contender is ``sglang`` / ``sglang-eagle3`` / ``sglang-ngram`` (SGLang alone) or a config file
served through the plugin (``adaptivespec serve``, load-aware by default: ``--load-profile auto``);
``CONFIG@ROWS`` adds ``--verify-budget ROWS``, ``CONFIG@none`` serves it without a load model,
``CONFIG@PROFILE.json`` with that cost profile and ``CONFIG@settled`` with one under which batched
steps draft nothing (settled: the head's draft-extend skipped), to record those steps for a fit.
Before each level's timed pass the same requests run once untimed with ``--warmup-tokens`` new
tokens at that concurrency: SGLang's CPU backend compiles kernels for each new batch size and prompt
length on first use (stalls of 90-200 s were seen).
``--data FILE`` takes the prompts from a Spec-Bench-format file (e.g. training prompts written by
``python -m adaptivespec.analysis.retrieval_tuning_set``, to fit a served cost profile with
``python -m adaptivespec.analysis.served_cost``). Writes ``OUT/load.json`` (every request's tokens and latency, the plugin's
per-step trace summary: shapes per batch size) and ``OUT/load.md`` (the table). Run it alone on the
machine (``flock -x /tmp/cpu.lock``): a second heavy process skews every figure.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompts(per_category: int, tokenizer, data: str | None = None) -> list[tuple[str, list[int]]]:
    from adaptivespec.evaluation.categories import select
    from adaptivespec.evaluation.datasets import load_dataset
    from adaptivespec.models import encode_prompt

    problems = select(load_dataset("specbench", data, None), None, per_category, "specbench")
    return [(p.category if hasattr(p, "category") else "", encode_prompt(tokenizer, p.prompt)) for p in problems]


def server_for(contender: str, port: int, logdir: Path):
    from adaptivespec.sglang.server import PEER_MODES, SGLangServer, peer_command, served_command

    trace = None
    if contender in PEER_MODES:
        argv, env = peer_command(contender, port, extra_args=["--max-total-tokens", "32768"])
    else:
        config, _, option = contender.partition("@")
        trace = logdir / f"{Path(config).stem}{'-' + Path(option).stem if option else ''}.steps.jsonl"
        budget = int(option) if option.isdigit() else None
        profile = option if option and budget is None else None
        if option == "settled":
            from adaptivespec.sglang.load_model import write_settled_profile

            profile = str(logdir / "settled-profile.json")
            write_settled_profile(profile)
        argv, env = served_command(config, port, trace=trace, extra_args=["--max-total-tokens", "32768"],
                                   verify_budget=budget, load_profile=profile)
    name = contender.replace("/", "_")
    return SGLangServer(argv, env, logdir / f"{name}.log", timeout=400), trace


def run_level(server, jobs: list[list[int]], concurrency: int, max_new: int) -> dict:
    queue = collections.deque(enumerate(jobs))
    results: list[dict] = []

    def worker():
        while True:
            try:
                i, ids = queue.popleft()
            except IndexError:
                return
            out = server.generate(ids, max_new, timeout=900)
            results.append({"prompt": i, "new_tokens": out["meta_info"]["completion_tokens"],
                            "latency_s": out["wall_seconds"],
                            "verify_steps": out["meta_info"].get("spec_verify_ct")})

    server.flush_cache()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    tokens = sum(r["new_tokens"] for r in results)
    lat = sorted(r["latency_s"] for r in results)
    return {"concurrency": concurrency, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_mean_s": statistics.mean(lat), "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            "requests": sorted(results, key=lambda r: r["prompt"])}


def trace_summary(path: Path | None, skip: int) -> dict:
    if path is None or not path.exists():
        return {}
    steps = [json.loads(line) for line in path.read_text().splitlines()[skip:] if line.strip()]
    by_bs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in steps:
        by_bs[s["bs"]][str(tuple(s["shape"]))] += 1
    return {"steps": len(steps), "capped": sum(1 for s in steps if s["policy"].get("load_capped_from")),
            "shapes_by_batch": {str(k): dict(v.most_common()) for k, v in sorted(by_bs.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contenders", required=True)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="new tokens per request of each level's untimed pass (0: none)")
    ap.add_argument("--data", help="Spec-Bench-format prompts file (default: Spec-Bench)")
    ap.add_argument("--keep-traces", help="copy the plugin's per-step traces into this folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from adaptivespec.models import embedded_folder
    from adaptivespec.sglang.server import free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(embedded_folder()))
    jobs = [ids for _, ids in prompts(args.per_category, tok, args.data)]
    levels = [int(x) for x in args.levels.split(",")]
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "prompts": len(jobs), "max_new_tokens": args.max_new_tokens,
              "levels": levels, "results": {}}
    logdir = Path(tempfile.mkdtemp(prefix="sglang-load-"))
    for contender in args.contenders.split(","):
        server, trace = server_for(contender, free_port(), logdir)
        rows = []
        with server:
            server.generate(jobs[0], 8)  # warm-up, untimed
            for c in levels:
                if args.warmup_tokens > 0:
                    run_level(server, jobs, c, args.warmup_tokens)  # untimed: compiles this level's shapes
                skip = len(trace.read_text().splitlines()) if trace is not None and trace.exists() else 0
                row = run_level(server, jobs, c, args.max_new_tokens)
                row["trace"] = trace_summary(trace, skip)
                rows.append(row)
                print(f"{contender} c={c}: {row['tokens_per_s']:.1f} tok/s, latency mean {row['latency_mean_s']:.2f} s"
                      f" p90 {row['latency_p90_s']:.2f} s {row['trace'].get('shapes_by_batch', '')}", flush=True)
        report["results"][contender] = rows
        if args.keep_traces and trace is not None and trace.exists():
            Path(args.keep_traces).mkdir(parents=True, exist_ok=True)
            shutil.copy(trace, Path(args.keep_traces) / trace.name)
        (out / "load.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# SGLang under load: {len(jobs)} Spec-Bench prompts x {args.max_new_tokens} new tokens, greedy",
             "", f"{report['date']} · `{report['command']}`", "",
             "| contender | " + " | ".join(f"c={c} tok/s (mean / p90 latency s)" for c in levels) + " |",
             "|---|" + "---:|" * len(levels)]
    for name, rows in report["results"].items():
        cells = [f"{r['tokens_per_s']:.1f} ({r['latency_mean_s']:.2f} / {r['latency_p90_s']:.2f})" for r in rows]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    (out / "load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
