"""The project's own imports, read with ``ast`` (nothing is imported): the module graph, its cycles,
and the layers of docs/architecture.md with the rule that keeps them: a module imports modules of
its own layer or of layers below it, never above.

    python -m adaptivespec.analysis.imports                     # the layers and any violation
    python -m adaptivespec.analysis.imports --plot docs/architecture-layers.png

Imports inside functions count as much as those at the top (a cycle hidden in a function is still
a cycle); ``importlib.import_module`` calls (the CLI's subcommand table, the plugin loader) are not
imports of a module and are not read.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "adaptivespec": ROOT / "adaptivespec",
    "adaptivespec.policies": ROOT / "policies",
    "adaptivespec.verifiers": ROOT / "verifiers",
    "adaptivespec.sources": ROOT / "sources",
}
"""Import names and the folders they live in (the built-in strategies' folders are mapped into the package)."""

LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("api", "what plugin authors build on: values, strategy bases, tree and sampling utilities, the plugin host",
     ("adaptivespec", "adaptivespec.api", "adaptivespec.errors", "adaptivespec.types", "adaptivespec.params",
      "adaptivespec.hookspecs", "adaptivespec.fusion_rules", "adaptivespec.protocols", "adaptivespec.tree",
      "adaptivespec.tree_sampling", "adaptivespec.strategies", "adaptivespec.plugins", "adaptivespec.response_format",
      "adaptivespec.costmodel", "adaptivespec.learned_model", "adaptivespec.hardware")),
    ("strategies", "the built-in policies, verifiers and candidate sources, registered like any plugin",
     ("adaptivespec.policies", "adaptivespec.verifiers", "adaptivespec.sources")),
    ("step", "the decode step: config, proposal and fusion, constraints, models, runtimes, fast path, speculation "
             "metrics",
     ("adaptivespec.config", "adaptivespec.constraints", "adaptivespec.fusion", "adaptivespec.proposal",
      "adaptivespec.models", "adaptivespec.paths", "adaptivespec.drafter", "adaptivespec.runtime", "adaptivespec.fastpath",
      "adaptivespec.llamacpp", "adaptivespec.decode", "adaptivespec.trace", "adaptivespec.sampling", "adaptivespec.metrics")),
    ("batch", "continuous batching: request states, the scheduler (queues, admission, step plans), the draft heads "
              "across lanes, the model runner over ragged rows, the row budget, the prefix cache; each request's step "
              "through its lane's `Engine`", ("adaptivespec.batch",)),
    ("interfaces", "the command line, the generated reference, the pytest kit for plugin authors",
     ("adaptivespec.cli", "adaptivespec.__main__", "adaptivespec.reference", "adaptivespec.testing")),
    ("serving", "the two engines, which never import each other: SGLang (plugin, command, loopback servers), "
                "the torch server",
     ("adaptivespec.sglang", "adaptivespec.server")),
    ("front door", "adaptivespec serve: the flags of both engines, the runtime choice, the hand-over",
     ("adaptivespec.serve",)),
    ("evaluation", "datasets, graders, the bench, sweeps, the served soak", ("adaptivespec.evaluation",)),
    ("training", "draft heads and learned policies: data, training, cards", ("adaptivespec.training",)),
    ("analysis", "one-off studies and checks, calibration", ("adaptivespec.analysis", "adaptivespec.calibrate")),
)
"""(name, what it holds, module prefixes), lowest layer first."""


def module_names() -> dict[str, Path]:
    """Every module of the project (``adaptivespec.x.y`` -> its file)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "adaptivespec" and parts[:1] in (["policies"], ["verifiers"], ["sources"]):
                continue
            out[".".join([package, *parts])] = path
    return out


def imported(path: Path, name: str) -> set[str]:
    """Every ``adaptivespec...`` module name imported anywhere in the file (functions included);
    ``from X import y`` counts as ``X.y`` (a submodule) and as ``X``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m == "adaptivespec" or m.startswith("adaptivespec.")}


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    mods = module_names() if mods is None else mods
    graph = {}
    for name, path in mods.items():
        targets = set()
        for m in imported(path, name):
            while m not in mods and "." in m:
                m = m.rpartition(".")[0]
            if m in mods and m != name:
                targets.add(m)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the layer holding ``module`` (the longest matching prefix); None: none."""
    best, where = -1, None
    for i, (_, _, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module == p or (p != "adaptivespec" and module.startswith(p + "."))  # the package's own face only
            if inside and len(p) > best:
                best, where = len(p), i
    return where


def violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per module without a layer and per import that points up a layer."""
    out = [f"{m}: in no layer (add it to LAYERS in adaptivespec/analysis/imports.py)" for m in sorted(graph) if layer_of(m) is None]
    for a in sorted(graph):
        la = layer_of(a)
        for b in sorted(graph[a]):
            lb = layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]}), a layer above it")
    return out


def layer_edges(graph: dict[str, set[str]]) -> Counter:
    """(from layer, to layer) -> imports between modules of the two (within a layer not counted)."""
    out: Counter = Counter()
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and la != lb:
                out[(la, lb)] += 1
    return out


def layers_markdown() -> str:
    """The table of docs/architecture.md (kept equal to :data:`LAYERS` by a test)."""
    rows = ["| layer | holds | modules (may import their own layer and those below) |", "|---|---|---|"]
    for i, (name, what, prefixes) in reversed(list(enumerate(LAYERS))):
        mods = ", ".join(f"`{p.removeprefix('adaptivespec.') if p != 'adaptivespec' else 'adaptivespec'}`" for p in prefixes)
        rows.append(f"| {i + 1}. {name} | {what} | {mods} |")
    return "\n".join(rows)


def figure(graph: dict[str, set[str]]):
    """The layers as stacked boxes, each arrow an import direction between two layers with its count."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    n = len(LAYERS)
    fig = Figure(figsize=(11, 0.9 * n + 0.8))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 11)
    ax.set_ylim(-0.4, n + 0.2)
    ax.axis("off")
    mods = Counter(layer_of(m) for m in graph)
    for i, (name, what, _) in enumerate(LAYERS):
        ax.add_patch(FancyBboxPatch((0.3, i + 0.1), 7.0, 0.7, boxstyle="round,pad=0.02", fc="#e8eef7", ec="#4a6fa5"))
        ax.text(0.5, i + 0.55, f"{i + 1}. {name}", fontsize=11, weight="bold", va="center")
        ax.text(0.5, i + 0.28, f"{what} ({mods.get(i, 0)} modules)", fontsize=6.5, va="center", color="#333")
    edges = layer_edges(graph)
    for k, ((a, b), count) in enumerate(sorted(edges.items())):
        x = 7.6 + 0.11 * (k % 30)
        ax.annotate("", xy=(x, b + 0.8), xytext=(x, a + 0.1),
                    arrowprops=dict(arrowstyle="->", color="#a33" if b > a else "#555", lw=0.6 + 0.15 * min(count, 10)))
    ax.text(0.3, -0.25, "arrows (right): imports from a layer down to another, width by how many; "
            "an arrow pointing up would be a violation (red)", fontsize=7, color="#333")
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", help="draw the layers and the imports between them to this PNG")
    args = ap.parse_args(argv)
    graph = import_graph()
    print(layers_markdown())
    problems = violations(graph) + [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for line in problems:
        print(f"imports: {line}", file=sys.stderr)
    if args.plot:
        figure(graph).savefig(args.plot, dpi=110)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
