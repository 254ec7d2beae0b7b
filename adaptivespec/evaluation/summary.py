"""One row per contender from a run's records: totals, speedups, retention and agreement.

The baselines: the *reference* (:func:`pick_reference`) is the base of retention and agreement,
the *AR* config (:func:`pick_ar`) of ``speedup_vs_ar``, the config named ``eagle3`` of
``speedup_vs_eagle3``. :func:`summarize_rows` is used for the whole run and, on each category's
prompts, by :mod:`adaptivespec.evaluation.categories`.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.peers import describe_peer
from adaptivespec.evaluation.records import Agreement, ContenderInfo, ContenderRow, RunRecord, Totals
from adaptivespec.evaluation.spec import BenchSpec, config_lossless, sampling_of


@attrs.frozen(kw_only=True)
class Summary:
    """The rows of a set of prompts and the baselines they were compared with."""

    rows: tuple[ContenderRow, ...]
    """One per contender, configs first, in the run's order."""
    reference: str | None
    """The lossless reference (None: no lossless config)."""
    ar: str | None
    """The autoregressive baseline (None: none in the run)."""
    eagle3: str | None
    """``eagle3`` when a contender has that name, else None."""


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def contender_infos(spec: BenchSpec) -> list[ContenderInfo]:
    """What each contender of ``spec`` is: its configs, then its peers (on the first config's target)."""
    infos = [ContenderInfo(name=e.name, kind="config", config=_jsonable(e.config.to_dict()), source=e.config.source,
                           lossless=config_lossless(e.config), autoregressive=e.config.autoregressive,
                           sampling=sampling_of(e.config), sweep=e.sweep) for e in spec.entries]
    first = spec.entries[0].config
    infos += [ContenderInfo(name=p, kind="peer", lossless=True, autoregressive=p == "sglang", sampling=sampling_of(first),
                            config=describe_peer(p, first)) for p in spec.peers]
    return infos


def pick_reference(infos: list[ContenderInfo], forced: str | None = None) -> str | None:
    """Name of the lossless reference for retention: ``forced``, else ``eagle3``, ``ar``, or the
    first lossless config (peers are never the reference)."""
    lossless = [i.name for i in infos if i.kind == "config" and i.lossless]
    if forced is not None:
        return forced
    for name in ("eagle3", "ar"):
        if name in lossless:
            return name
    return lossless[0] if lossless else None


def pick_ar(infos: list[ContenderInfo]) -> str | None:
    """Name of the autoregressive baseline: ``ar`` if it is one, else the first autoregressive contender."""
    ar = [i.name for i in infos if i.autoregressive]
    return "ar" if "ar" in ar else (ar[0] if ar else None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_rows(spec: BenchSpec, problems: list[Problem], records: list[RunRecord]) -> Summary:
    """The rows of ``problems``: each contender's records of those prompts, in problem order (records
    of other prompts or other contenders are left out), compared with the baselines."""
    by_name: dict[str, list[RunRecord]] = {n: [] for n in spec.names}
    order = {p.id: i for i, p in enumerate(problems)}
    for r in sorted(records, key=lambda r: order.get(r.id, len(order))):
        if r.config in by_name and r.id in order:
            by_name[r.config].append(r)
    infos = contender_infos(spec)
    totals = {i.name: Totals.of(by_name[i.name]) for i in infos}
    ref, ar = pick_reference(infos, spec.reference), pick_ar(infos)
    eagle3 = "eagle3" if "eagle3" in totals else None

    def row(info: ContenderInfo) -> ContenderRow:
        t = totals[info.name]
        vs = (lambda base: _ratio(t.tokens_per_second, totals[base].tokens_per_second) if base else None)
        return ContenderRow(
            info=info, totals=t, complete=t.prompts == len(problems), speedup_vs_ar=vs(ar),
            decode_speedup_vs_ar=_ratio(t.decode_tokens_per_second, totals[ar].decode_tokens_per_second) if ar else None,
            speedup_vs_eagle3=vs(eagle3), speedup_vs_reference=vs(ref),
            retention=_ratio(t.accuracy, totals[ref].accuracy) if ref else None,
            agreement=Agreement.of(by_name[info.name], by_name[ref] if ref else []),
            records=tuple(by_name[info.name]))

    return Summary(rows=tuple(map(row, infos)), reference=ref, ar=ar, eagle3=eagle3)
