"""docs/architecture.md's layers hold in the code: every module has a layer, no import points up a
layer, no cycle anywhere, and the page's table and picture are the ones the code's imports give."""

from __future__ import annotations

from pathlib import Path

from adaptivespec.analysis import imports
from adaptivespec.analysis.imports import LAYERS, cycles, figure, import_graph, layer_edges, layer_of, layers_markdown, violations

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_has_a_layer_and_no_import_points_up():
    assert violations(import_graph()) == []


def test_no_cycle_anywhere():
    assert cycles(import_graph()) == []


def test_the_rule_catches_an_upward_import_and_a_module_without_a_layer():
    graph = {"adaptivespec.types": {"adaptivespec.decode"}, "adaptivespec.decode": {"adaptivespec.types"},
             "adaptivespec.brand_new": set()}
    found = violations(graph)
    assert "adaptivespec.types (api) imports adaptivespec.decode (step), a layer above it" in found
    assert any(line.startswith("adaptivespec.brand_new: in no layer") for line in found)
    assert cycles(graph) == [["adaptivespec.decode", "adaptivespec.types"]]


def test_layers_match_by_longest_prefix_and_the_package_face_only():
    assert LAYERS[layer_of("adaptivespec")][0] == "api"
    assert LAYERS[layer_of("adaptivespec.sglang.serve")][0] == "serving"
    assert LAYERS[layer_of("adaptivespec.fastpath.forward")][0] == "step"
    assert layer_of("adaptivespec.no_such_module") is None  # not swallowed by the package's own prefix
    assert LAYERS[layer_of("adaptivespec.batch.scheduler")][0] == "batch"
    assert LAYERS[layer_of("adaptivespec.serve")][0] == "front door"
    assert LAYERS[layer_of("adaptivespec.metrics")][0] == "step"


def test_one_front_door_above_two_engines_that_never_import_each_other():
    """``serve`` chooses between the engines from above; the batch scheduler sits between the step
    and the server; what both engines export on /metrics lives below both."""
    graph = import_graph()
    sglang = {m for m in graph if m.startswith("adaptivespec.sglang")}
    server = {m for m in graph if m.startswith("adaptivespec.server")}
    assert [m for m in sorted(sglang) if graph[m] & server] == []
    assert [m for m in sorted(server) if graph[m] & sglang] == []
    assert {"adaptivespec.sglang.serve", "adaptivespec.server.launch"} <= graph["adaptivespec.serve"]
    names = [name for name, _, _ in LAYERS]
    assert names.index("step") < names.index("batch") < names.index("serving") < names.index("front door")
    assert "adaptivespec.metrics" in graph["adaptivespec.server.metrics"] & graph["adaptivespec.sglang.metrics"]


def test_the_page_shows_the_layers_the_code_keeps(tmp_path):
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert layers_markdown() in page, "regenerate with: python -m adaptivespec.analysis.imports"
    assert "architecture-layers.png" in page and (ROOT / "docs" / "architecture-layers.png").is_file()
    graph = import_graph()
    fig = figure(graph)
    texts = [t.get_text() for t in fig.axes[0].texts]
    for i, (name, _, _) in enumerate(LAYERS):
        assert f"{i + 1}. {name}" in texts
    drawn = [a for a in fig.axes[0].texts if getattr(a, "arrow_patch", None) is not None]
    assert len(drawn) == len(layer_edges(graph)) and all(b < a for a, b in layer_edges(graph))
    assert imports.main(["--plot", str(tmp_path / "layers.png")]) == 0 and (tmp_path / "layers.png").stat().st_size > 5000
