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
lossless config chosen by :func:`pick_reference` (the sweep's ``--reference``; else the config named
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
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from adaptivespec.config import Config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import categories
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.graders import grade

DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 2048, "math500": 4096, "humaneval": 4096, "specbench": 1024, "mtbench": 1024, "longctx": 1024,
                          "structured": 192}
"""Per-dataset generation limits: the paper's (2048 for GSM8K, 4096 for MATH-500 and HumanEval);
Spec-Bench's harness default (1024) for the two chat sets; 192 for the JSON records of ``structured``."""

WARMUP_TOKENS = 8
"""Untimed tokens each contender generates on the first prompt before the measured run."""

SETTINGS, RECORDS = "settings.json", "records.jsonl"
RESULTS_JSON, RESULTS_MD = "results.json", "results.md"
SPEEDUP_PLOT, ACCEPT_PLOT, PARETO_PLOT = "speedup_retention.png", "accept_lengths.png", "pareto.png"

RECORD_FIELDS = ("id", "new_tokens", "target_forwards", "wall_seconds", "tokens_per_second",
                 "accept_length_mean", "promoted_tokens", "correct", "extracted", "prefill_seconds")
"""Per-prompt fields kept in ``results.json`` (``records.jsonl`` also has the text and steps)."""


@attrs.frozen(kw_only=True)
class Entry:
    """One config of a run."""

    name: str
    """Shown in tables and plots: the file stem (a sweep adds ``[key=value]``)."""
    config: Config
    sweep: dict[str, Any] | None = None
    """The swept parameter values of this point, for sweeps."""


@attrs.frozen(kw_only=True)
class BenchSpec:
    """Everything that defines a run (and must match to resume it)."""

    entries: tuple[Entry, ...]
    peers: tuple[str, ...] = ()
    dataset: str
    data: str | None = None
    limit: int | None = None
    max_new_tokens: int
    reference: str | None = None
    """Name of the lossless reference; None: :func:`pick_reference` decides."""
    command: str = "bench"
    columns: tuple[str, ...] = ()
    """Extra table columns, read from each entry's ``sweep`` values (the swept keys)."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Added to ``results.json`` (the sweep's parameters)."""
    backend: str = "torch"
    """Where the configs run: ``torch`` (adaptivespec's engine) or ``sglang`` (each config served by
    ``adaptivespec serve``, SGLang with the plugin; :mod:`adaptivespec.evaluation.sglang_contenders`)."""

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries] + list(self.peers)


def config_lossless(config: Config, host=None) -> bool:
    """Whether ``config`` decodes exactly like greedy decoding of its target (without loading it)."""
    if config.autoregressive:
        return True
    if host is None:
        from adaptivespec.plugins import get_plugin_host

        host = get_plugin_host()
    return bool(host.verifiers.get(config.verifier.name).cls.lossless)


def load_bench_config(path: str, overrides: list[str]) -> Config:
    """``load_config(path, overrides)``, except that ``model.drafter=...`` overrides leave an
    autoregressive config (``drafter: null`` in its file) autoregressive: ``--set
    model.drafter=DIR`` swaps the head of every speculative config without turning ``ar.yaml``
    into one."""
    from adaptivespec.config import load_config

    is_drafter = [o.partition("=")[0].strip() == "model.drafter" for o in overrides]
    if not any(is_drafter):
        return load_config(path, overrides)
    plain = load_config(path, [o for o, d in zip(overrides, is_drafter) if not d])
    return plain if plain.model.drafter is None else load_config(path, overrides)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# -- contenders: a config's engine or a peer, behind one interface ---------------------------------
class ConfigContender:
    kind = "config"

    def __init__(self, entry: Entry, structured: bool = False) -> None:
        from adaptivespec.decode import Engine

        self.name = entry.name
        self.engine = Engine(entry.config, structured=structured)
        self.lossless = self.engine.lossless

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def generate_ids(self, ids: list[int], *, max_new_tokens: int, on_step=None, seed: int | None = None,
                     response_format=None):
        return self.engine.generate_ids(ids, max_new_tokens=max_new_tokens, on_step=on_step, seed=seed,
                                        response_format=response_format)

    def seed_for(self, index: int) -> int | None:
        """Sampling seed of prompt ``index`` (``generation.seed + index``); None when greedy."""
        return sampling_seed(self.engine.config, index)

    def forget(self) -> None:
        """Drop what candidate sources remembered (the warm-up's output never drafts a prompt)."""
        self.engine.forget()

    def prepare(self, formats) -> None:
        """Compile the grammars of ``formats`` before the timed runs (compiled once per process)."""
        for fmt in formats:
            self.engine.make_constraint(fmt)


