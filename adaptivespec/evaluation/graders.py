"""Graders: decide whether a model's completion answers a :class:`Problem` correctly.

:func:`grade` dispatches on ``problem.task``:

* ``gsm8k`` -- :func:`extract_gsm8k_answer` takes the number after the last "answer is", else
  after the last ``####``, else in the last ``\\boxed{}``, else the last number in the text;
  :func:`parse_number` reads ``1,234``, ``$1,000.00``, ``-3``, ``12.0``, ``.5`` and ``3/4`` as
  exact fractions, so the comparison with the gold number is exact.
* ``math500`` -- :func:`extract_math_answer` takes the last ``\\boxed{}``/``\\fbox{}`` (nested
  braces allowed), else the text after the last "answer is"; equivalence is decided by
  Hugging Face's math-verify through :func:`adaptivespec.evaluation.math_answers.equivalent`
  (under a time limit).
* ``humaneval`` -- pass@1: :func:`humaneval_program` builds prompt/completion + test +
  ``check(entry_point)``, run by :func:`adaptivespec.evaluation.sandbox.run_python` in a separate
  process with a time limit.
* ``specbench``/``mtbench``/``longctx`` -- no grader: ``correct`` is ``None``.

No grader raises for a bad completion: every failure is ``correct=False`` with a reason.
"""

from __future__ import annotations

import re
import textwrap
from fractions import Fraction

import attrs

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.math_answers import equivalent, last_boxed
from adaptivespec.evaluation.sandbox import run_python

_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)(?![\d/])"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


@attrs.frozen(kw_only=True)
class GradeResult:
    """Outcome of grading one completion."""

    correct: bool | None
    """Right or wrong; ``None`` for tasks without a grader."""
    extracted: str | None
    """The answer (or program) taken from the completion, if any was found."""
    reason: str
    """One line: why it is right, wrong or ungraded."""


def _result(correct: bool | None, extracted: str | None, reason: str) -> GradeResult:
    return GradeResult(correct=correct, extracted=extracted, reason=reason)


def grade(problem: Problem, completion: str, *, timeout: float = 10.0) -> GradeResult:
    """Grade ``completion`` for ``problem``; ``timeout`` bounds HumanEval programs (seconds)."""
    if problem.task == "gsm8k":
        return grade_gsm8k(completion, problem.reference)
    if problem.task == "math500":
        return grade_math(completion, problem.reference)
    if problem.task == "humaneval":
        return grade_humaneval(problem, completion, timeout=timeout)
    if problem.task == "structured":
        return grade_structured(problem, completion)
    if problem.task in ("specbench", "mtbench", "longctx"):
        return _result(None, None, f"no grader for task {problem.task!r}")
    raise AdaptiveSpecError(
        f"no grader for task {problem.task!r}; graded tasks: gsm8k, math500, humaneval "
        "(specbench, mtbench and longctx are ungraded)"
    )


def grade_structured(problem: Problem, completion: str) -> GradeResult:
    """Correct when the output parses as JSON and validates against the record's schema (the
    ``jsonschema`` package; without it, parsing alone). A cut output (max tokens) fails."""
    import json

    try:
        value = json.loads(completion)
    except json.JSONDecodeError as exc:
        return _result(False, None, f"not JSON ({exc.msg} at char {exc.pos})")
    schema = problem.meta.get("response_format", {}).get("schema")
    if schema is None:
        return _result(True, None, "valid JSON")
    try:
        import jsonschema
    except ImportError:
        return _result(True, None, "valid JSON (jsonschema not installed: schema not checked)")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return _result(False, None, f"schema: {exc.message}")
    return _result(True, None, "valid against the schema")


# ----------------------------------------------------------------------------------------- GSM8K


def _clean_numbers(text: str) -> str:
    """Drop dollar signs, LaTeX thousands separators and markdown emphasis around numbers."""
    text = text.replace("\\$", "").replace("$", "").replace("{,}", ",").replace(",\\!", ",")
    return re.sub(r"(?<=\d)\s*\\?%", "", text).replace("**", "")


def _first_number(text: str) -> str | None:
    match = _NUMBER.search(_clean_numbers(text))
    return match.group(0) if match else None


