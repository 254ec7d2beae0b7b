"""The results of a run: the ``results.json`` document (:func:`summarize`), ``results.md``
(:func:`markdown`) and the plots (:func:`write_outputs`).

``results.json`` is ``meta`` (command, date, machine, versions), the baselines (``reference``,
``ar``, ``eagle3``), the spec's extras (a sweep's parameters, a selection), ``configs`` (one
:class:`~adaptivespec.evaluation.records.ContenderRow` per contender) and, for datasets with
categories, ``categories`` (the same rows on each category's prompts). :func:`markdown` and the
plots read that document, so they can be redrawn from a saved ``results.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import transformers

from adaptivespec import __version__, hardware
from adaptivespec.evaluation import plots
from adaptivespec.evaluation.categories import CATEGORY_FIELDS, CATEGORY_PLOT, categories, category_of, format_value
from adaptivespec.evaluation.categories import markdown as category_markdown
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.records import RunRecord
from adaptivespec.evaluation.spec import WARMUP_TOKENS, BenchSpec, sampling_of
from adaptivespec.evaluation.summary import summarize_rows

RESULTS_JSON, RESULTS_MD = "results.json", "results.md"
SPEEDUP_PLOT, ACCEPT_PLOT, PARETO_PLOT = "speedup_retention.png", "accept_lengths.png", "pareto.png"


def summarize(spec: BenchSpec, problems: list[Problem], records: list[RunRecord]) -> dict[str, Any]:
    """The ``results.json`` document of a run from its records (with ``categories``, the same
    aggregates per prompt category, when the dataset has categories)."""
    s = summarize_rows(spec, problems, records)
    return {
        "meta": run_metadata(spec, problems),
        "reference": s.reference,
        "ar": s.ar,
        "eagle3": s.eagle3,
        **spec.extra,
        "configs": [row.to_json() for row in s.rows],
        **({"categories": by_category(spec, problems, records)} if categories(problems) else {}),
    }


def by_category(spec: BenchSpec, problems: list[Problem], records: list[RunRecord]) -> dict[str, Any]:
    """``{category: {"prompts": n, "reference", "ar", "eagle3", "configs": [row per contender]}}``,
    each row the :data:`~adaptivespec.evaluation.categories.CATEGORY_FIELDS` (and a sweep point's
    ``sweep``) of the row summarized on that category's prompts (empty without categories).

    A contender that ran none of a category's prompts has ``prompts`` 0 and no speeds there."""
    out: dict[str, Any] = {}
    for cat in categories(problems):
        subset = [p for p in problems if category_of(p) == cat]
        s = summarize_rows(spec, subset, records)
        rows = []
        for row in s.rows:
            full = row.to_json()
            rows.append({k: full[k] for k in CATEGORY_FIELDS} | ({"sweep": full["sweep"]} if "sweep" in full else {}))
        out[cat] = {"prompts": len(subset), "reference": s.reference, "ar": s.ar, "eagle3": s.eagle3, "configs": rows}
    return out


def run_metadata(spec: BenchSpec, problems: list[Problem]) -> dict[str, Any]:
    """``results.json``'s ``meta``: the command, date, dataset, limits, sampling, machine and versions."""
    devices = sorted({e.config.runtime.device for e in spec.entries})
    return {
        "command": spec.command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dataset": spec.dataset,
        "data": spec.data,
        "limit": spec.limit,
        "prompts": len(problems),
        "max_new_tokens": spec.max_new_tokens,
        "sampling": sampling_of(spec.entries[0].config) if spec.entries else None,
        "warmup_tokens": WARMUP_TOKENS,
        "order": "interleaved: for prompt i, every contender in the order rotated by i",
        "machine": machine_info(devices),
        "torch": torch.__version__,
        "versions": {"adaptivespec": __version__, "transformers": transformers.__version__, "python": platform.python_version()},
    }