def sampling_seed(config: Config, index: int) -> int | None:
    """The seed prompt ``index`` of a run samples with: ``generation.seed + index`` (None: greedy)."""
    return None if config.generation.temperature == 0 else config.generation.seed + index


def sampling_of(config: Config) -> dict[str, Any]:
    """The sampling settings of ``config`` (``temperature`` 0: greedy), as recorded in results."""
    g = config.generation
    return {"temperature": g.temperature, "top_k": g.top_k, "top_p": g.top_p, "min_p": g.min_p, "seed": g.seed}


def build_contenders(spec: BenchSpec, names: set[str], structured: bool = False) -> dict[str, Any]:
    """Contenders for ``names`` (engines load the target once; peers reuse it). ``structured``:
    prompts carry their own response formats (a structured-output dataset)."""
    from adaptivespec.evaluation.peers import HfPeer
    from adaptivespec.evaluation.sglang_contenders import SGLANG_PEERS, SGLangContender, served_config_file

    out: dict[str, Any] = {}
    try:
        for entry in spec.entries:
            if entry.name in names:
                if spec.backend == "sglang":
                    out[entry.name] = SGLangContender(entry.name, entry.config,
                                                      config_path=served_config_file(entry.config, entry.name))
                else:
                    out[entry.name] = ConfigContender(entry, structured=structured)
        for peer in spec.peers:
            if peer in names:
                if peer in SGLANG_PEERS:
                    out[peer] = SGLangContender(peer, spec.entries[0].config, peer=peer)
                else:
                    out[peer] = HfPeer(peer, spec.entries[0].config)
    except BaseException:
        close_contenders(out)
        raise
    return out


def close_contenders(contenders: dict[str, Any]) -> None:
    """Stop what the contenders started (SGLang servers); the rest have nothing to close."""
    for c in contenders.values():
        if hasattr(c, "close"):
            c.close()


def run_one(contender, problem: Problem, index: int, max_new_tokens: int) -> dict[str, Any]:
    """Generate and grade one (contender, prompt) pair; the record appended to ``records.jsonl``."""
    accepted: list[int] = []
    ids = contender.encode(problem.prompt)
    seed = contender.seed_for(index)  # record i samples with generation.seed + i
    fmt = response_format_of(problem)  # a structured-output prompt's own format (None: free text)
    extra = {"response_format": fmt} if fmt is not None else {}
    result = contender.generate_ids(ids, max_new_tokens=max_new_tokens, on_step=lambda r: accepted.append(r.accepted),
                                    seed=seed, **extra)
    graded = grade(problem, result.text)
    return {
        "config": contender.name,
        "id": problem.id,
        "index": index,
        **({"seed": seed} if seed is not None else {}),
        **result.stats,
        "correct": graded.correct,
        "extracted": graded.extracted,
        "grade_reason": graded.reason,
        "accepted": accepted,
        "text": result.text,
        "finished_at": datetime.datetime.now().isoformat(timespec="seconds"),
    }


_FORMATS: dict[str, Any] = {}


def response_format_of(problem: Problem):
    """The problem's own ``response_format`` (``meta``) as a validated
    :class:`~adaptivespec.config.ResponseFormat` (parsed once per distinct format), or None."""
    raw = problem.meta.get("response_format")
    if raw is None:
        return None
    key = json.dumps(raw, sort_keys=True)
    if key not in _FORMATS:
        from adaptivespec.response_format import parse_response_format

        _FORMATS[key] = parse_response_format(raw, problem.id)
    return _FORMATS[key]


def rotation(names: list[str], index: int) -> list[str]:
    """The contenders' order for prompt ``index``: ``names`` rotated left by ``index``."""
    k = index % len(names) if names else 0
    return names[k:] + names[:k]


