"""``adaptivespec bench --concurrency 1,2,4,8,16``: every served contender under load, side by side.

The contenders are the ones served over HTTP (:mod:`adaptivespec.evaluation.load_contenders`): the
``--served-configs`` (``<stem>-served``), the SGLang peers of ``--peers`` and ``llama-server`` where
a binary is found; in-process configs and transformers' peers run one request at a time and are
left out with a one-line note, as ``llama-server`` is where none is found. Each server is started
once, before the first level, and kept up to the end; all are stopped (their process groups, by
PID) when the run ends, fails or is interrupted.

The run goes level by level, each contender in turn at each level (:func:`load.schedule`: A at 1,
B at 1, A at 2, ...). One turn: resume the server, forget its prefix cache, an untimed pass at the
level's concurrency with :data:`~adaptivespec.evaluation.spec.WARMUP_TOKENS` new tokens per request
(SGLang's CPU backend compiles kernels per batch size and prompt length on first use), forget
again, the timed pass (:func:`load.run_level`), pause the server. The figures of a pass are
:func:`load.level_stats`'s.

Outputs in the run folder (``--out``; written again after every turn, so an interrupted run keeps
the levels it finished; a rerun measures everything again): ``load.json`` (``meta``,
``contenders``, ``skipped``, ``levels``: one row per contender and level, the fields of
:class:`load.LevelStats`), ``load.md`` (the table also printed) and ``load.png``
(:func:`~adaptivespec.evaluation.plots.concurrency`).
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import transformers
from tqdm import tqdm

from adaptivespec import __version__
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import load
from adaptivespec.evaluation.contenders import response_format_of
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.load_contenders import CONTEXT_MARGIN, build_load_contenders, find_llama_server
from adaptivespec.evaluation.plots import concurrency
from adaptivespec.evaluation.report import machine_info
from adaptivespec.evaluation.sglang_contenders import SGLANG_PEERS, ConfigPrompts, served_config_file
from adaptivespec.evaluation.spec import WARMUP_TOKENS, BenchSpec

LOAD_JSON, LOAD_MD, LOAD_PNG = "load.json", "load.md", "load.png"
ORDER = "level by level; at each level every contender in turn, in the order of `contenders`"
WINDOW = ("closed loop of C clients; request i carries prompt i mod P; the window closes when every prompt "
          "has been answered and at least max(C, P) requests have; tokens streamed after it are not counted")
ITL = ("gap between consecutive token-carrying chunks / tokens in the later chunk, one sample per token, "
       "pooled over the requests answered in the window")


def plan(spec: BenchSpec, llama: tuple[str | None, str]) -> tuple[list[str], dict[str, str]]:
    """(the contenders a load run measures, in order; those left out, with why)."""
    names, skipped = [], {}
    for e in spec.entries:
        if e.served:
            names.append(e.name)
        else:
            skipped[e.name] = "runs in process, one request at a time (list it in --served-configs to measure it under load)"
    for peer in spec.peers:
        if peer in SGLANG_PEERS:
            names.append(peer)
        else:
            skipped[peer] = "transformers in process, one request at a time"
    binary, why = llama
    if binary is not None:
        names.append("llama-server")
    else:
        skipped["llama-server"] = why
    return names, skipped


def run_load(spec: BenchSpec, problems: list[Problem], out: str | Path, levels: tuple[int, ...], *,
             llama_server: str | None = None, progress: bool = True, command: str = "") -> dict[str, Any]:
    """Measure every served contender of ``spec`` at each of ``levels`` on ``problems``; write and
    return ``load.json``'s document."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AdaptiveSpecError(f"--out: {out} exists and is not a folder")
    llama = find_llama_server(llama_server)
    names, skipped = plan(spec, llama)
    for name, why in skipped.items():
        print(f"bench: {name} skipped: {why}", file=sys.stderr)
    if not names:
        raise AdaptiveSpecError("--concurrency: no contender is served over HTTP; expected --served-configs FILE... "
                                "or --peers sglang,sglang-eagle3")
    out.mkdir(parents=True, exist_ok=True)
    top = max(levels)
    results: dict[str, Any] = {"meta": _meta(spec, problems, levels, command), "contenders": {}, "skipped": skipped,
                               "levels": []}
    paths = {e.name: served_config_file(e.config, e.name) for e in spec.entries if e.served}
    contenders: dict[str, Any] = {}
    try:
        context = _context(spec, problems)
        contenders.update(build_load_contenders(spec, names, parallel=top, context=context, llama=llama[0], paths=paths,
                                                skipped=skipped))
        for name in set(names) - set(contenders):
            print(f"bench: {name} skipped: {skipped[name]}", file=sys.stderr)
        if not contenders:
            raise AdaptiveSpecError("--concurrency: no contender could start here (" + "; ".join(
                f"{n}: {skipped[n]}" for n in names) + ")")
        results["contenders"] = {n: c.describe() for n, c in contenders.items()}
        ids = {n: [c.encode(p.prompt) for p in problems] for n, c in contenders.items()}
        formats = [response_format_of(p) for p in problems]  # a structured prompt's own format (None: free text)
        _run(results, contenders, ids, spec.max_new_tokens, levels, out, progress, formats)
    finally:
        for c in contenders.values():
            c.close()
    write_outputs(results, out)
    return results


