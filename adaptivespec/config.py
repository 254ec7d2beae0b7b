"""Configuration: attrs classes loaded from YAML with strict validation.

The top-level keys are a contract: ``model``, ``runtime``, ``policy``, ``verifier``,
``generation``, and the optional ``batch`` (how concurrent requests share a step). ``policy`` and ``verifier`` hold ``name`` plus that strategy's own parameters,
validated against the strategy's ``Params`` attrs class. The optional top-level ``sources`` is a
list of candidate sources (each ``name`` plus that source's parameters, validated the same way;
default: none), whose proposals are verified beside the drafter's tree, or alone when
``model.drafter`` is null. Every error names the file, the key path, the value and what was expected::

    configs/x.yaml: verifier.kappa: expected a number in (0, 1], got 1.5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import yaml

from adaptivespec import hardware
from adaptivespec.errors import ConfigError, UnknownStrategyError
from adaptivespec.params import as_tuple, int_at_least, number_in, one_of, positive_int, structure
from adaptivespec.plugins import get_plugin_host
from adaptivespec.response_format import ResponseFormat


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


def _groups(entries) -> dict[str, int]:
    """``quantization_groups`` as {layer name: slices}; a malformed entry raises ValueError naming it."""
    out = {}
    for e in entries:
        name, _, n = str(e).partition("=")
        if not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"expected entries NAME=G with G a positive integer (e.g. down_proj=4), got {e!r}")
        out[name] = int(n)
    return out


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    name: str = "torch"
    """Registered runtime, or ``auto``: ``llamacpp`` where it is installed and measured faster on this
    kind of CPU (:func:`resolve_runtime`: no fast bf16), else ``torch``; resolved when the config loads."""
    device: str = "cpu"
    """Torch device: ``cpu``, ``cuda``, ``cuda:1`` ..."""
    dtype: str = attrs.field(default="auto", validator=one_of("auto", "float32", "bfloat16"))
    """Weights and activations dtype. ``auto`` (the default): ``bfloat16`` where the device has fast
    bf16 (a GPU; a CPU with AMX or AVX512-BF16; Arm with bf16), else ``float32`` (an AVX2-only CPU, where
    torch's bf16 is 40-500x slower): :func:`adaptivespec.hardware.auto_dtype`. Resolved when the config
    loads, so ``runtime.dtype`` (and ``precision``, the key of cost tables) always names what runs."""
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    """torch intra-op threads (null: torch's default)."""
    quantization: str = attrs.field(default="none", validator=one_of("none", "int8"))
    """``none``: the target runs in ``dtype``; ``int8``: W8A8 (int8 weights per output channel, int8
    activations per row, int32 sums: :mod:`adaptivespec.fastpath.int8`), the rest of the forward in
    ``dtype``. Lossless configs then reproduce the int8 target's own greedy decoding, in any batch."""
    quantization_groups: tuple[str, ...] = attrs.field(default=(), converter=as_tuple, validator=lambda i, a, v: _groups(v))
    """With ``quantization: int8``: ``name=G`` entries (``down_proj=4``): that layer's activations get a
    scale per row and per each of G equal slices of its inputs (G int8 matmuls, added in order) instead
    of one per row: finer scales where one per row costs quality (docs/int8.md)."""
    quantization_keep: tuple[str, ...] = attrs.field(default=(), converter=as_tuple)
    """With ``quantization: int8``: linear layers left in ``dtype``, by the end of their name
    (``lm_head``, ``down_proj``, ``layers.0.mlp.down_proj``); [] quantizes every one."""
    prefill_chunk: int = attrs.field(default=1024, validator=int_at_least(0))
    """Prompt tokens per prefill forward (0: the whole prompt in one): a long prompt runs in chunks
    of this many tokens, so a prefill's activations stay bounded whatever the prompt's length."""

    @property
    def precision(self) -> str:
        """What the target computes in: ``dtype``, or ``int8-<dtype>`` (``...-keep-<layers>`` where some
        stay in ``dtype``): the key of measured cost tables (a table of one is never used for another)."""
        if self.quantization == "none":
            return self.dtype
        return "-".join([self.quantization, self.dtype] + (["keep", *self.quantization_keep] if self.quantization_keep else [])
                        + (["groups", *self.quantization_groups] if self.quantization_groups else []))

    @property
    def groups(self) -> dict[str, int]:
        """``quantization_groups`` as {layer name: slices}."""
        return _groups(self.quantization_groups)


@attrs.frozen(kw_only=True)
class BatchConfig:
    """Continuous batching (``serve --runtime torch --parallel N``, :mod:`adaptivespec.batch`):
    how the requests that share a step share its rows."""

    row_budget: str = attrs.field(default="none", validator=one_of("none", "goodput"))
    """``none``: every request verifies its tree as its policy shaped it (static trees, batched);
    ``goodput``: one budget per step: every request's candidate nodes in one ranking by calibrated
    acceptance, the prefix that maximises expected tokens per millisecond of the step verified, with
    the costs measured on this machine (``adaptivespec calibrate --batch``, else at start-up, cached)."""
    max_rows: int = attrs.field(default=512, validator=positive_int)
    """Most rows one packed target forward runs (prompt chunks and verify trees together)."""
    prefill_rows: int = attrs.field(default=0, validator=int_at_least(0))
    """Prompt rows a step takes while other requests decode (a request alone prefills in
    ``runtime.prefill_chunk`` chunks): a long prompt is read over several steps, interleaved
    with the others' decoding, so their inter-token latency stays bounded. 0 (default): sized each
    step from the measured costs, the most rows (a multiple of 8, at least 8) that keep the step
    within ``prefill_stall`` times its cost without them, ``prefill_stall - 1`` more for every further
    request reading its prompt (128 where no costs were measured)."""
    prefill_stall: float = attrs.field(default=1.8, validator=number_in(1, None, lo_open=True))
    """With ``prefill_rows: 0``: how much slower than without it a step that also reads a prompt chunk may be."""
    prefix_cache_mb: int = attrs.field(default=512, validator=int_at_least(0))
    """Memory (MiB, taken when the engine starts) for the prompts read and the sequences finished: a
    prompt that starts with one (a chat's next turn, a shared system prompt, the same prompt again)
    reads only the rest; least recently used out (:mod:`adaptivespec.batch.prefix`). 0: none kept."""


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
    (see :class:`adaptivespec.response_format.ResponseFormat`). Every path is constrained: the
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
    batch: BatchConfig = attrs.Factory(BatchConfig)
    """How concurrent requests share a step (used when serving several at once)."""
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
            **({"batch": attrs.asdict(self.batch)} if self.batch != BatchConfig() else {}),
        }


TOP_LEVEL = ("model", "runtime", "policy", "verifier", "generation", "sources", "batch")
SECTIONS = {"model": ModelConfig, "runtime": RuntimeConfig, "generation": GenerationConfig, "batch": BatchConfig}
DEFAULT_STRATEGY = {"policy": "static", "verifier": "strict"}


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
    sections["runtime"] = resolve_runtime(sections["runtime"], sections["model"])
    for kind, registry in (("runtime", host.runtimes), ("drafter", host.drafters)):
        name = sections["runtime"].name if kind == "runtime" else sections["model"].drafter_kind
        if name not in registry:
            key = "runtime.name" if kind == "runtime" else "model.drafter_kind"
            raise ConfigError(where, key, str(UnknownStrategyError(kind, name, registry.names(), getattr(registry, "failed", []))))
    sections["runtime"] = resolve_dtype(sections["runtime"], where)
    config = Config(**sections, **strategies, source=where, sources=build_sources(data.get("sources"), where, host))
    check_sampling(config, host)  # temperature > 0 needs a verifier with a sampling form
    return config


def resolve_runtime(runtime: RuntimeConfig, model: Any) -> RuntimeConfig:
    """``runtime`` with ``name: auto`` replaced by this machine's choice: ``llamacpp`` where
    llama-cpp-python is installed, the device is the CPU, the target is a GGUF file or the embedded
    one (its shipped file), torch does not quantize it, and the CPU has no fast bf16 (AVX2: torch's
    float32 ran at ~0.2-0.3x llama.cpp's plain decoding there, docs/cpus.md); else ``torch``. With
    AVX512-BF16 torch was measured faster over whole requests (docs/llamacpp.md, 2026-12-07:
    torch's bf16 ``cost-aware-hybrid`` 62 tok/s against 48 for llama.cpp's best on the shipped Q4_1
    file, whose prompt processing is slow); AMX: not measured on llama.cpp, torch."""
    if runtime.name != "auto":
        return runtime
    import importlib.util

    from adaptivespec.models import EMBEDDED

    target = str(getattr(model, "target", ""))
    gguf = target == EMBEDDED or target.endswith(".gguf")
    usable = (runtime.device == "cpu" and runtime.quantization == "none" and gguf
              and importlib.util.find_spec("llama_cpp") is not None)
    return attrs.evolve(runtime, name="llamacpp" if usable and not hardware.fast_bf16(runtime.device) else "torch")


def resolve_dtype(runtime: RuntimeConfig, where: str = "<config>") -> RuntimeConfig:
    """``runtime`` with ``dtype: auto`` replaced by this machine's choice (:func:`adaptivespec.hardware.auto_dtype`);
    a malformed ``$ADAPTIVESPEC_CPU_ISA`` is named as a config error."""
    if runtime.dtype != "auto":
        return runtime
    try:
        return attrs.evolve(runtime, dtype=hardware.auto_dtype(runtime.device))
    except ValueError as exc:
        raise ConfigError(where, "runtime.dtype", f"auto: {exc}") from None


def check_sampling(config: Config, host=None) -> None:
    """Refuse temperature > 0 with a speculative verifier that has no sampling form (exit 2): a
    verifier class declares one with ``supports_sampling = True``."""
    if config.generation.temperature == 0 or config.autoregressive:
        return
    if host is None:
        host = get_plugin_host()
    cls = host.verifiers.get(config.verifier.name).cls
    if not getattr(cls, "supports_sampling", False):
        raise ConfigError(
            config.source, "generation.temperature",
            f"verifier {config.verifier.name!r} has no sampling form, got temperature {config.generation.temperature!r}; "
            "expected temperature 0 with it, or a verifier that samples (strict, margin)",
        )


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
