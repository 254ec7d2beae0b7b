"""``generation.response_format``: what structured output must match, how it is read from YAML
or a prompt record, and the grammar engine's check that it compiles.

A :class:`ResponseFormat` is checked when it is built: its keys by attrs, its grammar by
compiling it with xgrammar (SGLang's default grammar engine), so an uncompilable schema, pattern
or grammar is a one-line config error before any model loads. xgrammar (the ``structured`` extra)
is imported only when a format is built; free-text decoding never imports it. The grammar state
that masks the target's logits while decoding is :mod:`adaptivespec.constraints`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.params import one_of, structure


class ResponseFormatError(AdaptiveSpecError, ValueError):
    """A response format the grammar engine cannot compile (or xgrammar missing)."""


def import_xgrammar():
    """The ``xgrammar`` module, or a :class:`ResponseFormatError` saying how to install it."""
    try:
        import xgrammar  # optional heavy dependency: only for structured output
    except ImportError:  # pragma: no cover - depends on the environment
        raise ResponseFormatError(
            "generation.response_format: needs the grammar engine xgrammar; install it with "
            "`pip install -e .[structured]` (or `pip install xgrammar`)") from None
    return xgrammar


def grammar_of(fmt: ResponseFormat):
    """The tokenizer-independent ``xgrammar.Grammar`` of ``fmt`` (raises what xgrammar raises)."""
    xgr = import_xgrammar()
    json_kwargs = ({"any_whitespace": True} if fmt.whitespace == "any"
                   else {"any_whitespace": False, "separators": (", ", ": ")})
    if fmt.type == "json_schema":
        return xgr.Grammar.from_json_schema(json.dumps(fmt.schema), **json_kwargs)
    if fmt.type == "json_object":
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), strict_mode=False, **json_kwargs)
    if fmt.type == "regex":
        return xgr.Grammar.from_regex(fmt.pattern)
    return xgr.Grammar.from_ebnf(fmt.grammar)


def check_compiles(fmt: ResponseFormat) -> None:
    """Raise ``ValueError("<key>: the grammar engine cannot compile it: <first line>")`` when
    xgrammar refuses ``fmt`` (``<key>``: schema, pattern or grammar), ResponseFormatError when
    xgrammar is missing."""
    try:
        grammar_of(fmt)
    except ResponseFormatError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with a long message
        what = {"json_schema": "schema", "regex": "pattern", "ebnf": "grammar"}.get(fmt.type, "type")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", first)  # xgrammar's "[time] file.cc:line: "
        raise ValueError(f"{what}: the grammar engine cannot compile it: {first}") from None


RESPONSE_FORMAT_TYPES = ("json_schema", "json_object", "regex", "ebnf")


def _load_schema(value: Any) -> Any:
    """A schema given as a mapping stays one; a string is a JSON file path, else inline JSON."""
    if isinstance(value, dict) or isinstance(value, bool):
        return value
    if isinstance(value, str):
        p = Path(value).expanduser()
        text = value
        if not value.lstrip().startswith("{"):
            if not p.is_file():
                raise ValueError(f"schema: expected a JSON schema mapping or a .json file, got {value!r} (no such file)")
            text = p.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"schema: {value!r} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, (dict, bool)):
            raise ValueError(f"schema: expected a JSON object, got {type(data).__name__} from {value!r}")
        return data
    raise ValueError(f"schema: expected a JSON schema mapping or a .json file, got {value!r}")


@attrs.frozen(kw_only=True, eq=False)
class ResponseFormat:
    """``generation.response_format``: what the output must match.

    ``{type: json_schema, schema: {...} | FILE.json}``, ``{type: json_object}`` (any JSON
    object), ``{type: regex, pattern: ...}``, ``{type: ebnf, grammar: ...}`` (GBNF, root rule
    ``root``). JSON output is written compactly on one line (``", "`` and ``": "``
    separators, no other whitespace) unless ``whitespace: any``; compact JSON is what makes
    keys and punctuation forced (the ``grammar`` source drafts them for free).
    """

    type: str = attrs.field(validator=one_of(*RESPONSE_FORMAT_TYPES))
    """``json_schema``, ``json_object``, ``regex`` or ``ebnf``."""
    schema: Any = None
    """``json_schema``: the schema, as a mapping, a JSON string or the path of a JSON file."""
    pattern: str | None = None
    """``regex``: the regular expression the whole output matches."""
    grammar: str | None = None
    """``ebnf``: the grammar (xgrammar's GBNF; the start rule is ``root``)."""
    whitespace: str = attrs.field(default="compact", validator=one_of("compact", "any"))
    """JSON types: ``compact`` (one line, ``", "`` / ``": "``) or ``any`` (any whitespace
    between tokens, xgrammar's default)."""

    def __attrs_post_init__(self) -> None:
        need = {"json_schema": "schema", "regex": "pattern", "ebnf": "grammar"}.get(self.type)
        for key in ("schema", "pattern", "grammar"):
            value = getattr(self, key)
            if key == need and value is None:
                raise ValueError(f"{key}: expected a value for type {self.type}, got nothing")
            if key != need and value is not None:
                raise ValueError(f"{key}: not used by type {self.type} (it takes {need or 'no other key'})")
        if self.schema is not None:
            object.__setattr__(self, "schema", _load_schema(self.schema))
        for key in ("pattern", "grammar"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ValueError(f"{key}: expected a string, got {getattr(self, key)!r}")
        check_compiles(self)

    # -- identity ---------------------------------------------------------------------------
    def key(self) -> tuple:
        schema = json.dumps(self.schema, sort_keys=True) if self.schema is not None else None
        return (self.type, schema, self.pattern, self.grammar, self.whitespace)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResponseFormat) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for key in ("schema", "pattern", "grammar"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.whitespace != "compact":
            out["whitespace"] = self.whitespace
        return out


def parse_response_format(value: Any, where: str, key: str = "response_format") -> ResponseFormat | None:
    """A response format from a raw mapping (a ``--prompts`` record, a CLI flag); errors name ``key``."""
    if value is None:
        return None
    return structure(ResponseFormat, value, where, key)
