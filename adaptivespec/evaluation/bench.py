"""``adaptivespec bench``: every config (and peer) on the same prompts, interleaved and resumable.

The run, in order:

1. every config is loaded with the shared ``--set`` overrides and ``generation.max_new_tokens``;
   the target is loaded once (``decode.load_models`` caches it per process);
2. each contender is warmed up on the first and the longest prompt (:data:`WARMUP_TOKENS` tokens,
   untimed, not recorded; an SGLang contender on every prompt, as its CPU backend compiles kernels
   per prompt length); a
   candidate source's cross-request output cache (off unless a config sets it) is emptied after
   it: each contender has its own, and a prompt never drafts from its own earlier outputs;
3. for prompt ``i``, every contender runs in the order rotated by ``i`` (so slow drift of the
   machine hits every contender alike); each (contender, prompt) pair is graded and appended to
   ``OUT/records.jsonl`` at once. A killed run rerun with the same command skips the pairs already
   there; ``OUT/settings.json`` holds what the records were made with, and a rerun with other
   settings is refused;
4. ``results.json``, ``results.md`` and the plots are written from ``records.jsonl``.

Aggregates per contender: ``tokens_per_second`` = total new tokens / total wall seconds (prefill
included, grading excluded); ``prefill_seconds`` = total wall seconds to the first token and
``decode_tokens_per_second`` = the tokens after the first / the wall seconds after it (None for a
contender that does not report its prefill, such as the peers): at long prompts the prefill is a
large share of every contender's time, equal for all, and the decode rate is what speculation
changes; ``accept_length_mean`` = total new tokens / total target forwards;
``accuracy`` = correct / graded; ``retention`` = accuracy / accuracy of the *reference*, the
lossless config chosen by :func:`~adaptivespec.evaluation.summary.pick_reference` (the sweep's ``--reference``; else the config named
``eagle3``, else ``ar``, else the first lossless config). ``speedup_vs_ar`` divides by the
tokens/s of the autoregressive config (the one named ``ar``, else the first autoregressive one),
``speedup_vs_eagle3`` by that of the config named ``eagle3``, ``speedup_vs_reference`` by that of
the reference; ``decode_speedup_vs_ar`` divides the decode rates. ``answer_agreement`` = share of the prompts run by both where the extracted final
answer equals the reference's (two missing answers count as equal), the measure of what a lossy
verifier changes that does not depend on the target being good at the task; ``identical_outputs``
= share whose whole text equals the reference's.

Datasets with categories (Spec-Bench, MT-Bench, MATH-500) also get ``categories`` in
``results.json``: the same aggregates on each category's prompts (speedups against the baselines'
tokens/s on that category), a ``## By category`` section in ``results.md`` and
``category_speedup.png`` (see :mod:`adaptivespec.evaluation.categories`).

The modules, bottom up: :mod:`~adaptivespec.evaluation.spec` (the run's definition),
:mod:`~adaptivespec.evaluation.records` (the typed records and their JSON),
:mod:`~adaptivespec.evaluation.contenders` (the :class:`~adaptivespec.evaluation.contenders.Contender`
protocol and the engine's contender; the peers in :mod:`~adaptivespec.evaluation.peers` and
:mod:`~adaptivespec.evaluation.sglang_contenders`), :mod:`~adaptivespec.evaluation.rundir` (the run
folder), :mod:`~adaptivespec.evaluation.summary` (rows per contender),
:mod:`~adaptivespec.evaluation.report` (results.json, results.md, plots) and this one, the run.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.contenders import ConfigContender, Contender, response_format_of
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.graders import grade
from adaptivespec.evaluation.peers import HfPeer
from adaptivespec.evaluation.records import RunRecord
from adaptivespec.evaluation.report import summarize, write_outputs
from adaptivespec.evaluation.rundir import RECORDS, open_run_dir, read_records, settings_of
from adaptivespec.evaluation.served_contenders import TorchServedContender
from adaptivespec.evaluation.sglang_contenders import MAY_BE_UNSUPPORTED, SGLANG_PEERS, SGLangContender, served_config_file
from adaptivespec.evaluation.spec import WARMUP_TOKENS, BenchSpec


def run_bench(spec: BenchSpec, problems: list[Problem], out: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) ``spec`` on ``problems`` into ``out``; returns the results written there."""
    out = Path(out)
    names = spec.names
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise AdaptiveSpecError(f"--configs: two contenders are named {dup!r} (names are file stems); rename one file")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise AdaptiveSpecError(f"--dataset: problem id {dup!r} appears twice; ids must be unique to resume")
    open_run_dir(out, settings_of(spec, problems))
    unsupported = read_unsupported(out)
    done = {(r.config, r.id) for r in read_records(out, repair=True)}
    todo = [(i, p, name) for i, p in enumerate(problems) for name in rotation(names, i)
            if (name, p.id) not in done and name not in unsupported]
    if todo:
        structured = any(p.meta.get("response_format") is not None for p in problems)
        contenders = build_contenders(spec, {name for _, _, name in todo}, structured=structured, unsupported=unsupported)
        write_unsupported(out, unsupported)
        todo = [t for t in todo if t[2] not in unsupported]
        names = [n for n in names if n not in unsupported]
        try:
            _run_todo(spec, problems, out, todo, names, contenders, progress)
        finally:
            close_contenders(contenders)
    ran = attrs.evolve(spec, peers=tuple(p for p in spec.peers if p not in unsupported))
    results = summarize(ran, problems, read_records(out))
    if unsupported:
        results["unsupported"] = dict(unsupported)
    write_outputs(results, out, spec.columns)
    return results


