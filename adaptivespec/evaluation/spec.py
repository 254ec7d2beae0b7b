"""What defines a ``bench`` / ``sweep`` run: its configs (:class:`Entry`), the run (:class:`BenchSpec`),
and the facts about a config every contender and every table reads (lossless? which seed?).

The lowest module of the bench: it imports nothing else from :mod:`adaptivespec.evaluation`.
"""

from __future__ import annotations

from typing import Any

import attrs

from adaptivespec.config import Config, load_config
from adaptivespec.plugins import get_plugin_host

DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 2048, "math500": 4096, "humaneval": 4096, "specbench": 1024, "mtbench": 1024, "longctx": 1024,
                          "structured": 192}
"""Per-dataset generation limits: the paper's (2048 for GSM8K, 4096 for MATH-500 and HumanEval);
Spec-Bench's harness default (1024) for the two chat sets; 192 for the JSON records of ``structured``."""

WARMUP_TOKENS = 8
"""Untimed tokens each contender generates on its warm-up prompts before the measured run."""


@attrs.frozen(kw_only=True)
class Entry:
    """One config of a run."""

    name: str
    """Shown in tables and plots: the file stem (a sweep adds ``[key=value]``)."""
    config: Config
    """The config as loaded, the run's ``--set`` overrides applied."""
    sweep: dict[str, Any] | None = None
    """The swept parameter values of this point, for sweeps."""
    served: bool = False
    """Run over HTTP by ``adaptivespec serve --runtime torch`` (``bench --served-configs``), not in process."""


@attrs.frozen(kw_only=True)
class BenchSpec:
    """Everything that defines a run (and must match to resume it)."""

    entries: tuple[Entry, ...]
    """The configs, in table order."""
    peers: tuple[str, ...] = ()
    """Peer names (``--peers``), run after the configs in each rotation."""
    dataset: str
    """Dataset name (``--dataset``)."""
    data: str | None = None
    """``--data`` file the dataset was read from; None: the packaged file."""
    limit: int | None = None
    """``--limit``: the first N problems."""
    max_new_tokens: int
    """Generation limit per prompt."""
    reference: str | None = None
    """Name of the lossless reference; None: :func:`adaptivespec.evaluation.summary.pick_reference` decides."""
    command: str = "bench"
    """``bench`` or ``sweep``: shown in the outputs, and a sweep's table adds ``speedup vs <reference>``."""
    columns: tuple[str, ...] = ()
    """Extra table columns, read from each entry's ``sweep`` values (the swept keys)."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Added to ``results.json`` (the sweep's parameters)."""
    backend: str = "torch"
    """Where the configs run: ``torch`` (adaptivespec's engine) or ``sglang`` (each config served by
    ``adaptivespec serve``, SGLang with the plugin; :mod:`adaptivespec.evaluation.sglang_contenders`)."""

    @property
    def names(self) -> list[str]:
        """Every contender's name: the configs', then the peers'."""
        return [e.name for e in self.entries] + list(self.peers)


def config_lossless(config: Config, host=None) -> bool:
    """Whether ``config`` decodes exactly like greedy decoding of its target (without loading it)."""
    if config.autoregressive:
        return True
    host = get_plugin_host() if host is None else host
    return bool(host.verifiers.get(config.verifier.name).cls.lossless)


def load_bench_config(path: str, overrides: list[str]) -> Config:
    """``load_config(path, overrides)``, except that ``model.drafter=...`` overrides leave an
    autoregressive config (``drafter: null`` in its file) autoregressive: ``--set
    model.drafter=DIR`` swaps the head of every speculative config without turning ``ar.yaml``
    into one."""
    is_drafter = [o.partition("=")[0].strip() == "model.drafter" for o in overrides]
    if not any(is_drafter):
        return load_config(path, overrides)
    plain = load_config(path, [o for o, d in zip(overrides, is_drafter) if not d])
    return plain if plain.model.drafter is None else load_config(path, overrides)


def sampling_seed(config: Config, index: int) -> int | None:
    """The seed prompt ``index`` of a run samples with: ``generation.seed + index`` (None: greedy)."""
    return None if config.generation.temperature == 0 else config.generation.seed + index


def sampling_of(config: Config) -> dict[str, Any]:
    """The sampling settings of ``config`` (``temperature`` 0: greedy), as recorded in results."""
    g = config.generation
    return {"temperature": g.temperature, "top_k": g.top_k, "top_p": g.top_p, "min_p": g.min_p, "seed": g.seed}
