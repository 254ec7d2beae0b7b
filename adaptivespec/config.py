"""Configuration: attrs classes loaded from YAML with strict validation.

The top-level keys are a contract: ``model``, ``runtime``, ``policy``, ``verifier``,
``generation``. ``policy`` and ``verifier`` hold ``name`` plus that strategy's own parameters,
validated against the strategy's ``Params`` attrs class. The optional top-level ``sources`` is a
list of candidate sources (each ``name`` plus that source's parameters, validated the same way;
default: none), whose proposals are verified beside the drafter's tree, or alone when
``model.drafter`` is null. Every error names the file, the key path, the value and what was expected::

    configs/x.yaml: verifier.kappa: expected a number in (0, 1], got 1.5
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import yaml

from adaptivespec.errors import ConfigError, UnknownStrategyError


# -- validators whose messages say what was expected ----------------------------------------
def positive_int(inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")


def optional_positive_int(inst: Any, attribute: attrs.Attribute, value: int | None) -> None:
    """Validator: a positive integer, or None (YAML null)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected a positive integer or null, got {value!r}")
    positive_int(inst, attribute, value)


def int_at_least(lo: int):
    """Validator: an integer (not a bool) ``>= lo``."""

    def check(inst: Any, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ValueError(f"expected an integer >= {lo}, got {value!r}")

    return check


def as_tuple(value: Any) -> Any:
    """Converter: a YAML list becomes a tuple (frozen params stay hashable)."""
    return tuple(value) if isinstance(value, list) else value


def number_in(lo: float | None, hi: float | None, *, lo_open: bool = False, hi_open: bool = False):
    """Validator: ``lo <(=) value <(=) hi``; its message writes the interval."""
    text = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{')' if hi_open else ']'}"

    def check(inst: Any, attribute: attrs.Attribute, value: float | None) -> None:
        if value is None:
            return
        bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
            hi is not None and (value > hi or (hi_open and value == hi))
        )
        if bad:
            raise ValueError(f"expected a number in {text}, got {value!r}")

    return check