def machine_info(devices: list[str] = ()) -> dict[str, Any]:
    """CPU model and core counts from /proc/cpuinfo; GPU names for CUDA devices used."""
    cpu, physical = platform.processor() or platform.machine(), None
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    models = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    if models:
        cpu = models[0]
    cores = {line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cpu cores")}
    sockets = {line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("physical id")}
    if cores:
        physical = int(next(iter(cores))) * max(len(sockets), 1)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, Any] = {
        "cpu": cpu,
        "isa": hardware.isa(),  # the level the project ran at (capped by $ADAPTIVESPEC_CPU_ISA where set)
        "physical_cores": physical,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        out["gpus"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in cuda}
    return out


# -- outputs -------------------------------------------------------------------------------------------------
def markdown(results: dict[str, Any], extra_columns: list[str] = ()) -> str:
    """The results table (one row per contender) with a short header."""
    meta = results["meta"]
    m = meta["machine"]
    lines = [
        f"# {meta['command']}: {meta['dataset']}, {meta['prompts']} prompts, max {meta['max_new_tokens']} new tokens",
        "",
        f"{meta['date']} · {m['cpu']} ({m['usable_cpus']} usable CPUs, {m['torch_threads']} torch threads)"
        + (f" · {', '.join(m['gpus'].values())}" if m.get("gpus") else "")
        + f" · torch {meta['torch']}",
        "",
        f"Retention = accuracy / accuracy of `{results['reference']}` (lossless reference); answer agreement = "
        f"final answer equal to `{results['reference']}`'s; identical text = whole output equal. "
        "Speedups are ratios of tokens/s (total new tokens / total wall seconds).",
        "",
    ]
    samp = meta.get("sampling")
    if samp and samp["temperature"] > 0:
        lines[1:1] = ["", f"Sampling: temperature {samp['temperature']}, top-k {samp['top_k']}, top-p {samp['top_p']}, "
                          f"min-p {samp['min_p']}, seed {samp['seed']} + prompt index (lossless = same distribution)."]
    by_ref = meta["command"] == "sweep"  # a sweep's speedups are against its reference
    head = ["config", *extra_columns, "lossless", "tok/s", "speedup vs AR", "speedup vs EAGLE-3",
            *([f"speedup vs {results['reference']}"] if by_ref else []), "accept length", "accuracy", "retention",
            "answer agreement", "identical text"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in results["configs"]:
        acc = "–" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}% ({r['correct']}/{r['graded']})"
        sweep = [str(r.get("sweep", {}).get(c, "–")) for c in extra_columns]
        name = f"`{r['name']}`" + ("" if r["complete"] else " (incomplete)")
        cells = [name, *sweep, "yes" if r["lossless"] else "no", format_value(r["tokens_per_second"], ".2f"),
                 format_value(r["speedup_vs_ar"], ".2f", "×"), format_value(r["speedup_vs_eagle3"], ".2f", "×"),
                 *([format_value(r["speedup_vs_reference"], ".2f", "×")] if by_ref else []),
                 format_value(r["accept_length_mean"], ".2f"), acc,
                 "–" if r["retention"] is None else f"{100 * r['retention']:.1f}%",
                 "–" if r["answer_agreement"] is None else f"{100 * r['answer_agreement']:.1f}% ({r['answers_equal']}/{r['answers_compared']})",
                 format_value(None if r["identical_outputs"] is None else 100 * r["identical_outputs"], ".0f", "%")]
        lines.append("| " + " | ".join(cells) + " |")
    for name, why in (results.get("unsupported") or {}).items():
        lines.append(f"| `{name}` | {why} |" + " |" * (len(head) - 2))
    return "\n".join(lines) + "\n" + category_markdown(results)


def write_outputs(results: dict[str, Any], out: Path, extra_columns: tuple[str, ...] = ()) -> None:
    """results.json, results.md and the plots (``pareto.png`` too for a sweep)."""
    (out / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    (out / RESULTS_MD).write_text(markdown(results, list(extra_columns)))
    plots.speedup_retention(results, out / SPEEDUP_PLOT)
    plots.accept_lengths(results, out / ACCEPT_PLOT)
    if "sweep" in results:
        plots.pareto(results, out / PARETO_PLOT)
    if results.get("categories"):
        plots.category_speedups(results, out / CATEGORY_PLOT)
