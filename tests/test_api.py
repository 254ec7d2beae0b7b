"""The declared plugin API (``adaptivespec.api``) and the import graph it stands on.

Plugins import only ``adaptivespec.api`` (and ``adaptivespec`` itself); the modules the API gathers
depend on nothing of the decode step or the runtime; no module of adaptivespec imports itself
back through others, at module level or inside a function.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import adaptivespec.api as api
from adaptivespec import protocols
from adaptivespec.analysis.imports import cycles, import_graph, imported

ROOT = Path(__file__).resolve().parents[1]


# -- plugins import the API only ---------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["plugins/adaptivespec-talon/adaptivespec_talon", "plugins/adaptivespec-fly/adaptivespec_fly"])
def test_the_shipped_plugins_import_only_the_api(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    for path in files:
        bad = {m for m in imported(path, "plugin") if m not in ("adaptivespec", "adaptivespec.api")}
        bad = {m for m in bad if not m.startswith("adaptivespec.api.")}  # "from adaptivespec.api import X"
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}; plugins import adaptivespec.api only"


def test_the_scan_catches_an_import_beyond_the_api(tmp_path):
    path = tmp_path / "p.py"
    path.write_text("from adaptivespec.api import TreePolicy\n\ndef f():\n    from adaptivespec.tree import emit\n")
    assert "adaptivespec.tree" in imported(path, "p")


BUILTIN_EXTRAS = {
    "adaptivespec.policies.cost_aware": {"adaptivespec.costmodel"},  # its cost model: the policy's own machinery
    "adaptivespec.sources.retrieval": {"adaptivespec.sources.ngram"},  # its index, beside it
    "adaptivespec.policies.learned": {"adaptivespec.costmodel", "adaptivespec.learned_model"},  # its cost model, its fitted model
    "adaptivespec.policies.post_draft": {"adaptivespec.costmodel", "adaptivespec.policies.cost_aware"},  # cost_aware's rules, reused
}


def test_the_builtin_strategies_import_the_api_like_any_plugin():
    graph = import_graph()
    for name in graph:
        if name.split(".")[1:2] in (["policies"], ["verifiers"], ["sources"]):
            extra = graph[name] - {"adaptivespec", "adaptivespec.api"} - BUILTIN_EXTRAS.get(name, set())
            assert not extra, f"{name} imports {sorted(extra)} beyond adaptivespec.api"


# -- what the API is -------------------------------------------------------------------------------------
def test_every_api_name_resolves_and_is_documented():
    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        obj = getattr(api, name)
        if name != "hookimpl":
            assert inspect.getdoc(obj), f"adaptivespec.api.{name} has no docstring"


def test_the_api_stands_on_modules_that_know_nothing_of_the_step():
    graph = import_graph()
    below, todo = set(), ["adaptivespec.api"]
    while todo:  # everything the API reaches, transitively
        for m in graph[todo.pop()]:
            if m not in below:
                below.add(m)
                todo.append(m)
    step = {"adaptivespec.decode", "adaptivespec.runtime", "adaptivespec.proposal", "adaptivespec.fusion",
            "adaptivespec.constraints", "adaptivespec.config", "adaptivespec.drafter", "adaptivespec.models"}
    assert not below & step, sorted(below & step)
    assert not any(m.startswith("adaptivespec.fastpath") for m in below)


def test_config_and_strategies_do_not_reach_down():
    graph = import_graph()
    assert not graph["adaptivespec.config"] & {"adaptivespec.constraints", "adaptivespec.sampling"}
    assert "adaptivespec.fusion" not in graph["adaptivespec.strategies"]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- the protocols describe the built-ins --------------------------------------------------------------
def protocol_members(proto) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("_")}
    return names | set(getattr(proto, "__annotations__", {}))


@pytest.mark.parametrize("proto, cls_path", [
    (protocols.Sampling, "adaptivespec.sampling:Sampler"),
    (protocols.GrammarState, "adaptivespec.constraints:Constraint"),
    (protocols.Runtime, "adaptivespec.runtime:TorchRuntime"),
    (protocols.Drafter, "adaptivespec.drafter:Eagle3Drafter"),
])
def test_each_protocol_names_only_what_its_builtin_has(proto, cls_path):
    import importlib

    module, _, name = cls_path.partition(":")
    cls = importlib.import_module(module).__dict__[name]
    source = inspect.getsource(cls)
    for member in protocol_members(proto):
        assert hasattr(cls, member) or f"self.{member} =" in source or f"self.{member}, " in source, (
            f"{cls.__name__} has no {member} ({proto.__name__})")
