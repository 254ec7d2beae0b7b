"""Resident memory of long generations, per config: does RSS grow across generations?

Each config runs in its own process (so its peak is its own): one long prompt (the first
``longctx`` prompt of about ``--prompt-tokens`` tokens), ``--repeats`` generations of
``--new-tokens`` tokens with EOS ignored, after one generation of ``--peak-tokens`` tokens. It
prints, per config, RSS after the first and the last repeat, the largest growth between repeats
and the peak RSS (``VmHWM``), and writes them as JSON.

    python scripts/memory_check.py --configs configs/ar.yaml configs/hybrid.yaml --out runs/memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args) -> None:
    import torch

    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.evaluation.datasets import load_dataset

    torch.set_num_threads(args.threads)
    want = f"summarize-{ {512: '512', 1024: '1k', 2048: '2k', 4096: '4k'}[args.prompt_tokens] }"
    prompt = next(p.prompt for p in load_dataset("longctx") if p.category == want)
    engine = Engine(load_config(args.child, overrides=["generation.stop_at_eos=false"]))
    ids = engine.encode(prompt)
    engine.generate_ids(ids, max_new_tokens=args.peak_tokens)
    after = []
    for _ in range(args.repeats):
        engine.generate_ids(ids, max_new_tokens=args.new_tokens)
        after.append(rss_mib())
    growth = max(b - a for a, b in zip(after, after[1:])) if len(after) > 1 else 0.0
    print(json.dumps({"config": args.child, "prompt_tokens": len(ids), "peak_tokens": args.peak_tokens,
                      "repeats": args.repeats, "new_tokens": args.new_tokens, "rss_first_mib": round(after[0], 1),
                      "rss_last_mib": round(after[-1], 1), "max_step_growth_mib": round(growth, 1),
                      "peak_rss_mib": round(rss_mib("VmHWM"), 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["configs/ar.yaml", "configs/eagle3.yaml", "configs/hybrid.yaml",
                                                     "configs/cost-aware-hybrid.yaml", "configs/retrieval.yaml"])
    ap.add_argument("--prompt-tokens", type=int, default=4096, choices=(512, 1024, 2048, 4096))
    ap.add_argument("--peak-tokens", type=int, default=1024, help="tokens of the first (longest) generation")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/memory.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    for cfg in args.configs:
        cmd = [sys.executable, __file__, "--child", cfg, *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                          if k in ("prompt_tokens", "peak_tokens", "repeats", "new_tokens", "threads"))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
