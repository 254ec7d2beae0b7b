"""MATH answers: the last ``\\boxed{}`` of a completion, and equivalence through Hugging Face's
`math-verify <https://github.com/huggingface/Math-Verify>`_ (the verifier of lighteval and open-r1).

* :func:`last_boxed` finds the last ``\\boxed{...}`` / ``\\fbox{...}`` with correct brace nesting
  (``\\boxed 5`` too) -- the answer users expect to be graded, whatever came before it.
* :func:`equivalent` hands both answers, each wrapped in ``\\boxed{}``, to math-verify's
  ``parse`` and ``verify`` (LaTeX and plain expressions; numbers to 6 decimals; sets, intervals,
  tuples, matrices, equations, units and ``\\text{}`` as math-verify handles them).

Grading must never crash or hang. math-verify's own timeouts use ``signal.alarm`` in whole
seconds and refuse to run off the main thread, so they are off here; instead, in the main thread
the whole comparison runs under a ``SIGALRM`` timer (:func:`time_limit`, fractions of a second
allowed), and in every thread answers whose evaluation could not be interrupted (integer powers
with towering or huge exponents, factorials of huge numbers: CPython computes those in C, where
no signal lands) are refused before parsing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from collections.abc import Iterator

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_EXPONENT = 100_000
_MAX_FACTORIAL = 10_000
_FACTORIAL = re.compile(r"(\d+)\s*!")


class TimeLimitExceeded(Exception):
    """Raised inside :func:`time_limit` when its time is up."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` after ``seconds`` (main thread with SIGALRM only)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeLimitExceeded()

    previous_handler = signal.signal(signal.SIGALRM, expire)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - seconds, 1e-3))


def matching_brace(text: str, start: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``text[start]``, or -1 when unbalanced."""
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == "\\":
            continue
        if char == "{" and (index == 0 or text[index - 1] != "\\"):
            depth += 1
        elif char == "}" and (index == 0 or text[index - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return index
    return -1


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (``\\boxed 5`` too), else ``None``."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    while start >= 0:
        command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        rest = start + len(command)
        stripped = text[rest:].lstrip()
        if stripped.startswith("{"):
            open_at = len(text) - len(stripped)
            close_at = matching_brace(text, open_at)
            if close_at > 0:
                return text[open_at + 1 : close_at].strip()
        elif text[rest:rest + 1] == " ":
            match = re.match(r"\s*([^\s$]+)", text[rest:])
            if match:
                return match.group(1).rstrip(".")
        start = max(text.rfind(c, 0, start) for c in _BOX_COMMANDS)
    return None


def _exponents(text: str) -> Iterator[str]:
    """The text of every exponent: a braced group after ``^``, else the token after it."""
    for match in re.finditer(r"\^\s*", text):
        at = match.end()
        if text[at:at + 1] == "{":
            close = matching_brace(text, at)
            yield text[at + 1 : close] if close > 0 else text[at + 1 :]
        else:
            token = re.match(r"\d+|\\?[A-Za-z]+|.", text[at:])
            yield token.group(0) if token else ""


def too_big(latex: str) -> bool:
    """Whether evaluating ``latex`` could build an integer too large to compute: a numeric power
    tower in an exponent (``2^{10^{10}}``), an exponent above 100000, or ``n!`` above 10000."""
    for exponent in _exponents(latex):
        plain = exponent.replace(" ", "")
        if "^" in plain and re.fullmatch(r"[\d{}^()+*.-]+", plain):
            return True
        number = re.fullmatch(r"\(?(\d+)\)?", plain)
        if number and int(number.group(1)) > _MAX_EXPONENT:
            return True
    return any(int(n) > _MAX_FACTORIAL for n in _FACTORIAL.findall(latex))


def _math_verify():
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: ours is on
    return math_verify


def equivalent(prediction: str, gold: str, *, timeout: float = 2.0) -> bool:
    """Whether answer ``prediction`` is mathematically the same as ``gold`` (both LaTeX, without
    ``\\boxed``), by math-verify; undecided within ``timeout`` seconds means "different"."""
    prediction, gold = prediction.strip(), gold.strip()
    if not prediction or not gold:
        return False
    if prediction == gold:
        return True
    if too_big(prediction) or too_big(gold):
        return False
    mv = _math_verify()  # imported before the alarm: an interrupted import would leave it half-loaded
    config = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    try:
        with time_limit(timeout):
            want = mv.parse(f"\\boxed{{{gold}}}", extraction_config=config, parsing_timeout=None)
            got = mv.parse(f"\\boxed{{{prediction}}}", extraction_config=config, parsing_timeout=None)
            return bool(want) and bool(got) and bool(mv.verify(want, got, timeout_seconds=None))
    except Exception:  # TimeLimitExceeded included
        return False