def extract_gsm8k_answer(completion: str) -> str | None:
    """The final number of a GSM8K answer as written (``"1,234"``, ``"-3"``), or ``None``."""
    for marker in (_ANSWER_IS, re.compile(re.escape("####"))):
        matches = list(marker.finditer(completion))
        if matches:
            line = completion[matches[-1].end() :].split("\n", 1)[0]
            number = _first_number(line)
            if number is not None:
                return number
    boxed = last_boxed(completion)
    if boxed is not None and _first_number(boxed) is not None:
        return _first_number(boxed)
    numbers = _NUMBER.findall(_clean_numbers(completion))
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """Exact value of ``1,234`` / ``$1,000.00`` / ``-3`` / ``12.0`` / ``3/4``; ``None`` if none."""
    cleaned = _clean_numbers(text).strip().rstrip(".").replace(",", "").replace(" ", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _show(value: Fraction) -> str:
    """``12``, ``0.25`` (terminating decimals) or ``1/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 7):
        if (value * 10**places).denominator == 1:
            scaled = abs(int(value * 10**places))
            sign = "-" if value < 0 else ""
            return f"{sign}{scaled // 10**places}.{scaled % 10**places:0{places}d}"
    return str(value)


def grade_gsm8k(completion: str, reference: str | None) -> GradeResult:
    """Compare the final number of ``completion`` with the gold number ``reference`` exactly."""
    gold = parse_number(reference) if reference is not None else None
    if gold is None:
        return _result(False, None, f"unusable reference {reference!r}")
    found = extract_gsm8k_answer(completion)
    value = parse_number(found) if found is not None else None
    if value is None:
        return _result(False, None, "no number found in the completion")
    correct = value == gold
    verdict = "equals" if correct else "differs from"
    return _result(correct, _show(value), f"{_show(value)} {verdict} gold {_show(gold)}")


# -------------------------------------------------------------------------------------- MATH-500


def extract_math_answer(completion: str) -> str | None:
    """The last ``\\boxed{}``/``\\fbox{}`` content, else the rest of the last "answer is" line."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS.finditer(completion))
    if not matches:
        return None
    line = completion[matches[-1].end() :].split("\n", 1)[0].strip()
    line = line.strip("*").strip()
    if line.startswith("$") and line.count("$") >= 2:
        line = line[1 : line.index("$", 1)]
    return line.rstrip(".").strip() or None


def grade_math(completion: str, reference: str | None, *, timeout: float = 2.0) -> GradeResult:
    """Whether the extracted answer is mathematically equivalent to ``reference``."""
    if not reference:
        return GradeResult(correct=False, extracted=None, reason="no reference answer")
    found = extract_math_answer(completion)
    if found is None:
        return GradeResult(correct=False, extracted=None, reason="no \\boxed{} answer found")
    correct = equivalent(found, reference, timeout=timeout)
    verdict = "equivalent to" if correct else "not equivalent to"
    return _result(correct, found, f"{found!r} {verdict} gold {reference!r}")


# ------------------------------------------------------------------------------------- HumanEval


def extract_code(completion: str, entry_point: str) -> str:
    """Code of a completion: the fenced block defining ``entry_point``, else the first Python (or
    any) fenced block (an unclosed fence runs to the end), else the whole completion."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    for language, code in blocks:
        if defines.search(code):
            return code
    for language, code in blocks:
        if language.lower() in ("python", "py", "python3"):
            return code
    return blocks[0][1]


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program to run: the prompt (imports, helpers) followed by the completion's function if
    it redefines ``entry_point``, else prompt + completion as the body; then the tests."""
    code = extract_code(completion, entry_point)
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        solution = f"{prompt}\n\n{textwrap.dedent(code)}"
    else:
        lines = [line for line in code.splitlines() if line.strip()]
        if lines and not lines[0][0].isspace():
            code = textwrap.indent(code, "    ")
        solution = prompt + code
    return f"{solution}\n\n{test}\n\ncheck({entry_point})\n"


def grade_humaneval(problem: Problem, completion: str, *, timeout: float = 10.0) -> GradeResult:
    """pass@1 of one completion: its program passes ``check`` within ``timeout`` seconds."""
    meta = problem.meta
    if not all(isinstance(meta.get(key), str) for key in ("prompt", "test", "entry_point")):
        return _result(False, None, "problem lacks prompt/test/entry_point")
    program = humaneval_program(meta["prompt"], completion, meta["test"], meta["entry_point"])
    result = run_python(program, timeout=timeout)
    reason = f"timed out after {timeout:g} s" if result.timed_out else result.reason
    return _result(result.ok, extract_code(completion, meta["entry_point"]), reason)