# -- the run directory -------------------------------------------------------------------------------
def settings_of(spec: BenchSpec, problems: list[Problem]) -> dict[str, Any]:
    """What a run directory's records were made with (compared on resume)."""
    return _jsonable({
        "command": spec.command,
        "dataset": spec.dataset,
        "data": str(Path(spec.data).resolve()) if spec.data else None,
        "limit": spec.limit,
        "max_new_tokens": spec.max_new_tokens,
        "configs": {e.name: e.config.to_dict() for e in spec.entries},
        "peers": list(spec.peers),
        **({"backend": spec.backend} if spec.backend != "torch" else {}),
        "reference": spec.reference,
        "problems": [p.id for p in problems],
    })


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every differing leaf; a level's own values before nested ones."""
    diffs = []
    keys = sorted(set(old) | set(new), key=lambda k: (isinstance(old.get(k), dict) or isinstance(new.get(k), dict), str(k)))
    for key in keys:
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            show = (lambda v: f"{len(v)} items" if isinstance(v, list) and len(v) > 4 else json.dumps(v))
            diffs.append(f"{prefix}{key}: {show(a)} -> {show(b)}")
    return diffs


def open_run_dir(out: Path, settings: dict[str, Any]) -> None:
    """Create ``out`` with its settings, or check an existing one was made with the same settings."""
    if out.exists() and not out.is_dir():
        raise AdaptiveSpecError(f"--out: {out} exists and is not a folder")
    path = out / SETTINGS
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise AdaptiveSpecError(f"--out: {path} is not valid JSON; delete the folder or use another --out") from None
        diffs = _differences(old, settings)
        if diffs:
            more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
            raise AdaptiveSpecError(
                f"--out: {out} holds a run made with different settings ({'; '.join(diffs[:3])}{more}); "
                "rerun with the same arguments to resume it, or choose another --out"
            )
        return
    if out.is_dir() and (out / RECORDS).is_file():
        raise AdaptiveSpecError(f"--out: {out} has {RECORDS} but no {SETTINGS}; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def read_records(out: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Records of ``out/records.jsonl``; a last line cut short by a kill is dropped (and, with
    ``repair``, removed from the file so appending continues cleanly)."""
    path = out / RECORDS
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            last = all(not rest.strip() for rest in lines[n:])
            if not last:
                raise AdaptiveSpecError(f"{path}:{n}: invalid JSON; delete that line (or the folder) and rerun") from None
            if repair:
                path.write_text("\n".join(lines[: n - 1]) + ("\n" if n > 1 else ""))
            break
    else:
        if repair and text and not text.endswith("\n"):
            path.write_text(text + "\n")
    return records


# -- the run -------------------------------------------------------------------------------------------
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
    done = {(r["config"], r["id"]) for r in read_records(out, repair=True)}
    todo = [(i, p, name) for i, p in enumerate(problems) for name in rotation(names, i) if (name, p.id) not in done]
    if todo:
        structured = any(p.meta.get("response_format") is not None for p in problems)
        contenders = build_contenders(spec, {name for _, _, name in todo}, structured=structured)
        try:
            _run_todo(spec, problems, out, todo, names, contenders, progress)
        finally:
            close_contenders(contenders)
    results = summarize(spec, problems, read_records(out))
    write_outputs(results, out, spec.columns)
    return results


def warmup_problems(problems: list[Problem]) -> list[Problem]:
    """The prompts a contender warms up on: the first, and the longest where that is another one (a
    long prompt's first prefill allocates its caches and meets new kernel sizes: at ~4k tokens it
    took up to twice as long as the next, which fell on whichever contender ran it first)."""
    if not problems:
        return []
    longest = max(problems, key=lambda p: len(p.prompt))
    return [problems[0]] + ([longest] if longest is not problems[0] else [])


def _run_todo(spec, problems, out, todo, names, contenders, progress) -> None:
    """Warm every contender up, then run the pending (prompt, contender) pairs in order."""
    from tqdm import tqdm

    formats = {f for f in map(response_format_of, problems) if f is not None}  # structured output
    for c in contenders.values():  # untimed warm-up: first-call allocations hit nobody's numbers
        # a contender that compiles per prompt length (SGLang's CPU backend) warms up on every prompt
        for problem in problems if getattr(c, "warm_every_prompt", False) else warmup_problems(problems):
            fmt = response_format_of(problem)
            c.generate_ids(c.encode(problem.prompt), max_new_tokens=min(WARMUP_TOKENS, spec.max_new_tokens),
                           **({"response_format": fmt} if fmt is not None else {}))
        if hasattr(c, "forget"):
            c.forget()
        if formats and hasattr(c, "prepare"):  # grammars compiled before any timed run
            c.prepare(formats)
    total = len(problems) * len(names)
    bar = tqdm(total=total, initial=total - len(todo), desc=f"{spec.command} {spec.dataset}", unit="gen",
               file=sys.stderr, dynamic_ncols=True, disable=not progress)
    with bar, open(out / RECORDS, "a") as sink:
        saved = total - len(todo)
        try:
            for index, problem, name in todo:
                record = run_one(contenders[name], problem, index, spec.max_new_tokens)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                saved += 1
                bar.set_postfix_str(f"{name} {record['tokens_per_second']:.1f} tok/s", refresh=False)
                bar.update()
        except KeyboardInterrupt:
            bar.close()
            print(f"adaptivespec: {saved} of {total} generations are saved in {out / RECORDS}; "
                  "rerun the same command to resume", file=sys.stderr)
            raise


# -- aggregation -----------------------------------------------------------------------------------------
def pick_reference(rows: list[dict[str, Any]], forced: str | None = None) -> str | None:
    """Name of the lossless reference for retention: ``forced``, else ``eagle3``, ``ar``, or the
    first lossless config (peers are never the reference)."""
    lossless = [r["name"] for r in rows if r["kind"] == "config" and r["lossless"]]
    if forced is not None:
        return forced
    for name in ("eagle3", "ar"):
        if name in lossless:
            return name
    return lossless[0] if lossless else None


def pick_ar(rows: list[dict[str, Any]]) -> str | None:
    ar = [r["name"] for r in rows if r.get("autoregressive")]
    return "ar" if "ar" in ar else (ar[0] if ar else None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and means of one contender's records."""
    new = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_seconds"] for r in records)
    forwards = [r.get("target_forwards") for r in records]
    graded = [r["correct"] for r in records if r.get("correct") is not None]
    steps = Counter(a for r in records for a in r.get("accepted", []))
    n_steps = sum(steps.values())
    prefill = [r.get("prefill_seconds") for r in records]
    prefill_total = sum(prefill) if records and None not in prefill else None
    decode_wall = wall - prefill_total if prefill_total is not None else None
    return {
        "prompts": len(records),
        "new_tokens": new,
        "wall_seconds": wall,
        "tokens_per_second": new / wall if wall > 0 else None,
        "prefill_seconds": prefill_total,
        "decode_tokens_per_second": (new - len(records)) / decode_wall if decode_wall else None,
        "target_forwards": sum(forwards) if records and None not in forwards else None,
        "accept_length_mean": new / sum(forwards) if records and None not in forwards and sum(forwards) else None,
        "promoted_tokens": sum(r.get("promoted_tokens") or 0 for r in records),
        "accuracy": sum(graded) / len(graded) if graded else None,
        "graded": len(graded),
        "correct": sum(graded),
        "accepted_per_step": {
            "steps": n_steps,
            "mean": sum(k * v for k, v in steps.items()) / n_steps if n_steps else None,
            "histogram": {str(k): steps[k] for k in sorted(steps)},
        },
    }


