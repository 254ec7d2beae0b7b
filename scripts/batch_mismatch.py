"""How often a request decoded in a batch differs from the same request decoded alone (greedy).

For every config: held-out Spec-Bench prompts (``--per-category`` per category) decoded one at a
time by :class:`~adaptivespec.decode.Engine`, then all of them through
:class:`~adaptivespec.batch.BatchEngine` with ``--concurrency`` requests in flight; plus the greedy
reference of plain decoding alone (configs/ar.yaml). Reported per config and category: requests
whose batched output equals the config's own output alone, the mean share of the output identical
before the first divergence, and requests whose batched output equals plain ar alone. Markdown
table on stdout, everything (per request too) as JSON in ``--out``.

    python scripts/batch_mismatch.py                      # ar, batched-hybrid, hybrid; 2 per category, 128 tokens
    python scripts/batch_mismatch.py configs/hybrid.yaml --per-category 1 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from adaptivespec.cli import positive_int

DEFAULT_CONFIGS = ["configs/ar.yaml", "configs/batched-hybrid.yaml", "configs/hybrid.yaml"]
AR_CONFIG = "configs/ar.yaml"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def bad(name: str, message: str) -> None:
    print(f"batch_mismatch.py: error: {name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_share(out: list[int], ref: list[int]) -> float:
    """Tokens identical before the first divergence, as a share of the longer of the two outputs."""
    longest = max(len(out), len(ref))
    return 1.0 if longest == 0 else common_prefix(out, ref) / longest


def machine() -> dict:
    name, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == platform.machine():
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch
    return {"cpu": name, "amx_tile": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="batch_mismatch.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS, help=f"config files (default: {' '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--per-category", type=positive_int, default=2, help="prompts per Spec-Bench category (default 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight in the batch (default 8)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="runtime.dtype for every config (default bfloat16)")
    ap.add_argument("--context-length", type=positive_int, default=2048, help="BatchEngine context length (default 2048)")
    ap.add_argument("--out", default="runs/batch-mismatch.json", help="JSON report (default runs/batch-mismatch.json)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    configs = list(dict.fromkeys(args.configs))
    for path in configs + [AR_CONFIG]:
        if not Path(path).is_file():
            bad("configs" if path != AR_CONFIG or path in configs else "configs/ar.yaml (the plain reference)",
                f"no such file {path!r}")

    from tqdm import tqdm
    from adaptivespec.batch import BatchEngine, Request
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.evaluation.datasets import load_dataset

    overrides = [f"runtime.dtype={args.dtype}"]
    loaded = {}
    for path in configs + [AR_CONFIG]:
        try:
            loaded[path] = load_config(path, overrides)
        except AdaptiveSpecError as e:
            bad("configs", f"{path}: {str(e).splitlines()[0]}")
    if args.context_length < args.max_new_tokens + 64:
        bad("--context-length", f"{args.context_length} leaves no room for prompts of {args.max_new_tokens} new tokens")

    by: dict[str, list] = {}
    for p in load_dataset("specbench", None, None):
        by.setdefault(p.category, []).append(p)
    problems = [p for c in sorted(by) for p in by[c][: args.per_category]]
    n = len(problems)
    limit = args.max_new_tokens

    bar = tqdm(total=n * (2 * len(configs) + (0 if AR_CONFIG in configs else 1)), desc="decodes", unit="req",
               file=sys.stderr, dynamic_ncols=True, disable=args.no_progress)
    t_start = time.perf_counter()

    def alone(engine, ids_list, label):
        outs = []
        bar.set_description(f"{label} alone")
        for ids in ids_list:
            engine.forget()
            outs.append(list(engine.generate_ids(ids, max_new_tokens=limit).token_ids))
            bar.update(1)
        return outs

    ar_engine = Engine(loaded[AR_CONFIG])
    ids = [ar_engine.encode(p.prompt) for p in problems]
    ar_alone = None
    if AR_CONFIG not in configs:
        ar_alone = alone(ar_engine, ids, Path(AR_CONFIG).stem)
    del ar_engine

    report = {"args": {k: v for k, v in vars(args).items() if k != "no_progress"}, "machine": machine(),
              "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(i)} for p, i in zip(problems, ids)],
              "configs": {}}
    for path in configs:
        cfg, label = loaded[path], Path(path).stem
        engine = Engine(cfg)
        ids_c = [engine.encode(p.prompt) for p in problems]
        if ids_c != ids:
            bad("configs", f"{path} encodes the prompts differently from {AR_CONFIG} (chat template?)")
        single = alone(engine, ids_c, label)
        del engine
        if path == AR_CONFIG:
            ar_alone = single
        be = BatchEngine(cfg, slots=args.concurrency, context_length=args.context_length, log=lambda *_: None)
        bar.set_description(f"{label} batch x{args.concurrency}")
        reqs, pending, seen, steps = [], list(range(n)), 0, 0
        t0 = time.perf_counter()
        while pending or any(not r.done for r in reqs):
            while pending and sum(not r.done for r in reqs) < args.concurrency:
                reqs.append(be.submit(Request(prompt=list(ids_c[pending.pop(0)]), max_new_tokens=limit)))
            be.step()
            steps += 1
            finished = sum(r.done for r in reqs)
            bar.update(finished - seen)
            seen = finished
        batch_s = time.perf_counter() - t0
        errors = [r.error for r in reqs if r.error]
        batched = [list(r.out) for r in reqs]
        del be
        report["configs"][path] = {"dtype": cfg.runtime.dtype, "batch_steps": steps, "batch_seconds": batch_s,
                                   "errors": errors, "requests": [
            {"id": p.id, "category": p.category, "alone_tokens": len(s), "batch_tokens": len(b),
             "identical_alone": b == s, "prefix_alone": common_prefix(b, s), "prefix_share_alone": prefix_share(b, s),
             "identical_ar": b == a, "alone_identical_ar": s == a, "prefix_share_ar": prefix_share(b, a),
             "first_divergence": None if b == s else common_prefix(b, s)}
            for p, s, b, a in zip(problems, single, batched, ar_alone)]}
    bar.close()

    def summary(rows):
        k = len(rows)
        return {"requests": k,
                "identical_alone_pct": 100.0 * sum(r["identical_alone"] for r in rows) / k,
                "prefix_share_alone_mean": sum(r["prefix_share_alone"] for r in rows) / k,
                "identical_ar_pct": 100.0 * sum(r["identical_ar"] for r in rows) / k,
                "alone_identical_ar_pct": 100.0 * sum(r["alone_identical_ar"] for r in rows) / k}

    cats = sorted(by)
    lines = [f"bf16 mismatch: batched ({args.concurrency} in flight) vs decoding alone; {n} Spec-Bench prompts "
             f"({args.per_category} per category), {limit} new tokens, dtype {args.dtype}", "",
             "| config | category | n | batch = alone (%) | identical prefix (mean share) | batch = ar alone (%) | alone = ar alone (%) |",
             "|---|---|---|---|---|---|---|"]
    for path, res in report["configs"].items():
        res["summary"] = {c: summary([r for r in res["requests"] if r["category"] == c]) for c in cats}
        res["summary"]["all"] = summary(res["requests"])
        for c in cats + ["all"]:
            s = res["summary"][c]
            name = f"**{c}**" if c == "all" else c
            lines.append(f"| {Path(path).stem} | {name} | {s['requests']} | {s['identical_alone_pct']:.0f} | "
                         f"{s['prefix_share_alone_mean']:.3f} | {s['identical_ar_pct']:.0f} | {s['alone_identical_ar_pct']:.0f} |")
    report["seconds"] = time.perf_counter() - t_start
    table = "\n".join(lines)
    report["table"] = table
    print(table)
    for path, res in report["configs"].items():
        if res["errors"]:
            print(f"{path}: {len(res['errors'])} request(s) failed: {res['errors'][0]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
