"""A config as ``serve`` reads it (:class:`ServedConfig`), and what in it SGLang cannot serve
(:func:`unservable`): imported by :mod:`adaptivespec.sglang.serve` and by ``serve``'s front door
(:mod:`adaptivespec.serve`), whose ``--runtime auto`` sends what SGLang cannot serve to the torch runtime."""

from __future__ import annotations

from pathlib import Path

import attrs

from adaptivespec.config import Config, load_config
from adaptivespec.plugins import get_plugin_host
from adaptivespec.sglang.controller import build_strategies
from adaptivespec.sglang.shapes import sglang_shapes
from adaptivespec.sglang.state_bank import ShapeStateBank
from adaptivespec.strategies import TreePolicy


@attrs.frozen
class ServedConfig:
    """A config as ``serve`` reads it, once: the parsed YAML, its policy and its verifier's class
    (whose capabilities, not its name, decide how it is served). Every function below takes one, or
    a config path it reads into one."""

    path: Path
    config: Config
    policy: TreePolicy
    verifier_cls: type

    @classmethod
    def load(cls, path: str | Path) -> "ServedConfig":
        config = load_config(path)
        policy, _ = build_strategies(config)
        return cls(Path(path), config, policy, get_plugin_host().verifiers.get(config.verifier.name).cls)

    def bank(self) -> ShapeStateBank:
        """The policy's shapes as SGLang runs them (refusing what it cannot run)."""
        return ShapeStateBank(sglang_shapes(self.policy.shapes()))


def served_config(config: "str | Path | ServedConfig") -> ServedConfig:
    """``config`` itself, or the config at that path read (once per call site: pass the value on)."""
    return config if isinstance(config, ServedConfig) else ServedConfig.load(config)


def unservable(config: "str | Path | ServedConfig") -> str | None:
    """What in the config SGLang cannot serve, as one sentence (None: servable).

    A config with a draft head runs in SGLang's EAGLE-3 worker, its ``sources:`` merged into the
    head's tree by the plugin's draft stage (:mod:`adaptivespec.sglang.draft_stage`); an
    autoregressive config without sources is served as SGLang's plain decoding. Candidate sources
    without a draft head (``configs/grammar.yaml``) have no worker in SGLang to run in: the draft
    stage lives in the EAGLE-3 worker, which needs a head."""
    sc = served_config(config)
    if sc.config.model.drafter is None and sc.config.sources:
        names = ", ".join(s.name for s in sc.config.sources)
        return (f"{sc.path}: sources [{names}] with model.drafter null: the served draft stage runs in SGLang's "
                "EAGLE-3 worker, which needs a draft head; serve a config with a head and these sources "
                "(e.g. configs/hybrid.yaml: SGLang's grammar backend masks the verified tree of json_schema "
                "requests) or configs/ar.yaml")
    return None
