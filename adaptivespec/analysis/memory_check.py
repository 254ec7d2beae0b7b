"""Resident memory of long generations, per config: does RSS grow across generations?

Each config runs in its own process (so its peak is its own): one long prompt (the first
``longctx`` prompt of about ``--prompt-tokens`` tokens), ``--repeats`` generations of
``--new-tokens`` tokens with EOS ignored, after one generation of ``--peak-tokens`` tokens. It
prints, per config, RSS after the first and the last repeat, the largest growth between repeats,
the trend (least-squares slope of RSS over the repeats, MiB per generation, with its standard
error: a leak is a steady positive slope well above its error, allocator noise moves up and down
around a flat line) and the peak RSS
(``VmHWM``); it writes them as JSON with the RSS after every repeat (``rss_series_mib``), and a
plot of those series (``--plot``).

    python scripts/memory_check.py --configs configs/ar.yaml configs/hybrid.yaml --out runs/memory.json
    python -m adaptivespec.analysis.memory_check ...   # the same, installed

The trend maths (:func:`slope`, :func:`slope_stderr`), the RSS reader and the plot are reusable: the
served soak reads a server's RSS with :func:`rss_mib` too.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def rss_mib(field: str = "VmRSS", pid: int | str = "self") -> float:
    """A memory figure of a process from ``/proc/<pid>/status`` in MiB (``VmRSS``: resident now,
    ``VmHWM``: the peak resident)."""
    status = Path(f"/proc/{pid}/status")
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{status} has no {field}")


def slope(series: list[float]) -> float:
    """Least-squares slope of ``series`` against its index (0 for fewer than two points)."""
    n = len(series)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(series) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(series)) / sum((i - mx) ** 2 for i in range(n))


def slope_stderr(series: list[float]) -> float:
    """Standard error of :func:`slope` (how far noise alone moves it; 0 for fewer than three points)."""
    n = len(series)
    if n < 3:
        return 0.0
    b, mx, my = slope(series), (n - 1) / 2, sum(series) / n
    resid = sum((y - my - b * (i - mx)) ** 2 for i, y in enumerate(series))
    return math.sqrt(resid / (n - 2) / sum((i - mx) ** 2 for i in range(n)))


def figure(rows: list[dict]):
    """The RSS series of every row (one line per config, its trend in the legend) as a matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    ax = fig.add_subplot()
    for r in rows:
        ys = r["rss_series_mib"]
        ax.plot(range(1, len(ys) + 1), ys, marker=".", label=f"{Path(r['config']).stem} ({r['slope_mib_per_repeat']:+.1f} MiB/gen)")
    ax.set_xlabel(f"generation ({rows[0]['new_tokens']} new tokens each, after one of {rows[0]['peak_tokens']})")
    ax.set_ylabel("RSS after it (MiB)")
    ax.set_title(f"Resident memory over repeated generations, {rows[0]['prompt_tokens']}-token prompt")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: Path) -> None:
    """:func:`figure` written to ``path`` (PNG)."""
    figure(rows).savefig(path, dpi=120)


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
                      "slope_mib_per_repeat": round(slope(after), 2), "slope_stderr_mib": round(slope_stderr(after), 2),
                      "peak_rss_mib": round(rss_mib("VmHWM"), 1),
                      "rss_series_mib": [round(x, 1) for x in after]}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["configs/ar.yaml", "configs/eagle3.yaml", "configs/hybrid.yaml",
                                                     "configs/cost-aware-hybrid.yaml", "configs/retrieval.yaml"])
    ap.add_argument("--prompt-tokens", type=int, default=4096, choices=(512, 1024, 2048, 4096))
    ap.add_argument("--peak-tokens", type=int, default=1024, help="tokens of the first (longest) generation")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/memory.json")
    ap.add_argument("--plot", default=None, help="also plot every config's RSS series to this PNG")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    from tqdm import tqdm

    for cfg in tqdm(args.configs, desc="configs", unit="config"):
        cmd = [sys.executable, "-m", "adaptivespec.analysis.memory_check", "--child", cfg, *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                          if k in ("prompt_tokens", "peak_tokens", "repeats", "new_tokens", "threads"))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        r = rows[-1]
        tqdm.write(f"{r['config']}: RSS {r['rss_first_mib']} -> {r['rss_last_mib']} MiB over {r['repeats']} generations, "
                   f"trend {r['slope_mib_per_repeat']:+.2f} ± {r['slope_stderr_mib']:.2f} MiB/generation, largest jump {r['max_step_growth_mib']} MiB, "
                   f"peak {r['peak_rss_mib']} MiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