def agreement(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Final-answer and whole-text agreement of ``records`` with the reference's, per prompt id."""
    ref = {r["id"]: r for r in reference}
    pairs = [(r, ref[r["id"]]) for r in records if r["id"] in ref]
    equal = sum(r.get("extracted") == q.get("extracted") for r, q in pairs)
    same = sum(r.get("text") == q.get("text") for r, q in pairs)
    n = len(pairs)
    return {"answers_compared": n, "answers_equal": equal,
            "answer_agreement": equal / n if n else None,
            "identical_outputs": same / n if n else None}


def summarize(spec: BenchSpec, problems: list[Problem], records: list[dict[str, Any]], by_category: bool = True) -> dict[str, Any]:
    """The ``results.json`` document of a run from its records (with ``categories``, the same
    aggregates per prompt category, when the dataset has categories and ``by_category``)."""
    from adaptivespec.evaluation.peers import describe_peer

    by_name: dict[str, list[dict[str, Any]]] = {n: [] for n in spec.names}
    order = {p.id: i for i, p in enumerate(problems)}
    for r in sorted(records, key=lambda r: order.get(r["id"], len(order))):
        if r["config"] in by_name and r["id"] in order:
            by_name[r["config"]].append(r)
    rows: list[dict[str, Any]] = []
    for e in spec.entries:
        rows.append({"name": e.name, "kind": "config", "config": _jsonable(e.config.to_dict()), "source": e.config.source,
                     "lossless": config_lossless(e.config), "autoregressive": e.config.autoregressive,
                     "sampling": sampling_of(e.config),
                     **({"sweep": e.sweep} if e.sweep is not None else {})})
    first = spec.entries[0].config
    for p in spec.peers:
        rows.append({"name": p, "kind": "peer", "lossless": True, "autoregressive": p == "sglang",
                     "sampling": sampling_of(first), "config": describe_peer(p, first)})
    for row in rows:
        row.update(aggregate(by_name[row["name"]]))
        row["complete"] = row["prompts"] == len(problems)
    ref, ar = pick_reference(rows, spec.reference), pick_ar(rows)
    tps = {r["name"]: r["tokens_per_second"] for r in rows}
    decode_tps = {r["name"]: r["decode_tokens_per_second"] for r in rows}
    acc = {r["name"]: r["accuracy"] for r in rows}
    eagle3 = "eagle3" if "eagle3" in tps else None
    for row in rows:
        row["speedup_vs_ar"] = _ratio(row["tokens_per_second"], tps[ar]) if ar else None
        row["decode_speedup_vs_ar"] = _ratio(row["decode_tokens_per_second"], decode_tps[ar]) if ar else None
        row["speedup_vs_eagle3"] = _ratio(row["tokens_per_second"], tps[eagle3]) if eagle3 else None
        row["speedup_vs_reference"] = _ratio(row["tokens_per_second"], tps[ref]) if ref else None
        row["retention"] = _ratio(row["accuracy"], acc[ref]) if ref else None
        row.update(agreement(by_name[row["name"]], by_name[ref] if ref else []))
        row["records"] = [{k: r.get(k) for k in RECORD_FIELDS} for r in by_name[row["name"]]]
    return {
        "meta": run_metadata(spec, problems),
        "reference": ref,
        "ar": ar,
        "eagle3": eagle3,
        **spec.extra,
        "configs": rows,
        **({"categories": categories.by_category(spec, problems, records)}
           if by_category and categories.categories(problems) else {}),
    }


def run_metadata(spec: BenchSpec, problems: list[Problem]) -> dict[str, Any]:
    import torch
    import transformers

    from adaptivespec import __version__

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
    import torch

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
def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


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
        cells = [name, *sweep, "yes" if r["lossless"] else "no", _fmt(r["tokens_per_second"], ".2f"),
                 _fmt(r["speedup_vs_ar"], ".2f", "×"), _fmt(r["speedup_vs_eagle3"], ".2f", "×"),
                 *([_fmt(r["speedup_vs_reference"], ".2f", "×")] if by_ref else []),
                 _fmt(r["accept_length_mean"], ".2f"), acc,
                 "–" if r["retention"] is None else f"{100 * r['retention']:.1f}%",
                 "–" if r["answer_agreement"] is None else f"{100 * r['answer_agreement']:.1f}% ({r['answers_equal']}/{r['answers_compared']})",
                 _fmt(None if r["identical_outputs"] is None else 100 * r["identical_outputs"], ".0f", "%")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + categories.markdown(results)


def write_outputs(results: dict[str, Any], out: Path, extra_columns: tuple[str, ...] = ()) -> None:
    """results.json, results.md and the plots (``pareto.png`` too for a sweep)."""
    from adaptivespec.evaluation import plots

    (out / RESULTS_JSON).write_text(json.dumps(results, indent=1) + "\n")
    (out / RESULTS_MD).write_text(markdown(results, list(extra_columns)))
    plots.speedup_retention(results, out / SPEEDUP_PLOT)
    plots.accept_lengths(results, out / ACCEPT_PLOT)
    if "sweep" in results:
        plots.pareto(results, out / PARETO_PLOT)
    if results.get("categories"):
        plots.category_speedups(results, out / categories.CATEGORY_PLOT)
