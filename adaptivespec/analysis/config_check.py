"""Every shipped config on a device: each ``configs/*.yaml`` (found when run, so configs added later
are covered) generates from the same prompts with the eager ``torch`` runtime and with
``torch-cuda-graphs``, in float32 on the embedded pair, and is compared with greedy decoding
(``configs/ar.yaml`` under the same overrides):

* a lossless config must reproduce greedy decoding token for token, with either runtime;
* a lossy one is reported (tokens equal to greedy, first divergence), and its graph run must match
  its eager run (same arithmetic, same accept decisions) -- reported, not failed, since float32
  kernels under capture may round differently at a near-tie of the margin rule;
* every run reports tokens/s and mean accept length;
* the int8 configs (``runtime.quantization: int8``) run on CPUs only (skipped elsewhere), in their own
  bfloat16, and are compared with the int8 target's greedy decoding (``configs/ar-int8.yaml``).

Used by ``scripts/gpu_check.py`` (phase ``configs``); runs alone too::

    python scripts/config_check.py --device cuda            # a CUDA machine
    python scripts/config_check.py --device cpu --runtimes torch --tokens 8 --prompts 1   # CPU logic check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: adaptivespec/analysis/)
sys.path.insert(0, str(ROOT))

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the factorial of n.",
    "Translate to German: The weather is nice today, so we will go for a walk in the park.",
)


def config_paths(pattern: str = "configs/*.yaml") -> list[Path]:
    """The shipped configs, ``ar.yaml`` first (the greedy reference)."""
    paths = sorted(ROOT.glob(pattern))
    return sorted(paths, key=lambda p: p.stem != "ar")


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return n if n is not None or len(a) == len(b) else min(len(a), len(b))


def check_configs(device: str, *, runtimes=("torch", "torch-cuda-graphs"), tokens: int = 64, prompts: int = 3,
                  pattern: str = "configs/*.yaml", deadline: float | None = None, log=print) -> dict:
    """Run every config; returns ``{"runs": [...], "failures": [...], "skipped": [...]}``."""
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    report: dict = {"device": device, "tokens": tokens, "prompts": prompts, "runtimes": list(runtimes),
                    "runs": [], "failures": [], "skipped": []}
    greedies: dict[str, dict[int, list[int]]] = {}  # precision -> prompt -> greedy tokens (ar.yaml, ar-int8.yaml)
    for path in config_paths(pattern):
        for runtime in runtimes:
            label = f"{path.stem} [{runtime}]"
            if deadline is not None and time.monotonic() > deadline:
                report["skipped"].append(f"{label}: time budget spent")
                continue
            log(f"config_check: {label} ...")
            row: dict = {"config": path.stem, "runtime": runtime}
            try:
                quantized = load_config(path).runtime.quantization != "none"  # the int8 target: its own bfloat16
                if quantized and not device.startswith("cpu"):
                    report["skipped"].append(f"{label}: runtime.quantization runs on CPUs")
                    continue
                cfg = load_config(path, [f"runtime.name={runtime}", f"runtime.device={device}",
                                         f"generation.max_new_tokens={tokens}"] + ([] if quantized else ["runtime.dtype=float32"]))
                if runtime != "torch" and any(getattr(s.params, "extra_slots", 0) for s in cfg.sources):
                    import attrs  # static verify graphs hold ndt rows: candidate sources get no extra slots there

                    cfg = attrs.evolve(cfg, sources=tuple(attrs.evolve(s, params=attrs.evolve(s.params, extra_slots=0))
                                                          for s in cfg.sources))
                    row["note"] = "sources' extra_slots set to 0 (static verify graphs hold ndt rows)"
                t0 = time.perf_counter()
                engine = Engine(cfg)
                row["load_seconds"] = time.perf_counter() - t0
                row["lossless"] = engine.lossless
                outs, new, wall, forwards = [], 0, 0.0, 0
                for i, prompt in enumerate(PROMPTS[:prompts]):
                    res = engine.generate_ids(engine.encode(prompt))
                    outs.append(res.token_ids)
                    new += res.stats["new_tokens"]
                    wall += res.stats["wall_seconds"]
                    forwards += res.stats["target_forwards"]
                row.update(tokens_per_second=new / wall if wall else None, accept_length_mean=new / forwards if forwards else None)
                if cfg.autoregressive and runtime == runtimes[0]:  # each precision's own greedy decoding
                    greedies[cfg.runtime.precision] = dict(enumerate(outs))
                greedy = greedies.get(cfg.runtime.precision)
                if greedy:
                    diverged = [_first_divergence(outs[i], greedy[i]) for i in range(len(outs))]
                    row["equal_to_greedy"] = all(d is None for d in diverged)
                    row["first_divergence"] = diverged
                    if engine.lossless and not row["equal_to_greedy"]:
                        report["failures"].append(f"{label}: lossless but differs from greedy at tokens {diverged}")
                eager = next((r for r in report["runs"] if r["config"] == path.stem and r["runtime"] == runtimes[0]
                              and "outputs" in r), None)
                if eager is not None and runtime != runtimes[0]:
                    row["equal_to_eager"] = eager["outputs"] == outs
                row["outputs"] = outs
                del engine
            except Exception as exc:  # one config's failure must not hide the others
                from adaptivespec.fastpath.cuda_graphs import CudaGraphsUnsupportedError

                if isinstance(exc, CudaGraphsUnsupportedError):  # e.g. no drafter: nothing to capture
                    report["skipped"].append(f"{label}: {exc}")
                    continue
                row["error"] = traceback.format_exc()
                report["failures"].append(f"{label}: {row['error'].strip().splitlines()[-1]}")
            report["runs"].append(row)
            if device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
    return report


def markdown(report: dict) -> str:
    lines = [f"## Shipped configs ({report['device']}, float32, {report['prompts']} prompts x {report['tokens']} tokens)", "",
             "| config | runtime | lossless | equal to greedy | equal to eager | tok/s | accept length | error |",
             "|---|---|---|---|---|---:|---:|---|"]
    for r in report["runs"]:
        yes = {True: "yes", False: "no", None: "–"}
        err = r["error"].strip().splitlines()[-1] if "error" in r else ""
        lines.append(f"| {r['config']} | {r['runtime']} | {yes[r.get('lossless')]} | {yes[r.get('equal_to_greedy')]}"
                     + (f" (at {r['first_divergence']})" if r.get("equal_to_greedy") is False else "")
                     + f" | {yes[r.get('equal_to_eager')]} | "
                     + (f"{r['tokens_per_second']:.1f}" if r.get("tokens_per_second") else "–") + " | "
                     + (f"{r['accept_length_mean']:.2f}" if r.get("accept_length_mean") else "–") + f" | {err} |")
    for s in report["skipped"]:
        lines.append(f"- skipped: {s}")
    for f in report["failures"]:
        lines.append(f"- FAIL: {f}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runtimes", default="torch,torch-cuda-graphs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--configs", default="configs/*.yaml", help="glob under the repository root")
    args = ap.parse_args(argv)
    report = check_configs(args.device, runtimes=tuple(args.runtimes.split(",")), tokens=args.tokens,
                           prompts=args.prompts, pattern=args.configs, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown(report))
    print(json.dumps({"failures": report["failures"]}))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