def one_of(*choices: str):
    def check(inst: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")

    return check


# -- structured output ---------------------------------------------------------------------------
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
        from adaptivespec.constraints import check_compiles  # the grammar engine, only when a format is set

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


# -- the schema ------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class ModelConfig:
    target: str = "smollm2-135m-instruct"
    """Target model: ``smollm2-135m-instruct`` (embedded), a local folder or a Hugging Face id."""
    drafter: str | None = "embedded"
    """Drafter checkpoint folder (EAGLE-3 layout), ``embedded`` for the shipped head, or null for
    plain autoregressive decoding."""
    drafter_kind: str = "eagle3"
    """Registered drafter kind that loads ``drafter``."""


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    name: str = "torch"
    """Registered runtime."""
    device: str = "cpu"
    """Torch device: ``cpu``, ``cuda``, ``cuda:1`` ..."""
    dtype: str = attrs.field(default="bfloat16", validator=one_of("float32", "bfloat16"))
    """Weights and activations dtype."""
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    """torch intra-op threads (null: torch's default)."""


@attrs.frozen(kw_only=True)
class StrategyConfig:
    name: str
    """Registered strategy name."""
    params: Any = None
    """The strategy's validated ``Params`` instance."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **(attrs.asdict(self.params) if self.params is not None else {})}


@attrs.frozen(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = attrs.field(default=256, validator=positive_int)
    """Generated tokens at most per prompt (the EOS token included)."""
    stop_at_eos: bool = True
    """Stop at the tokenizer's end-of-sequence token."""
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template as one user message (``--raw`` disables)."""
    temperature: float = attrs.field(default=0.0, validator=number_in(0, None))
    """Sampling temperature; 0 (the default) is greedy decoding. With temperature > 0 the target's
    distribution is transformed as transformers' ``generate(do_sample=True)`` does, in its order:
    temperature, then ``top_k``, then ``top_p``, then ``min_p`` (see ``adaptivespec.sampling``)."""
    top_k: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    """Keep only the k most likely tokens (ties with the k-th kept); null: no top-k truncation.
    Unlike transformers' ``generate``, no implicit default of 50."""
    top_p: float = attrs.field(default=1.0, validator=number_in(0, 1, lo_open=True))
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p; 1: off."""
    min_p: float | None = attrs.field(default=None, validator=number_in(0, 1))
    """Drop tokens whose probability is below min_p times the largest one; null: off."""
    seed: int = attrs.field(default=0, validator=number_in(0, None))
    """Seed of the sampling generator: record i of a run uses seed + i unless it carries its own
    ``"seed"``. Same seed, config and machine: same output. Ignored at temperature 0."""
    response_format: ResponseFormat | None = None
    """Structured output (null: free text): ``{type: json_schema, schema: {...} | FILE}``,
    ``{type: json_object}``, ``{type: regex, pattern: ...}`` or ``{type: ebnf, grammar: ...}``
    (see :class:`adaptivespec.config.ResponseFormat`). Every path is constrained: the
    target's logits are masked by the grammar before the verifier's rule or the AR pick."""
    grammar_draft: bool = True
    """With a response format, a speculative config (a drafter or a source) that lists no
    ``grammar`` source drafts with one (default parameters) too: the grammar's forced
    continuation, fused into the tree. false: only the listed sources (for comparison)."""


@attrs.frozen(kw_only=True)
class Config:
    model: ModelConfig = attrs.Factory(ModelConfig)
    runtime: RuntimeConfig = attrs.Factory(RuntimeConfig)
    policy: StrategyConfig
    verifier: StrategyConfig
    generation: GenerationConfig = attrs.Factory(GenerationConfig)
    source: str = "<defaults>"
    """File the config came from (for messages)."""
    sources: tuple[StrategyConfig, ...] = ()
    """Candidate sources (``sources:`` in YAML), in order; empty: the drafter alone."""

    @property
    def autoregressive(self) -> bool:
        return self.model.drafter is None and not self.sources

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": attrs.asdict(self.model),
            "runtime": attrs.asdict(self.runtime),
            "policy": self.policy.to_dict(),
            "verifier": self.verifier.to_dict(),
            "generation": {**attrs.asdict(self.generation, recurse=False), "response_format": (
                self.generation.response_format.to_dict() if self.generation.response_format is not None else None)},
            **({"sources": [s.to_dict() for s in self.sources]} if self.sources else {}),
        }


TOP_LEVEL = ("model", "runtime", "policy", "verifier", "generation", "sources")
SECTIONS = {"model": ModelConfig, "runtime": RuntimeConfig, "generation": GenerationConfig}
DEFAULT_STRATEGY = {"policy": "static", "verifier": "strict"}


# -- strict structuring ------------------------------------------------------------------------
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if typing.get_origin(tp) in (tuple, list):
        return f"a list of {_describe(args[0])}s" if args else "a list"
    if attrs.has(tp):
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, where: str, key: str) -> Any:
    """``value`` as type ``tp`` (no lenient coercion: "3" is not an int, true is not 1)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner_error = None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, where, key)
            except ConfigError as exc:
                if attrs.has(a) and isinstance(value, dict):  # the mapping's own error says more
                    inner_error = exc
        if inner_error is not None:
            raise inner_error
    elif origin in (tuple, list) and isinstance(value, (list, tuple)):
        inner = args[0] if args else Any
        items = [_convert(inner, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value  # ints stay as written so messages echo the user's value
    elif tp is str and isinstance(value, str):
        return value
    elif attrs.has(tp) and isinstance(value, dict):
        return structure(tp, value, where, key)
    raise ConfigError(where, key, f"expected {_describe(tp)}, got {value!r}")


def structure(cls: type, data: Any, where: str, path: str) -> Any:
    """Build attrs class ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in attrs.fields(attrs.resolve_types(cls))}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, path, f"expected a mapping, got {data!r}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(where, key, f"unknown key; expected one of: {', '.join(fields) or '(no keys)'}")
    kwargs = {name: _convert(fields[name].type, value, where, f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        # attrs validators name the attribute in their own message; find which key it was
        bad = next((n for n in kwargs if f"'{n}'" in str(exc) or str(exc).startswith(n)), None)
        failing = _failing_key(cls, kwargs) or bad
        key = f"{path}.{failing}" if failing and path else (failing or path)
        message = str(exc)
        if failing and message.startswith(f"{failing}: "):  # the key is already in front
            message = message[len(failing) + 2:]
        raise ConfigError(where, key, message) from None


def _failing_key(cls: type, kwargs: dict[str, Any]) -> str | None:
    """Re-run field validators one by one to find which key a failure belongs to."""
    for f in attrs.fields(cls):
        if f.name in kwargs and f.validator is not None:
            try:
                f.validator(None, f, kwargs[f.name])
            except (ValueError, TypeError):
                return f.name
    return None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError("--set", "", f"expected KEY=VALUE with a dotted key such as verifier.kappa=0.5, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_override(data: dict[str, Any], text: str) -> None:
    keys, value = parse_override(text)
    if keys[0] not in TOP_LEVEL:
        raise ConfigError("--set", text.partition("=")[0], f"unknown key; expected one of: {', '.join(TOP_LEVEL)}")
    node = data
    for i, k in enumerate(keys[:-1]):
        if isinstance(node.get(k), list) and keys[i + 1].isdigit():  # a list item: sources.0.max_depth=4
            items, at = node[k], int(keys[i + 1])
            if at >= len(items) or not isinstance(items[at], dict):
                raise ConfigError("--set", ".".join(keys), f"{k} has no mapping at index {at} ({len(items)} items)")
            node = {keys[i + 1]: items[at]}  # the next key (the index) finds the item
            continue
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError("--set", ".".join(keys), f"{k} is not a mapping")
        node = child
    node[keys[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(path), "", "config file not found" if not p.exists() else "not a file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(str(path), "", f"invalid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", f"expected a mapping with keys {', '.join(TOP_LEVEL)}, got {type(data).__name__}")
    return data


def build_config(data: dict[str, Any], where: str = "<config>", host=None) -> Config:
    """Validate a raw mapping (already merged with overrides) into a :class:`Config`."""
    if host is None:
        from adaptivespec.plugins import get_plugin_host

        host = get_plugin_host()
    unknown = sorted(set(data) - set(TOP_LEVEL))
    if unknown:
        raise ConfigError(where, str(unknown[0]), f"unknown top-level key; expected one of: {', '.join(TOP_LEVEL)}")
    sections = {name: structure(cls, data.get(name), where, name) for name, cls in SECTIONS.items()}
    if not sections["model"].drafter and sections["model"].drafter is not None:
        raise ConfigError(where, "model.drafter", "expected a checkpoint folder, 'embedded' or null, got ''")
    strategies = {}
    for kind in ("policy", "verifier"):
        raw = data.get(kind)
        raw = {"name": DEFAULT_STRATEGY[kind]} if raw is None else raw
        if isinstance(raw, str):
            raw = {"name": raw}
        if not isinstance(raw, dict):
            raise ConfigError(where, kind, f"expected a mapping with a name, got {raw!r}")
        raw = dict(raw)
        name = raw.pop("name", DEFAULT_STRATEGY[kind])
        try:
            entry = host.registry(kind).get(name)
        except UnknownStrategyError as exc:
            raise ConfigError(where, f"{kind}.name", str(exc)) from None
        params = structure(entry.cls.Params, raw, where, kind)
        strategies[kind] = StrategyConfig(name=name, params=params)
    for kind, registry in (("runtime", host.runtimes), ("drafter", host.drafters)):
        name = sections["runtime"].name if kind == "runtime" else sections["model"].drafter_kind
        if name not in registry:
            key = "runtime.name" if kind == "runtime" else "model.drafter_kind"
            raise ConfigError(where, key, str(UnknownStrategyError(kind, name, registry.names(), getattr(registry, "failed", []))))
    config = Config(**sections, **strategies, source=where, sources=build_sources(data.get("sources"), where, host))
    from adaptivespec.sampling import check_sampling

    check_sampling(config, host)  # temperature > 0 needs a verifier with a sampling form
    return config


def build_sources(raw: Any, where: str, host) -> tuple[StrategyConfig, ...]:
    """The ``sources`` list: each item a source name or a mapping with ``name`` and its parameters."""
    if raw is None:
        return ()
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        raise ConfigError(where, "sources", f"expected a list of candidate sources, got {raw!r}")
    out: list[StrategyConfig] = []
    for i, item in enumerate(raw):
        key = f"sources[{i}]"
        item = {"name": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(where, key, f"expected a mapping with a source name, got {item!r}")
        item = dict(item)
        name = item.pop("name")
        try:
            entry = host.sources.get(name)
        except UnknownStrategyError as exc:
            raise ConfigError(where, f"{key}.name", str(exc)) from None
        if any(s.name == name for s in out):
            raise ConfigError(where, f"{key}.name", f"source {name!r} is listed twice")
        out.append(StrategyConfig(name=name, params=structure(entry.cls.Params, item, where, key)))
    return tuple(out)


def load_config(path: str | Path | None, overrides: list[str] = (), host=None) -> Config:
    """Read ``path`` (None: defaults only), apply ``--set`` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    where = str(path) if path is not None else "<defaults>"
    for index in _shadowed(overrides):  # a value a later override replaces is still checked
        shadow = read_yaml(path) if path is not None else {}
        for n, text in enumerate(overrides):
            if n <= index or not _replaces(overrides[index], text):
                apply_override(shadow, text)
        build_config(shadow, f"{where} (--set {overrides[index].strip()}, overridden later)", host)
    for text in overrides:
        apply_override(data, text)
    return build_config(data, where, host)


def _key(text: str) -> list[str]:
    return [k.strip() for k in text.partition("=")[0].strip().split(".")]


def _replaces(earlier: str, later: str) -> bool:
    """Whether override ``later`` replaces the whole value ``earlier`` set (same key or a parent)."""
    a, b = _key(earlier), _key(later)
    return a[: len(b)] == b


def _shadowed(overrides: list[str]) -> list[int]:
    """Indices of the overrides whose value a later override replaces."""
    for text in overrides:
        parse_override(text)  # malformed KEY=VALUE fails first, whatever comes later
    return [i for i, text in enumerate(overrides) if any(_replaces(text, later) for later in overrides[i + 1:])]
