"""Small LaTeX helpers for grading math answers, without sympy's antlr-based LaTeX parser.

* :func:`last_boxed` finds the last ``\\boxed{...}`` / ``\\fbox{...}`` with correct brace nesting.
* :func:`normalize` rewrites an answer to a canonical string (drops ``\\left``/``\\right``,
  spacing commands, ``$``, degrees, ``\\%``, unit words in ``\\text{}``, thousands separators,
  ``dfrac``/``tfrac``; braces the arguments of ``\\frac 12`` and ``\\sqrt2``).
* :func:`to_sympy_source` converts the common LaTeX forms of a *normalized* answer (``\\frac``,
  ``\\sqrt``, ``^``, ``\\cdot``, ``\\pi``, ``\\infty``, trig and log functions, ``\\binom``, mixed
  numbers) into a string for :func:`sympy.parsing.sympy_parser.parse_expr`, or ``None`` when it
  meets anything else. Its output only contains digits, operators, parentheses and whitelisted
  names, so parsing it cannot run arbitrary code.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")

_UNIT_WORDS = (
    "degrees?|cm|km|mm|inches|inch|feet|foot|ft|units?|square units|cents?|dollars?|hours?|"
    "minutes?|seconds?|days?|weeks?|years?|mph|miles?|meters?|pounds?|ounces?|grams?|kg|ways|"
    "points?|students|people|marbles|coins"
)
_TRAILING_UNIT = re.compile(rf"(?<=[0-9}}])\s*(?:{_UNIT_WORDS})(?:\^[23]|\^\{{[23]\}})?$")
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{\s*[A-Za-z ]*\}(?:\^[23]|\^\{[23]\})?$")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")

FUNCTIONS = {
    "sin": "sin", "cos": "cos", "tan": "tan", "sec": "sec", "csc": "csc", "cot": "cot",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "ln": "log", "log": "log", "exp": "exp",
}
"""LaTeX function commands and their sympy names."""

_CONSTANTS = {"pi": "pi", "infty": "oo", "infinity": "oo", "cdot": "*", "times": "*", "div": "/"}
_KNOWN_NAMES = set(FUNCTIONS.values()) | {"sqrt", "root", "pi", "oo", "binomial", "E", "I"}
_ALLOWED = re.compile(r"[0-9A-Za-z+\-*/().! ]")


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


def _group_or_char(text: str, index: int) -> tuple[str, int] | None:
    """The argument at ``text[index]``: a braced group or one character (spaces skipped)."""
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        return None
    if text[index] == "{":
        close = matching_brace(text, index)
        return (text[index + 1 : close], close + 1) if close > 0 else None
    if text[index] == "\\":
        match = re.match(r"\\[A-Za-z]+", text[index:])
        if match:
            return match.group(0), index + len(match.group(0))
    return text[index], index + 1


def brace_arguments(text: str) -> str:
    """Brace the arguments of ``\\frac12``, ``\\frac 59``, ``\\frac{270}7`` and ``\\sqrt2``."""
    pattern = re.compile(r"\\(frac|sqrt)(?![A-Za-z])")
    out, position = [], 0
    for match in pattern.finditer(text):
        if match.start() < position:
            continue
        out.append(text[position : match.end()])
        position = match.end()
        if match.group(1) == "sqrt" and text[position:position + 1] == "[":
            continue
        for _ in range(2 if match.group(1) == "frac" else 1):
            argument = _group_or_char(text, position)
            if argument is None:
                break
            out.append("{" + brace_arguments(argument[0]) + "}")
            position = argument[1]
    out.append(text[position:])
    return "".join(out)


def _strip_text(answer: str) -> str:
    whole = re.fullmatch(r"\\(?:text|textbf|mbox|mathrm)\{(.*)\}", answer)
    if whole:
        return whole.group(1).strip()
    if re.search(r"[0-9}]", answer):
        answer = _TEXT_UNIT.sub("", answer).strip()
    previous = None
    while previous != answer:
        previous, answer = answer, _TEXT_COMMAND.sub(r"\1", answer)
    return answer


def _strip_variable(answer: str) -> str:
    """``x = 5`` -> ``5``; ``x \\in [1, 2]`` -> ``[1, 2]`` (a short left side only)."""
    match = re.fullmatch(r"\s*[A-Za-z](?:_\{?\w\}?)?\s*(?:=|\\in)\s*(.+)", answer)
    return match.group(1) if match and "=" not in match.group(1) else answer


_REMOVE = (
    "\\left", "\\right", "\\bigl", "\\bigr", "\\Bigl", "\\Bigr", "\\big", "\\Big", "\\displaystyle",
    "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$", "\\%", "%", "{,}", "°",
    "^{\\circ}", "^\\circ", "^\\degree", "\\degree", "\\circ", "\\mathrm{th}",
)


def normalize(answer: str) -> str:
    """Canonical string of a math answer (see the module docstring); ``""`` for an empty one."""
    text = answer.strip().replace("\n", " ")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\(?:left|right)\.", "", text).replace("\\\\", "\0")  # protect row breaks
    for token in _REMOVE:
        text = text.replace(token, "")
    text = text.replace("\0", "\\\\")
    text = _strip_text(text.strip())
    text = _TRAILING_UNIT.sub("", text.strip()) if re.search(r"\d", text) else text
    text = _strip_variable(text)
    text = brace_arguments(text.strip().rstrip(".").strip())
    text = text.replace("\\{", "{").replace("\\}", "}") if text.startswith("\\{") else text
    text = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z0-9])", "\\1\1", text)  # keep "\cot x" apart
    text = re.sub(r"\s+", "", text).replace("\1", " ")
    text = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", text)
    text = re.sub(r"([_^])\{(\w)\}", r"\1\2", text)  # 52_{8} -> 52_8, x^{2} -> x^2
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d*?0+", text):
        text = text.rstrip("0").rstrip(".")
    choice = re.fullmatch(r"\(([A-Ea-e])\)", text)
    if choice:
        return choice.group(1).upper()
    return text.lower() if re.fullmatch(r"[A-Za-z]{2,}", text) else text


def _command(text: str, index: int, out: list[str]) -> int | None:
    """Convert the command at ``text[index]`` (a backslash); return the next index or ``None``."""
    match = re.match(r"\\([A-Za-z]+)", text[index:])
    if not match:
        return None
    name, index = match.group(1), index + len(match.group(0))
    if name in _CONSTANTS:
        out.append(f" {_CONSTANTS[name]} ")
        return index
    if name in FUNCTIONS:
        if text[index:index + 1] == "^":
            return None  # \sin^2 x
        argument = _group_or_char(text, index)
        if argument is None or argument[0] == "(":
            out.append(FUNCTIONS[name])
            return index
        converted = to_sympy_source(argument[0])
        if converted is None:
            return None
        out.append(f"{FUNCTIONS[name]}({converted})")
        return argument[1]
    return _command_with_arguments(name, text, index, out)


def _command_with_arguments(name: str, text: str, index: int, out: list[str]) -> int | None:
    count = {"frac": 2, "binom": 2, "sqrt": 1}.get(name)
    if count is None:
        return None
    degree = None
    if name == "sqrt" and text[index:index + 1] == "[":
        close = text.find("]", index)
        degree = to_sympy_source(text[index + 1 : close]) if close > 0 else None
        if degree is None:
            return None
        index = close + 1
    parts = []
    for _ in range(count):
        argument = _group_or_char(text, index)
        converted = to_sympy_source(argument[0]) if argument else None
        if converted is None:
            return None
        parts.append(converted)
        index = argument[1]
    if name == "frac":
        out.append(f"(({parts[0]})/({parts[1]}))")
    elif name == "binom":
        out.append(f"binomial({parts[0]},{parts[1]})")
    else:
        out.append(f"(({parts[0]})**(1/({degree})))" if degree else f"sqrt({parts[0]})")
    return index


def _split_names(source: str) -> str:
    """Keep known names; split other letter runs into single symbols; ``i``/``e`` -> ``I``/``E``."""

    def split(match: re.Match) -> str:
        word = match.group(0)
        if word in _KNOWN_NAMES:
            return word
        letters = [{"i": "I", "e": "E"}.get(letter, letter) for letter in word]
        return "(" + "*".join(letters) + ")"

    return re.sub(r"[A-Za-z]+", split, source)


def to_sympy_source(latex: str) -> str | None:
    """Convert a normalized LaTeX answer into ``parse_expr`` input, or ``None`` if unsupported."""
    mixed = re.fullmatch(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}", latex)
    if mixed:
        sign, whole, num, den = mixed.groups()
        return f"{sign}({whole}+{num}/{den})"
    out: list[str] = []
    index = 0
    while index < len(latex):
        char = latex[index]
        if char == "\\":
            index = _command(latex, index, out)
            if index is None:
                return None
            continue
        if char == "{":
            close = matching_brace(latex, index)
            inner = to_sympy_source(latex[index + 1 : close]) if close > 0 else None
            if inner is None:
                return None
            out.append(f"({inner})")
            index = close + 1
            continue
        if char == "^":
            out.append("**")
        elif _ALLOWED.fullmatch(char):
            out.append(char)
        else:
            return None
        index += 1
    source = _split_names("".join(out))
    return source if source.strip() else None
