"""The configuration reference, generated from the code that validates configs.

The documentation site's configuration reference and the parameter tables on its strategies page
are produced here, at build time, from the attrs classes of :mod:`adaptivespec.config` and from the
``Params`` class of every registered strategy (name, type, default, validation rule, docstring), so
they cannot drift from what :func:`adaptivespec.config.load_config` accepts. ``docs/hooks.py``
calls :func:`expand_markers`, which replaces ``<!-- reference: ... -->`` markers with these tables
when ``mkdocs build`` runs::

    <!-- reference: config -->            every section and every registered strategy
    <!-- reference: section runtime -->   one top-level section (model, runtime, generation)
    <!-- reference: policy dcs -->        one strategy's parameters (policy, verifier, source)
    <!-- reference: cli -->               every ``adaptivespec`` subcommand and its flags

``python -m adaptivespec.reference`` prints the whole configuration reference.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
import typing
from typing import Any

import attrs

KINDS = ("policy", "verifier", "source")
"""Strategy kinds whose ``Params`` are config keys (``policy:``, ``verifier:``, ``sources:``)."""


# -- docstrings of attrs fields ------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls`` (a string literal after the field)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def rst_to_md(text: str) -> str:
    """Docstring markup to one line of Markdown fit for a table cell."""
    text = re.sub(r":(?:class|func|meth|mod|attr|data):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`").replace("|", "\\|")
    return " ".join(text.split())


# -- types, defaults and validation rules ----------------------------------------------------------
def describe_type(tp: Any) -> str:
    """A type as a config author reads it: ``int``, ``float | null``, ``list[int]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe_type(a) for a in args)
    if origin in (tuple, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{describe_type(args[0])}]"
        return f"list[{', '.join(describe_type(a) for a in args)}]" if args else "list"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as it would be written in YAML."""
    if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
        value = value.factory() if not value.takes_self else None
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value else '""'
    if attrs.has(type(value)):
        return "(section)"
    return repr(value)


def _expected_text(fn: Any) -> str | None:
    """The ``expected ...`` part of the first message ``fn`` raises, with its closure's values filled in."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    scope = {**getattr(fn, "__globals__", {}), **inspect.getclosurevars(fn).nonlocals}
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr) and not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        parts = node.values if isinstance(node, ast.JoinedStr) else [node]
        text = []
        for part in parts:
            if isinstance(part, ast.Constant):
                text.append(str(part.value))
                continue
            try:
                text.append(format(eval(compile(ast.Expression(part.value), "<rule>", "eval"), dict(scope))))
            except Exception:
                break  # reached the part that shows the bad value
        joined = "".join(text)
        if joined.startswith("expected "):
            return joined.removeprefix("expected ").split(", got")[0].strip().rstrip(",;:")
    return None


def describe_validator(v: Any) -> str:
    """One line saying what a field's validator accepts (empty when it has none)."""
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):
        return "; ".join(filter(None, (describe_validator(x) for x in v)))
    inner = getattr(v, "_validators", None)
    if inner is not None:  # attrs.validators.and_
        return describe_validator(list(inner))
    if type(v).__name__ == "_OptionalValidator":
        return f"null or {describe_validator(v.validator)}"
    if inspect.isfunction(v):
        doc = (v.__doc__ or "").strip()
        if doc and not doc.startswith("Validator:"):
            return rst_to_md(doc.splitlines()[0])
        found = _expected_text(v)
        if found:
            return found
        return v.__name__.strip("_").replace("_", " ")
    return rst_to_md(repr(v))


def fields_table(cls: type) -> str:
    """A Markdown table of an attrs class's fields: key, type, default, rule, description."""
    cls = attrs.resolve_types(cls)
    docs = field_docs(cls)
    rows = ["| key | type | default | rule | description |", "|---|---|---|---|---|"]
    for f in attrs.fields(cls):
        default = "required" if f.default is attrs.NOTHING else f"`{yaml_value(f.default)}`"
        rule = describe_validator(f.validator)
        rows.append(f"| `{f.name}` | `{describe_type(f.type)}` | {default} | {rule} | {rst_to_md(docs.get(f.name, ''))} |")
    return "\n".join(rows)


# -- the reference -------------------------------------------------------------------------------
def _host(host=None):
    if host is None:
        from adaptivespec.plugins import get_plugin_host

        host = get_plugin_host()
    return host


def section_reference(name: str) -> str:
    """One top-level section's keys (``model``, ``runtime``, ``generation``)."""
    from adaptivespec.config import SECTIONS

    if name not in SECTIONS:
        raise KeyError(f"no config section {name!r}; expected one of {', '.join(SECTIONS)}")
    cls = SECTIONS[name]
    return f"`{name}:` ({cls.__name__})\n\n{fields_table(cls)}"