UNSUPPORTED_JSON = "unsupported.json"
"""Peers that could not start in this run folder, with why (kept across resumes)."""


def read_unsupported(out: Path) -> dict[str, str]:
    path = out / UNSUPPORTED_JSON
    return json.loads(path.read_text()) if path.exists() else {}


def write_unsupported(out: Path, unsupported: dict[str, str]) -> None:
    if unsupported:
        (out / UNSUPPORTED_JSON).write_text(json.dumps(unsupported, indent=1) + "\n")


def rotation(names: list[str], index: int) -> list[str]:
    """The contenders' order for prompt ``index``: ``names`` rotated left by ``index``."""
    k = index % len(names) if names else 0
    return names[k:] + names[:k]


def build_contenders(spec: BenchSpec, names: set[str], structured: bool = False,
                     unsupported: dict[str, str] | None = None) -> dict[str, Contender]:
    """Contenders for ``names`` (engines load the target once; peers reuse it). ``structured``:
    prompts carry their own response formats (a structured-output dataset). A peer of
    :data:`MAY_BE_UNSUPPORTED` that cannot start is left out and its reason put in ``unsupported``
    (without that dict, its failure is raised like any other)."""
    out: dict[str, Contender] = {}
    try:
        for entry in spec.entries:
            if entry.name in names:
                if entry.served:
                    out[entry.name] = TorchServedContender(entry.name, entry.config,
                                                           served_config_file(entry.config, entry.name))
                elif spec.backend == "sglang":
                    out[entry.name] = SGLangContender(entry.name, entry.config,
                                                      config_path=served_config_file(entry.config, entry.name))
                else:
                    out[entry.name] = ConfigContender(entry, structured=structured)
        for peer in spec.peers:
            if peer in names:
                if peer in SGLANG_PEERS:
                    try:
                        out[peer] = SGLangContender(peer, spec.entries[0].config, peer=peer)
                    except AdaptiveSpecError as exc:
                        if unsupported is None or peer not in MAY_BE_UNSUPPORTED:
                            raise
                        unsupported[peer] = f"not supported here: {exc}"
                else:
                    out[peer] = HfPeer(peer, spec.entries[0].config)
    except BaseException:
        close_contenders(out)
        raise
    return out


def close_contenders(contenders: dict[str, Contender]) -> None:
    """Close every contender (SGLang servers stop; the others have nothing to stop)."""
    for c in contenders.values():
        c.close()


def run_one(contender: Contender, problem: Problem, index: int, max_new_tokens: int) -> RunRecord:
    """Generate and grade one (contender, prompt) pair: the record appended to ``records.jsonl``."""
    accepted: list[int] = []
    ids = contender.encode(problem.prompt)
    seed = contender.seed_for(index)  # record i samples with generation.seed + i
    fmt = response_format_of(problem)  # a structured-output prompt's own format (None: free text)
    extra = {"response_format": fmt} if fmt is not None else {}

    def on_step(record) -> None:  # drafted steps only (a plain step has ``undrafted`` set)
        if getattr(record, "undrafted", None) is None:
            accepted.append(record.accepted)

    result = contender.generate_ids(ids, max_new_tokens=max_new_tokens, on_step=on_step, seed=seed, **extra)
    graded = grade(problem, result.text)
    return RunRecord.from_stats(
        result.stats, config=contender.name, id=problem.id, index=index, seed=seed, correct=graded.correct,
        extracted=graded.extracted, grade_reason=graded.reason, accepted=accepted, text=result.text,
        finished_at=datetime.datetime.now().isoformat(timespec="seconds"))


def _run_todo(spec, problems, out, todo, names, contenders: dict[str, Contender], progress) -> None:
    """Warm every contender up, then run the pending (prompt, contender) pairs in order."""
    formats = {f for f in map(response_format_of, problems) if f is not None}  # structured output
    for c in contenders.values():  # untimed warm-up: first-call allocations hit nobody's numbers
        c.warm_up(problems, min(WARMUP_TOKENS, spec.max_new_tokens), formats)
    total = len(problems) * len(names)
    bar = tqdm(total=total, initial=total - len(todo), desc=f"{spec.command} {spec.dataset}", unit="gen",
               file=sys.stderr, dynamic_ncols=True, disable=not progress)
    with bar, open(out / RECORDS, "a") as sink:
        saved = total - len(todo)
        try:
            for index, problem, name in todo:
                record = run_one(contenders[name], problem, index, spec.max_new_tokens)
                sink.write(json.dumps(record.to_json()) + "\n")
                sink.flush()
                saved += 1
                bar.set_postfix_str(f"{name} {record.tokens_per_second:.1f} tok/s", refresh=False)
                bar.update()
        except KeyboardInterrupt:
            bar.close()
            print(f"adaptivespec: {saved} of {total} generations are saved in {out / RECORDS}; "
                  "rerun the same command to resume", file=sys.stderr)
            raise
