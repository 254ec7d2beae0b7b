"""Mathematical equivalence of two LaTeX answers (MATH-style), with sympy where it can.

:func:`equivalent` first compares :func:`~adaptivespec.evaluation.latex.normalize`-d strings, then
the structure (tuples and intervals element by element with the same brackets, ``\\cup`` unions,
matrices entry by entry, sets and bare comma lists in any order with ``\\pm`` expanded, equations
up to a constant factor) and finally scalars with sympy: exact comparison, numeric comparison for
closed forms (relative tolerance 1e-6), and random-point evaluation for expressions in variables.

Grading must never crash or hang: each sympy call is wrapped in exception handling, expressions
with huge powers or factorials are refused before evaluation, and in the main thread the whole
comparison runs under a ``SIGALRM`` time limit (other threads get the guards but no alarm).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from collections.abc import Iterator

from adaptivespec.evaluation.latex import matching_brace, normalize, to_sympy_source

_SAFE_SOURCE = re.compile(r"[0-9A-Za-z+\-*/().!, ]*")
_MATRIX = re.compile(r"\\begin\{[pbvB]?matrix\}(.*)\\end\{[pbvB]?matrix\}")
_SAMPLE_POINTS = (0.7312, 1.4142, -0.5437, 2.2361)
_TOLERANCE = 1e-6


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


def equivalent(prediction: str, gold: str, *, timeout: float = 2.0) -> bool:
    """Whether answer ``prediction`` is mathematically the same as ``gold`` (both LaTeX)."""
    left, right = normalize(prediction), normalize(gold)
    if not left or not right:
        return False
    if left == right:
        return True
    _import_sympy()  # before the alarm: an interrupted import would leave sympy half-loaded
    try:
        with time_limit(timeout):
            return _structured(left, right)
    except Exception:  # TimeLimitExceeded included: undecided within the time means "different"
        return False


def _import_sympy() -> None:
    import sympy  # noqa: F401
    import sympy.parsing.sympy_parser  # noqa: F401


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """Split at ``separator`` outside (), [], {}."""
    parts, depth, start = [], 0, 0
    index = 0
    while index < len(text):
        char = text[index]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, index):
            parts.append(text[start:index])
            start = index + len(separator)
            index = start
            continue
        index += 1
    parts.append(text[start:])
    return parts


def _structured(left: str, right: str) -> bool:
    for separator in ("\\cup", "\\cap"):
        if separator in right or separator in left:
            return _pairwise(split_top_level(left, separator), split_top_level(right, separator))
    matrices = _MATRIX.fullmatch(left), _MATRIX.fullmatch(right)
    if matrices[0] or matrices[1]:
        return bool(matrices[0] and matrices[1]) and _same_matrix(matrices[0][1], matrices[1][1])
    bracketed = _brackets(left), _brackets(right)
    if bracketed[0] or bracketed[1]:
        if bracketed[0] is None or bracketed[1] is None or bracketed[0][0] != bracketed[1][0]:
            return False
        return _pairwise(bracketed[0][1], bracketed[1][1])
    left_items, right_items = _items(left), _items(right)
    if len(left_items) > 1 or len(right_items) > 1:
        return _unordered(left_items, right_items)
    if left.count("=") == 1 and right.count("=") == 1:
        return _same_equation(left, right)
    return _same_scalar(left, right)


def _pairwise(left: list[str], right: list[str]) -> bool:
    return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right))


def _same(left: str, right: str) -> bool:
    return left == right or _structured(left, right)


def _brackets(text: str) -> tuple[str, list[str]] | None:
    """``(a,b]`` -> ``("(]", ["a", "b"])`` for a tuple or interval of two or more items."""
    if len(text) < 2 or text[0] not in "([" or text[-1] not in ")]":
        return None
    parts = split_top_level(text[1:-1])
    if len(parts) < 2 or split_top_level(text, ",") != [text]:
        return None
    return text[0] + text[-1], parts


def _items(text: str) -> list[str]:
    """Members of a set ``{a,b}`` or bare list ``a,b``; ``a\\pmb`` counts as ``a+b`` and ``a-b``."""
    if text.startswith("{") and matching_brace(text, 0) == len(text) - 1:
        text = text[1:-1]
    items = []
    for item in split_top_level(text):
        item = item.replace("\\mp", "\\pm")
        if item.count("\\pm") == 1:
            items += [item.replace("\\pm", "+"), item.replace("\\pm", "-")]
        else:
            items.append(item)
    return items


def _unordered(left: list[str], right: list[str]) -> bool:
    if len(left) != len(right):
        return False
    remaining = list(right)
    for item in left:
        match = next((other for other in remaining if _same(item, other)), None)
        if match is None:
            return False
        remaining.remove(match)
    return True


def _same_matrix(left: str, right: str) -> bool:
    rows = [split_top_level(row, "&") for row in left.split("\\\\") if row]
    other = [split_top_level(row, "&") for row in right.split("\\\\") if row]
    if [len(row) for row in rows] != [len(row) for row in other]:
        return False
    return all(_pairwise(a, b) for a, b in zip(rows, other))


def _same_equation(left: str, right: str) -> bool:
    first, second = (_to_sympy(side) for side in left.split("="))
    third, fourth = (_to_sympy(side) for side in right.split("="))
    if None in (first, second, third, fourth):
        return False
    import sympy

    ratio = sympy.simplify((first - second) / (third - fourth))
    return bool(ratio.is_number and ratio != 0 and ratio.is_finite)


def _same_scalar(left: str, right: str) -> bool:
    a, b = _to_sympy(left), _to_sympy(right)
    if a is None or b is None:
        return False
    if a == b:
        return True
    symbols = a.free_symbols | b.free_symbols
    if not symbols:
        return _close(a, b)
    return _same_function(a, b, sorted(symbols, key=str))


def _close(a: object, b: object) -> bool:
    import sympy

    try:
        x, y = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
    except (TypeError, ValueError):
        return False
    return abs(x - y) <= _TOLERANCE * max(1.0, abs(y))


def _same_function(a: object, b: object, symbols: list) -> bool:
    """Equal at several points (or expanding the difference gives zero)."""
    import sympy

    if sympy.expand(a - b) == 0:
        return True
    checked = 0
    for shift in range(len(_SAMPLE_POINTS)):
        point = {
            symbol: _SAMPLE_POINTS[(i + shift) % len(_SAMPLE_POINTS)] + i
            for i, symbol in enumerate(symbols)
        }
        x, y = a.subs(point), b.subs(point)
        if not (x.is_finite and y.is_finite):
            continue
        if not _close(x, y):
            return False
        checked += 1
    return checked >= 2


def _to_sympy(latex: str) -> object | None:
    """A sympy expression for a normalized LaTeX scalar, or ``None`` (never raises)."""
    source = to_sympy_source(latex)
    if source is None or len(source) > 400 or not _SAFE_SOURCE.fullmatch(source):
        return None
    if any(len(digits) > 40 for digits in re.findall(r"\d+", source)):
        return None
    if any(int(n) > 500 for n in re.findall(r"(\d+)\s*!", source)) or re.search(r"\)\s*!", source):
        return None
    try:
        if not _small_powers(_parse(source, evaluate=False)):
            return None
        return _parse(source, evaluate=True)
    except TimeLimitExceeded:
        raise
    except Exception:
        return None


def _parse(source: str, *, evaluate: bool) -> object:
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    names = ("Integer", "Float", "Rational", "Symbol", "Add", "Mul", "Pow", "sqrt", "root", "pi",
             "oo", "E", "I", "binomial", "factorial", "sin", "cos", "tan", "sec", "csc", "cot",
             "asin", "acos", "atan", "sinh", "cosh", "tanh", "log", "exp")
    namespace = {name: getattr(sympy, name) for name in names}
    namespace["__builtins__"] = {}
    transformations = standard_transformations + (implicit_multiplication,)
    return parse_expr(source, global_dict=namespace, local_dict={},
                      transformations=transformations, evaluate=evaluate)


def _small_powers(expression: object) -> bool:
    """Refuse constant exponents above 10^4 in absolute value (their evaluation could hang)."""
    import sympy

    for node in sympy.preorder_traversal(expression):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            value = complex(sympy.N(node.exp, 15))
            if abs(value) > 1e4:
                return False
    return True
