"""The plugin manager: built-in and outside strategies load through the same entry points.

Plugins are modules with ``@adaptivespec.hookimpl`` functions, advertised in the entry-point
group ``adaptivespec``. adaptivespec's own strategies are entry points of the ``adaptivespec``
distribution, so the path a third party uses is exercised on every run.

Environment:

* ``ADAPTIVESPEC_DISABLE_PLUGIN_AUTOLOAD=1``: load only adaptivespec's own entry points, plus
* ``ADAPTIVESPEC_PLUGINS=name,name``: entry-point names (or importable module paths) to load anyway.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata
from typing import Any

import attrs
import pluggy

from adaptivespec import hookspecs
from adaptivespec.errors import AdaptiveSpecError, UnknownStrategyError

PROJECT = "adaptivespec"
DISABLE_AUTOLOAD_ENV = "ADAPTIVESPEC_DISABLE_PLUGIN_AUTOLOAD"
LOAD_PLUGINS_ENV = "ADAPTIVESPEC_PLUGINS"

#: adaptivespec's own plugins; used only when the distribution's entry points are not installed
#: (running from a source tree). tests/test_plugins.py checks it matches pyproject.toml.
BUILTIN_PLUGINS = {
    "static": "adaptivespec.policies.static",
    "dcs": "adaptivespec.policies.dcs",
    "cost_aware": "adaptivespec.policies.cost_aware",
    "learned": "adaptivespec.policies.learned",
    "post_draft": "adaptivespec.policies.post_draft",
    "strict": "adaptivespec.verifiers.strict",
    "margin": "adaptivespec.verifiers.margin",
    "eagle3": "adaptivespec.drafter",
    "torch": "adaptivespec.runtime",
    "torch-cuda-graphs": "adaptivespec.fastpath.cuda_graphs",
    "llamacpp": "adaptivespec.llamacpp.runtime",
    "retrieval": "adaptivespec.sources.retrieval",
    "grammar": "adaptivespec.sources.grammar",
}


@attrs.frozen(kw_only=True)
class Entry:
    """One registered strategy."""

    kind: str
    name: str
    cls: type
    lossless: bool
    provider: str  # distribution (or module) that registered it
    description: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "lossless": self.lossless if self.kind in ("policy", "verifier") else None,
            "provider": self.provider,
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "description": self.description,
        }


class Registry:
    """Name -> class for one kind of strategy; refuses duplicates, lists names when one is unknown."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._provider = "?"
        self.failed: list[FailedPlugin] = []  # outside plugins that failed to load, named by unknown-name errors

    def register(self, cls: type, *, name: str | None = None) -> None:
        name = name or getattr(cls, "name", "")
        if not name:
            raise AdaptiveSpecError(f"{self._provider}: {self.kind} class {cls.__qualname__} has no name")
        if name in self._entries:
            other = self._entries[name].provider
            raise AdaptiveSpecError(
                f"{self.kind} {name!r} is registered twice: by {other} and by {self._provider}"
            )
        doc = (cls.__doc__ or "").strip().splitlines()
        self._entries[name] = Entry(
            kind=self.kind,
            name=name,
            cls=cls,
            lossless=bool(getattr(cls, "lossless", True)),
            provider=self._provider,
            description=doc[0] if doc else "",
        )

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownStrategyError(self.kind, name, self.names(), getattr(self, "failed", [])) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries


@attrs.define(eq=False)
class PluginHost:
    """Typed facade over the pluggy manager: the five registries and the observer hooks."""

    pm: pluggy.PluginManager
    policies: Registry
    verifiers: Registry
    drafters: Registry
    runtimes: Registry
    providers: dict[str, str]  # plugin name -> distribution
    sources: Registry = attrs.Factory(lambda: Registry("source"))

    def registry(self, kind: str) -> Registry:
        return {"policy": self.policies, "verifier": self.verifiers, "drafter": self.drafters, "runtime": self.runtimes,
                "source": self.sources}[kind]

    def has_observers(self, hook: str) -> bool:
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def entries(self) -> list[Entry]:
        return [e for r in (self.policies, self.verifiers, self.drafters, self.runtimes, self.sources) for e in r.entries()]

    @property
    def failed(self) -> list[FailedPlugin]:
        """Outside plugins that failed to load (each was reported on stderr)."""
        return list(getattr(self.pm, "adaptivespec_failed", []))


