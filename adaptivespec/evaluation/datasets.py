"""Evaluation sets shipped with the package, loaded as :class:`Problem` records.

Known names and what the model is asked (the ``prompt`` is sent as the single user message):

* ``gsm8k`` (1319, grade-school math): the question, then :data:`GSM8K_INSTRUCTION`, which asks
  for step-by-step reasoning ending with ``The answer is N.`` -- the form
  :func:`adaptivespec.evaluation.graders.extract_gsm8k_answer` looks for first. ``reference`` is
  the number after ``####`` in the dataset's answer (as written, e.g. ``2,125``).
* ``math500`` (500, MATH competition problems): the problem, then :data:`MATH_INSTRUCTION`, which
  asks for the final answer in ``\\boxed{}``. ``reference`` is the dataset's ``answer`` (LaTeX).
* ``humaneval`` (164, Python functions): :data:`HUMANEVAL_INSTRUCTION` followed by the prompt code
  in a fenced block. ``reference`` is the canonical solution (a function body); ``meta`` holds
  ``prompt``, ``test``, ``entry_point`` and ``canonical_solution``.
* ``specbench`` (480) and ``mtbench`` (80): the first turn, unchanged. ``reference`` is the first
  turn's reference when the record has one as a string; ``meta`` holds all ``turns`` and the raw
  ``references`` (Spec-Bench ``rag`` records have a list of acceptable answers there instead).

* ``longctx`` (72, long-document summarization and QA at ~512, 1k, 2k and 4k tokens of prompt):
  same fields as ``specbench``; categories ``summarize-<len>`` and ``qa-<len>``. Made by
  ``scripts/make_longctx_set.py`` from training documents at text no draft head has seen; its
  ``tune.jsonl`` is the split for tuning.

* ``structured`` (30, structured output, see ``data/structured/README.md``): extract fields from a
  passage into a JSON schema, or answer with a JSON tool call; every record carries its own
  ``response_format`` (kept in ``meta``; the bench constrains each prompt with it) and a
  ``category`` (``extract-bio``, ``extract-plot``, ``function-call``). ``reference`` is None: the
  grader checks that the output parses and validates against the schema.

``load_dataset(name, path=...)`` reads another JSON-lines file (optionally ``.gz``) with the same
fields as the named set.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from adaptivespec.errors import AdaptiveSpecError

GSM8K_INSTRUCTION = (
    "Solve the problem step by step. End your reply with a final line of the form "
    "'The answer is N.', where N is the final number only."
)
"""Appended to every GSM8K question."""

MATH_INSTRUCTION = (
    "Solve the problem step by step. Put the final answer, in simplest form, inside \\boxed{}."
)
"""Appended to every MATH-500 problem."""

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Keep its name and signature, and reply with the "
    "complete function (with any imports it needs) in a single ```python code block."
)
"""Put before every HumanEval prompt (the prompt code follows in a fenced block)."""


class DatasetError(AdaptiveSpecError, ValueError):
    """An unknown dataset name, or a data file that is missing or malformed."""


@attrs.frozen(kw_only=True)
class Problem:
    """One evaluation item: what the model is asked and what a grader compares against."""

    id: str
    """Stable id: ``gsm8k/<index>``, MATH ``unique_id``, HumanEval ``task_id``, question id."""
    prompt: str
    """The user message sent to the model."""
    reference: str | None
    """Gold answer (GSM8K number, MATH LaTeX answer, HumanEval canonical body), if any."""
    task: str
    """Dataset name; selects the grader."""
    category: str | None = None
    """MATH subject, Spec-Bench / MT-Bench category; ``None`` elsewhere."""
    meta: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Everything else the record carries (HumanEval ``test``/``entry_point``/``prompt``, ...)."""


_Builder = Callable[[dict[str, Any], int], Problem]


def _gsm8k(row: dict[str, Any], index: int) -> Problem:
    answer = _text(row, "answer")
    gold = answer.rsplit("####", 1)[1].strip() if "####" in answer else None
    return Problem(
        id=f"gsm8k/{index}",
        prompt=f"{_text(row, 'question').strip()}\n\n{GSM8K_INSTRUCTION}",
        reference=gold,
        task="gsm8k",
        meta={"solution": answer},
    )