def _context(spec: BenchSpec, problems: list[Problem]) -> int:
    """Tokens one request may take: the longest prompt (the first config's encoding) plus
    ``max_new_tokens`` plus :data:`CONTEXT_MARGIN`."""
    enc = ConfigPrompts()
    enc.config = spec.entries[0].config
    return max(len(enc.encode(p.prompt)) for p in problems) + spec.max_new_tokens + CONTEXT_MARGIN


def _run(results, contenders, ids, max_new: int, levels, out: Path, progress: bool, formats=None) -> None:
    turns = load.schedule(list(contenders), levels)
    prompts = len(next(iter(ids.values())))
    fmt = formats or [None] * prompts
    bar = tqdm(total=len(turns), desc="bench load", unit="turn", file=sys.stderr, dynamic_ncols=True,
               disable=not progress)
    with bar:
        for c, name in turns:
            lc, pids = contenders[name], ids[name]
            bar.set_postfix_str(f"{name} at {c}", refresh=True)
            lc.begin()
            try:
                lc.reset()
                warm = min(WARMUP_TOKENS, max_new)
                load.run_level(lambda k, lc=lc, pids=pids: lc.send(pids[k], warm, k, fmt[k]), prompts, c)
                lc.reset()
                replies, start = load.run_level(
                    lambda k, lc=lc, pids=pids: lc.send(pids[k], max_new, k, fmt[k]), prompts, c,
                    on_answer=lambda n, name=name, c=c: bar.set_postfix_str(f"{name} at {c}: {n} answered",
                                                                            refresh=False))
            finally:
                lc.end()
            streams = [lc.count(r) for r in replies]
            end = load.window_end(streams, prompts, c)
            row = load.level_stats(name, c, streams, start, end).to_json()
            results["levels"].append(row)
            (out / LOAD_JSON).write_text(json.dumps(results, indent=1) + "\n")
            bar.set_postfix_str(f"{name} at {c}: {row['total_tokens_per_second']:.1f} tok/s", refresh=False)
            bar.update()


def _meta(spec: BenchSpec, problems: list[Problem], levels, command: str) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dataset": spec.dataset,
        "data": spec.data,
        "prompts": len(problems),
        "problems": [p.id for p in problems],
        "max_new_tokens": spec.max_new_tokens,
        "levels": list(levels),
        "sampling": "greedy",
        "constrained": sum(p.meta.get("response_format") is not None for p in problems),
        "warmup_tokens": WARMUP_TOKENS,
        "order": ORDER,
        "window": WINDOW,
        "itl": ITL,
        "machine": machine_info(),
        "versions": {"adaptivespec": __version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown(results: dict[str, Any]) -> str:
    """The table: one row per contender, one column per level; each cell total tok/s / per-request
    tok/s / ITL p50 ms."""
    meta = results["meta"]
    levels = meta["levels"]
    rows = {(r["contender"], r["concurrency"]): r for r in results["levels"]}
    cpu = meta["machine"].get("cpu", "")
    lines = [f"# Under load: {meta['dataset']}, {meta['prompts']} prompts, max {meta['max_new_tokens']} new tokens, "
             f"greedy ({cpu}, {meta['date']})", "",
             "Each cell: total tok/s / per-request tok/s / inter-token latency p50 (ms)."
             + (f" Every request constrained by its prompt's own response format ({meta['constrained']} of "
                f"{meta['prompts']} prompts have one)." if meta.get("constrained") else ""), "",
             "| contender | " + " | ".join(f"{c} in flight" for c in levels) + " |",
             "|---|" + "---:|" * len(levels)]
    for name in results["contenders"]:
        cells = []
        for c in levels:
            r = rows.get((name, c))
            cells.append("" if r is None else f"{r['total_tokens_per_second']:.1f} / "
                         f"{_num(r['per_request_tokens_per_second'], '.1f')} / {_num(r['itl_p50_ms'], '.1f')}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    shares = {k: r.get("prompt_cached_share") for k, r in rows.items()}
    if any(v is not None for v in shares.values()):
        lines += ["", "Prompt tokens taken from the server's prefix cache (answered requests; each pass starts "
                  "with the caches emptied, a prompt sent again within a level may be found):", "",
                  "| contender | " + " | ".join(f"{c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
        for name in results["contenders"]:
            vals = [shares.get((name, c)) for c in levels]
            lines.append(f"| `{name}` | " + " | ".join("–" if v is None else f"{100 * v:.0f}%" for v in vals) + " |")
    if results.get("skipped"):
        lines += ["", "Left out: " + "; ".join(f"`{n}`: {why}" for n, why in results["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """``load.json``, ``load.md`` and ``load.png`` in ``out``."""
    (out / LOAD_JSON).write_text(json.dumps(results, indent=1) + "\n")
    (out / LOAD_MD).write_text(markdown(results))
    concurrency(results, out / LOAD_PNG)