@attrs.frozen(kw_only=True)
class FailedPlugin:
    """An outside plugin whose entry point raised on import: reported, not fatal."""

    name: str
    distribution: str
    value: str
    error: str

    def describe(self) -> str:
        return f"plugin {self.name!r} from distribution {self.distribution!r} failed to load ({self.value}): {self.error}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plugin", "name": self.name, "lossless": None, "provider": self.distribution,
                "class": self.value, "description": f"FAILED to load: {self.error}", "failed": True, "error": self.error}


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=PROJECT))


def _load_plugins(pm: pluggy.PluginManager) -> dict[str, str]:
    providers: dict[str, str] = {}
    failed: list[FailedPlugin] = []
    pm.adaptivespec_failed = failed  # read by PluginHost.failed and the registries' unknown-name errors
    autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in {"1", "true", "yes"}
    wanted = {w.strip() for w in os.environ.get(LOAD_PLUGINS_ENV, "").split(",") if w.strip()}
    eps = _entry_points()
    own = [ep for ep in eps if ep.dist is not None and ep.dist.metadata["Name"] == PROJECT]
    if not own:  # running from a source tree that was not pip-installed
        for name, module in BUILTIN_PLUGINS.items():
            pm.register(importlib.import_module(module), name=name)
            providers[name] = PROJECT
    for ep in eps:
        dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        if not (autoload or dist == PROJECT or ep.name in wanted or ep.value in wanted):
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party plugin must say who it is
            failure = FailedPlugin(name=ep.name, distribution=dist, value=ep.value, error=f"{type(exc).__name__}: {exc}")
            if dist == PROJECT:  # a built-in strategy never goes missing quietly
                raise AdaptiveSpecError(f"{failure.describe()}; the adaptivespec installation is broken") from exc
            failed.append(failure)
            print(f"adaptivespec: warning: {failure.describe()}; running without it "
                  f"(set {DISABLE_AUTOLOAD_ENV}=1 to skip outside plugins)", file=sys.stderr)
            continue
        pm.register(plugin, name=ep.name)
        providers[ep.name] = dist
    loaded_values = {ep.name for ep in eps} | {ep.value for ep in eps}
    for module in sorted(wanted - loaded_values):  # a plain module path
        try:
            plugin = importlib.import_module(module)
        except ImportError as exc:
            raise AdaptiveSpecError(f"{LOAD_PLUGINS_ENV}: cannot import plugin {module!r}: {exc}") from exc
        if pm.get_plugin(module) is None:
            pm.register(plugin, name=module)
            providers[module] = module
    return providers


def _collect(pm: pluggy.PluginManager, hook: str, kind: str, providers: dict[str, str]) -> Registry:
    registry = Registry(kind)
    registry.failed = getattr(pm, "adaptivespec_failed", [])
    for impl in getattr(pm.hook, hook).get_hookimpls():  # registration order
        registry._provider = providers.get(impl.plugin_name, impl.plugin_name)
        impl.function(registry=registry)
    registry._provider = "?"
    return registry


def make_plugin_host(extra_plugins: list[Any] = ()) -> PluginHost:
    """Build a fresh plugin manager, load every plugin and fill the registries.

    ``extra_plugins``: objects to register in addition (tests, embedding applications).
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    providers = _load_plugins(pm)
    for plugin in extra_plugins:
        name = pm.register(plugin)
        providers[name] = getattr(plugin, "__name__", name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise AdaptiveSpecError(f"plugin {exc.plugin!r} implements an unknown hook: {exc}") from exc
    return PluginHost(
        pm=pm,
        policies=_collect(pm, "adaptivespec_register_policies", "policy", providers),
        verifiers=_collect(pm, "adaptivespec_register_verifiers", "verifier", providers),
        drafters=_collect(pm, "adaptivespec_register_drafters", "drafter", providers),
        runtimes=_collect(pm, "adaptivespec_register_runtimes", "runtime", providers),
        providers=providers,
        sources=_collect(pm, "adaptivespec_register_sources", "source", providers),
    )


_HOST: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host, built on first use."""
    global _HOST
    if _HOST is None:
        _HOST = make_plugin_host()
    return _HOST