def _math500(row: dict[str, Any], index: int) -> Problem:
    return Problem(
        id=str(row.get("unique_id", f"math500/{index}")),
        prompt=f"{_text(row, 'problem').strip()}\n\n{MATH_INSTRUCTION}",
        reference=_text(row, "answer"),
        task="math500",
        category=row.get("subject"),
        meta={"solution": row.get("solution"), "level": row.get("level")},
    )


def _humaneval(row: dict[str, Any], index: int) -> Problem:
    code = _text(row, "prompt")
    meta = {key: _text(row, key) for key in ("prompt", "test", "entry_point")}
    meta["canonical_solution"] = row.get("canonical_solution")
    return Problem(
        id=str(row.get("task_id", f"humaneval/{index}")),
        prompt=f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```",
        reference=row.get("canonical_solution"),
        task="humaneval",
        meta=meta,
    )


def _chat(task: str) -> _Builder:
    def build(row: dict[str, Any], index: int) -> Problem:
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise KeyError("turns")
        references = row.get("reference")
        first_ref = references[0] if isinstance(references, list) and references else None
        return Problem(
            id=str(row.get("question_id", index)),
            prompt=turns[0],
            reference=first_ref if isinstance(first_ref, str) else None,
            task=task,
            category=row.get("category"),
            meta={"turns": list(turns), "references": references},
        )

    return build


def _structured(row: dict[str, Any], index: int) -> Problem:
    fmt = row.get("response_format")
    if not isinstance(fmt, dict):
        raise KeyError("response_format")
    return Problem(
        id=str(row.get("id", f"structured/{index}")),
        prompt=_text(row, "prompt"),
        reference=None,
        task="structured",
        category=row.get("category"),
        meta={"response_format": fmt, "source": row.get("source")},
    )


_DATASETS: dict[str, tuple[str, _Builder]] = {
    "gsm8k": ("gsm8k/test.jsonl", _gsm8k),
    "math500": ("math500/test.jsonl", _math500),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", _humaneval),
    "specbench": ("specbench/question.jsonl", _chat("specbench")),
    "mtbench": ("mtbench/question.jsonl", _chat("mtbench")),
    "longctx": ("longctx/question.jsonl", _chat("longctx")),
    "structured": ("structured/structured.jsonl", _structured),
}

DATASETS: tuple[str, ...] = tuple(_DATASETS)
"""Names accepted by :func:`load_dataset`."""


def _text(row: dict[str, Any], key: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise KeyError(key)
    return value


def default_path(name: str) -> Path:
    """The packaged file of dataset ``name``."""
    relative, _ = _lookup(name)
    return Path(str(importlib.resources.files(__package__).joinpath("data", relative)))


def _lookup(name: str) -> tuple[str, _Builder]:
    if name not in _DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    return _DATASETS[name]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            yield from enumerate(handle, start=1)
    except FileNotFoundError:
        raise DatasetError(f"dataset file not found: {path}") from None
    except IsADirectoryError:
        raise DatasetError(f"dataset path is a directory, not a JSON-lines file: {path}") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from None


def _parse(path: Path, lineno: int, line: str, name: str, build: _Builder, index: int) -> Problem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    try:
        return build(row, index)
    except KeyError as exc:
        raise DatasetError(
            f"{path}:{lineno}: missing or invalid field {exc.args[0]!r} for dataset {name!r}"
        ) from None


def load_dataset(
    name: str, path: str | Path | None = None, limit: int | None = None
) -> list[Problem]:
    """Load dataset ``name`` (one of :data:`DATASETS`) as a list of problems, in file order.

    ``path`` reads another JSON-lines file (``.gz`` allowed) with the fields of ``name``;
    ``limit`` keeps the first ``limit`` records. Blank lines are skipped. Raises
    :class:`DatasetError` (an :class:`AdaptiveSpecError`) for an unknown name, a bad ``limit``,
    or a missing or malformed file.
    """
    relative, build = _lookup(name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DatasetError(f"limit must be a non-negative integer or None, got {limit!r}")
    source = Path(path) if path is not None else default_path(name)
    problems: list[Problem] = []
    for lineno, line in _lines(source):
        if limit is not None and len(problems) >= limit:
            break
        if line.strip():
            problems.append(_parse(source, lineno, line, name, build, len(problems)))
    return problems