def strategy_reference(kind: str, name: str, host=None, heading: str = "") -> str:
    """One registered strategy: what it is, who provides it, its parameters."""
    entry = _host(host).registry(kind).get(name)
    params = getattr(entry.cls, "Params", None)
    loss = "" if kind == "source" else (" Lossless." if entry.lossless else " **Lossy** (opt-in).")
    head = (f"{heading}\n\n" if heading else "") + (
        f"{rst_to_md(entry.description)}{loss} Class `{entry.cls.__module__}.{entry.cls.__qualname__}`, "
        f"provided by `{entry.provider}`.")
    if params is None or not attrs.has(params) or not attrs.fields(params):
        return f"{head}\n\nNo parameters besides `name`."
    return f"{head} Keys besides `name`:\n\n{fields_table(params)}"


def config_reference(host=None) -> str:
    """Every config section and every registered policy, verifier and source with its parameters."""
    from adaptivespec.config import DEFAULT_STRATEGY, SECTIONS

    host = _host(host)
    out = []
    for name in SECTIONS:
        out += [f"## `{name}`", "", section_reference(name), ""]
    titles = {"policy": "## `policy`: tree policies", "verifier": "## `verifier`: verifiers",
              "source": "## `sources`: candidate sources"}
    intro = {
        "policy": f"`policy: {{name: NAME, ...}}` (default `{DEFAULT_STRATEGY['policy']}`); the other keys are the policy's own.",
        "verifier": f"`verifier: {{name: NAME, ...}}` (default `{DEFAULT_STRATEGY['verifier']}`).",
        "source": "`sources: [{name: NAME, ...}, ...]` (default: none), each item a source and its keys.",
    }
    for kind in KINDS:
        out += [titles[kind], "", intro[kind], ""]
        for entry in host.registry(kind).entries():
            out += [strategy_reference(kind, entry.name, host, heading=f"### `{entry.name}`"), ""]
    return "\n".join(out).rstrip() + "\n"


def cli_reference() -> str:
    """Every ``adaptivespec`` subcommand with its usage and flags, from the argument parser itself."""
    from adaptivespec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        p.prog = f"adaptivespec {name}"
        out += [f"### `adaptivespec {name}`", "", helps.get(name) or "", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def render(marker: str, host=None) -> str:
    """The Markdown that replaces ``<!-- reference: MARKER -->``."""
    words = marker.split()
    if words == ["config"]:
        return config_reference(host)
    if words == ["cli"]:
        return cli_reference()
    if len(words) == 2 and words[0] == "section":
        return section_reference(words[1])
    if len(words) == 2 and words[0] in KINDS:
        return strategy_reference(words[0], words[1], host)
    raise KeyError(f"unknown reference marker {marker!r}; expected config, cli, section NAME or KIND NAME")


MARKER = re.compile(r"<!--\s*reference:\s*(.+?)\s*-->")
STRATEGIES_PAGE = "strategies.md"
"""The page that must hold a ``<!-- reference: KIND NAME -->`` section for every registered strategy."""


def expand_markers(markdown: str, page: str, host=None) -> tuple[str, list[str]]:
    """``markdown`` with every reference marker replaced, and the problems found (for the build to fail on).

    A marker naming a strategy that is not registered (a plugin not installed where the site is
    built) becomes a note, not a problem; an unknown marker is a problem, and so is, on
    :data:`STRATEGIES_PAGE`, a registered policy, verifier or source without its own marker.
    """
    host = _host(host)
    problems: list[str] = []

    def replace(match: re.Match) -> str:
        marker = match.group(1)
        words = marker.split()
        if len(words) == 2 and words[0] in KINDS and words[1] not in host.registry(words[0]):
            return (f"!!! note\n    `{words[1]}` is a plugin that was not installed when this page was built "
                    f"(`pip install -e plugins/adaptivespec-{words[1]}`).")
        try:
            return render(marker, host)
        except Exception as exc:
            problems.append(f"{page}: <!-- reference: {marker} -->: {exc}")
            return ""

    if page == STRATEGIES_PAGE:
        present = {tuple(m.group(1).split()) for m in MARKER.finditer(markdown)}
        for kind in KINDS:
            for entry in host.registry(kind).entries():
                if (kind, entry.name) not in present:
                    problems.append(f"{page}: the registered {kind} {entry.name!r} has no "
                                    f"<!-- reference: {kind} {entry.name} --> section")
    return MARKER.sub(replace, markdown), problems


if __name__ == "__main__":
    print(config_reference())
