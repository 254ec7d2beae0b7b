"""The bench's typed records: one graded generation (:class:`RunRecord`, a line of ``records.jsonl``)
and one contender's summary (:class:`ContenderRow`, a row of ``results.json``'s ``configs``).

Their ``to_json()`` writes the JSON the bench has always written. Those field names, and their
order, are a contract that external checks read: ``tests/test_records.py`` pins them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

RECORD_FIELDS = ("id", "new_tokens", "target_forwards", "wall_seconds", "tokens_per_second",
                 "accept_length_mean", "promoted_tokens", "correct", "extracted", "prefill_seconds")
"""Per-prompt fields kept in ``results.json`` (``records.jsonl`` also has the text and steps)."""

_STATS = ("new_tokens", "target_forwards", "accept_length_mean", "wall_seconds", "tokens_per_second",
          "prefill_seconds", "promoted_tokens")
"""A contender's generation stats that :class:`RunRecord` types, in the order they are written."""


@attrs.frozen(kw_only=True)
class RunRecord:
    """One (contender, prompt) generation, graded: a line of ``records.jsonl``."""

    config: str
    """The contender's name (a config's file stem or a peer's name)."""
    id: str
    """The problem's id."""
    index: int
    """The problem's position in the run (its rotation and its sampling seed follow from it)."""
    seed: int | None = None
    """The seed it sampled with (``generation.seed + index``); None: greedy (and not written)."""
    new_tokens: int
    """Tokens generated."""
    target_forwards: int | None = None
    """Forwards of the target (None: the contender could not count them)."""
    accept_length_mean: float | None = None
    """``new_tokens / target_forwards``."""
    wall_seconds: float
    """Wall time of the generation, prefill included, grading excluded."""
    tokens_per_second: float | None = None
    """``new_tokens / wall_seconds``."""
    prefill_seconds: float | None = None
    """Wall time to the first token; None: not reported (peers; then not written)."""
    promoted_tokens: int | None = None
    """Tokens a lossy verifier promoted."""
    more_stats: dict[str, Any] = attrs.field(factory=dict)
    """The contender's other stats, as reported (``accepted_by_source``, ``mask_ms_per_step``)."""
    correct: bool | None = None
    """The grader's verdict (None: ungraded dataset)."""
    extracted: str | None = None
    """The final answer the grader extracted (None: none found or ungraded)."""
    grade_reason: str | None = None
    """The grader's one-line reason."""
    accepted: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Drafted tokens accepted at each speculative step (empty for plain decoding and peers)."""
    text: str | None = None
    """The generated text."""
    finished_at: str | None = None
    """Local time the record was made, to the second (ISO 8601)."""

    @classmethod
    def from_stats(cls, stats: dict[str, Any], **fields: Any) -> RunRecord:
        """A record of a generation's ``stats`` (``GenerationResult.stats``) and the other ``fields``."""
        typed = {k: stats[k] for k in _STATS if k in stats}
        return cls(**typed, more_stats={k: v for k, v in stats.items() if k not in typed}, **fields)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        """The record of a ``records.jsonl`` line (keys it does not type go to ``more_stats``)."""
        names = {f.name for f in attrs.fields(cls)} - {"more_stats"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   more_stats={k: v for k, v in data.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        """The ``records.jsonl`` line: ``config``, ``id``, ``index``, ``seed`` (sampled only), the
        stats in the contender's order, then the grade, ``accepted``, ``text`` and ``finished_at``."""
        out: dict[str, Any] = {"config": self.config, "id": self.id, "index": self.index}
        if self.seed is not None:
            out["seed"] = self.seed
        for key in _STATS:
            if key != "prefill_seconds" or self.prefill_seconds is not None:
                out[key] = getattr(self, key)
        out.update(self.more_stats)
        out.update(correct=self.correct, extracted=self.extracted, grade_reason=self.grade_reason,
                   accepted=list(self.accepted), text=self.text, finished_at=self.finished_at)
        return out

    def summary_json(self) -> dict[str, Any]:
        """The record as ``results.json`` keeps it: the :data:`RECORD_FIELDS` only."""
        return {k: getattr(self, k) for k in RECORD_FIELDS}


@attrs.frozen(kw_only=True)
class AcceptedPerStep:
    """Drafted tokens accepted per speculative step, over a contender's records."""

    steps: int
    """Speculative steps."""
    mean: float | None
    """Mean accepted per step (None: no steps)."""
    histogram: dict[str, int]
    """Accepted count (as a string, a JSON key) -> steps, in increasing count."""

    @classmethod
    def of(cls, records: list[RunRecord]) -> AcceptedPerStep:
        """The distribution over every step of ``records``."""
        steps = Counter(a for r in records for a in r.accepted)
        n = sum(steps.values())
        return cls(steps=n, mean=sum(k * v for k, v in steps.items()) / n if n else None,
                   histogram={str(k): steps[k] for k in sorted(steps)})


@attrs.frozen(kw_only=True)
class Totals:
    """Totals and means of one contender's records."""

    prompts: int
    """Records (prompts run)."""
    new_tokens: int
    """Tokens generated, over every record."""
    wall_seconds: float
    """Wall seconds, over every record."""
    tokens_per_second: float | None
    """``new_tokens / wall_seconds`` (None: no time)."""
    prefill_seconds: float | None
    """Wall seconds to the first token, over every record (None: some record does not report it)."""
    decode_tokens_per_second: float | None
    """The tokens after the first / the wall seconds after it (None without ``prefill_seconds``)."""
    target_forwards: int | None
    """Target forwards, over every record (None: some record could not count them)."""
    accept_length_mean: float | None
    """``new_tokens / target_forwards``."""
    promoted_tokens: int
    """Tokens a lossy verifier promoted, over every record."""
    accuracy: float | None
    """``correct / graded`` (None: nothing graded)."""
    graded: int
    """Records with a verdict."""
    correct: int
    """Records graded correct."""
    accepted_per_step: AcceptedPerStep
    """Drafted tokens accepted per step."""

    @classmethod
    def of(cls, records: list[RunRecord]) -> Totals:
        """The totals of ``records``."""
        new = sum(r.new_tokens for r in records)
        wall = sum(r.wall_seconds for r in records)
        forwards = [r.target_forwards for r in records]
        graded = [r.correct for r in records if r.correct is not None]
        prefill = [r.prefill_seconds for r in records]
        prefill_total = sum(prefill) if records and None not in prefill else None
        decode_wall = wall - prefill_total if prefill_total is not None else None
        known = bool(records) and None not in forwards
        return cls(
            prompts=len(records), new_tokens=new, wall_seconds=wall,
            tokens_per_second=new / wall if wall > 0 else None,
            prefill_seconds=prefill_total,
            decode_tokens_per_second=(new - len(records)) / decode_wall if decode_wall else None,
            target_forwards=sum(forwards) if known else None,
            accept_length_mean=new / sum(forwards) if known and sum(forwards) else None,
            promoted_tokens=sum(r.promoted_tokens or 0 for r in records),
            accuracy=sum(graded) / len(graded) if graded else None, graded=len(graded), correct=sum(graded),
            accepted_per_step=AcceptedPerStep.of(records),
        )

    def to_json(self) -> dict[str, Any]:
        """The totals as ``results.json`` writes them (in field order)."""
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class Agreement:
    """How far a contender's outputs agree with the reference's, on the prompts both ran."""

    answers_compared: int
    """Prompts run by both."""
    answers_equal: int
    """Of those, prompts whose extracted final answers are equal (two missing answers count as equal)."""
    answer_agreement: float | None
    """``answers_equal / answers_compared``."""
    identical_outputs: float | None
    """Share of the compared prompts whose whole text is equal."""

    @classmethod
    def of(cls, records: list[RunRecord], reference: list[RunRecord]) -> Agreement:
        """Agreement of ``records`` with ``reference``, matched by prompt id."""
        ref = {r.id: r for r in reference}
        pairs = [(r, ref[r.id]) for r in records if r.id in ref]
        equal = sum(r.extracted == q.extracted for r, q in pairs)
        same = sum(r.text == q.text for r, q in pairs)
        n = len(pairs)
        return cls(answers_compared=n, answers_equal=equal, answer_agreement=equal / n if n else None,
                   identical_outputs=same / n if n else None)


@attrs.frozen(kw_only=True)
class ContenderInfo:
    """What a contender is, before it runs: a config or a peer."""

    name: str
    """The contender's name."""
    kind: str
    """``config`` or ``peer``."""
    config: dict[str, Any]
    """The config as a JSON object; for a peer, what stands in for it (``describe_peer``)."""
    source: str | None = None
    """The config's file (configs only: a peer's row has no ``source``)."""
    lossless: bool
    """Whether it decodes exactly like greedy decoding of the target."""
    autoregressive: bool
    """Whether it decodes one token per target forward."""
    sampling: dict[str, Any]
    """The sampling settings (``temperature`` 0: greedy)."""
    sweep: dict[str, Any] | None = None
    """A sweep point's swept values (None: not a sweep point, and not written)."""

    def to_json(self) -> dict[str, Any]:
        """The row's leading keys, in the order ``results.json`` has them for each kind."""
        if self.kind == "peer":
            return {"name": self.name, "kind": self.kind, "lossless": self.lossless,
                    "autoregressive": self.autoregressive, "sampling": self.sampling, "config": self.config}
        out = {"name": self.name, "kind": self.kind, "config": self.config, "source": self.source,
               "lossless": self.lossless, "autoregressive": self.autoregressive, "sampling": self.sampling}
        return out | ({"sweep": self.sweep} if self.sweep is not None else {})


@attrs.frozen(kw_only=True)
class ContenderRow:
    """One contender's summary: a row of ``results.json``'s ``configs`` (and of each category's)."""

    info: ContenderInfo
    """What the contender is."""
    totals: Totals
    """Its totals over the prompts summarized."""
    complete: bool
    """Whether it ran every prompt summarized."""
    speedup_vs_ar: float | None
    """Its tokens/s over the autoregressive config's (None: no such config)."""
    decode_speedup_vs_ar: float | None
    """Its decode rate over the autoregressive config's."""
    speedup_vs_eagle3: float | None
    """Its tokens/s over the config named ``eagle3``'s."""
    speedup_vs_reference: float | None
    """Its tokens/s over the reference's."""
    retention: float | None
    """Its accuracy over the reference's."""
    agreement: Agreement
    """Its agreement with the reference's outputs."""
    records: tuple[RunRecord, ...]
    """Its records, in problem order."""

    @property
    def name(self) -> str:
        """The contender's name."""
        return self.info.name

    def to_json(self) -> dict[str, Any]:
        """The row as ``results.json`` writes it."""
        return {**self.info.to_json(), **self.totals.to_json(), "complete": self.complete,
                "speedup_vs_ar": self.speedup_vs_ar, "decode_speedup_vs_ar": self.decode_speedup_vs_ar,
                "speedup_vs_eagle3": self.speedup_vs_eagle3, "speedup_vs_reference": self.speedup_vs_reference,
                "retention": self.retention, **attrs.asdict(self.agreement),
                "records": [r.summary_json() for r in self.records]}
