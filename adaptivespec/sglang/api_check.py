"""Checking :data:`~adaptivespec.sglang.api.REQUIRED_API` against SGLang: statically over a source
tree with ``ast`` (:func:`check_api`, what the test suite runs against the pinned wheel without
importing it) or live in the server (:func:`assert_api`, at plugin load, with ``inspect`` on the
modules SGLang really imported)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Iterable

from adaptivespec.sglang.api import REQUIRED_API, SGLANG_VERSION, WHEEL_TAGS, Api, SGLangAPIError
from adaptivespec.sglang.source_ast import body_names, called, constant, find, imported, module_candidates, params, self_attrs


def check_node(api: Api, tree: ast.AST, node: ast.AST | None) -> str | None:
    """What is missing for ``api`` given the module's tree and the node ``api.name`` resolved to."""
    if api.kind == "constant":
        got = constant(tree, api.name)
        return None if got == api.value else f"{api.where()}: expected constant {api.value!r}, found {got!r}"
    if node is None:
        return f"{api.where()}: not found"
    kind_ok = {
        "class": isinstance(node, ast.ClassDef),
        "field": isinstance(node, ast.ClassDef),
        "attribute": isinstance(node, ast.ClassDef),
        "function": isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)),
        "call": isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)),
    }.get(api.kind, True)
    if not kind_ok:
        return f"{api.where()}: is a {type(node).__name__}, expected a {api.kind} scope"
    have = {
        "function": params,
        "field": body_names,
        "attribute": self_attrs,
        "import": lambda n: imported(n, top_level=not api.name),
        "call": called,
    }.get(api.kind, lambda n: set())(node)
    missing = [n for n in api.names if n not in have]
    if missing:
        what = {"function": "parameter", "field": "field", "attribute": "attribute self.", "import": "import",
                "call": "call to"}[api.kind]
        return f"{api.where()}: missing {what}{'' if what.endswith('.') else ' '}{', '.join(missing)}"
    return None


def default_root() -> Path | None:
    """The directory holding the installed ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def check_api(root: Path | None = None, required: Iterable[Api] = REQUIRED_API) -> list[str]:
    """Problems found checking ``required`` against the sources under ``root`` (the directory
    that contains ``sglang/``; default: the installed package). Empty when everything is there."""
    root = Path(root) if root is not None else default_root()
    if root is None:
        return ["sglang is not installed and no source root was given"]
    trees: dict[str, ast.Module | None] = {}
    problems = []
    for api in required:
        if api.module not in trees:
            path = next((root / c for c in module_candidates(api.module) if (root / c).is_file()), None)
            trees[api.module] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path else None
        tree = trees[api.module]
        if tree is None:
            problems.append(f"{api.module}: module not found under {root}")
            continue
        if api.kind != "module":
            problem = check_node(api, tree, find(tree, api.name))
            if problem:
                problems.append(problem)
    return problems


def extract_sources(wheel: Path, dest: Path, required: Iterable[Api] = REQUIRED_API) -> Path:
    """Unpack from ``wheel`` the source files ``required`` names into ``dest``; returns ``dest``."""
    wanted = {c for api in required for c in module_candidates(api.module)}
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member in wanted and not (dest / member).is_file():
                zf.extract(member, dest)
    return dest


def download_command(dest: Path) -> list[str]:
    """``pip download`` of the pinned wheel alone (no dependencies) into ``dest``."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={SGLANG_VERSION}", *WHEEL_TAGS, "-d", str(dest)]


# -- load-time check (inspect over the imported modules) ------------------------------------------
def _source_tree(obj: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def _check_live(api: Api) -> str | None:
    module = importlib.import_module(api.module)
    if api.kind == "module":
        return None
    if api.kind == "constant":
        got = getattr(module, api.name, None)
        return None if got == api.value else f"{api.where()}: expected constant {api.value!r}, found {got!r}"
    obj: Any = module
    for part in api.name.split(".") if api.name else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return f"{api.where()}: not found"
    if api.kind == "function":
        if not callable(obj):
            return f"{api.where()}: not callable"
        have = set(inspect.signature(obj).parameters)
        missing = [n for n in api.names if n not in have]
        return f"{api.where()}: missing parameter {', '.join(missing)}" if missing else None
    if api.kind == "class":
        return None if inspect.isclass(obj) else f"{api.where()}: not a class"
    if api.kind == "field":
        have = set()
        for klass in inspect.getmro(obj) if inspect.isclass(obj) else ():
            have |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
        have |= set(getattr(obj, "__struct_fields__", ())) | set(getattr(obj, "__dataclass_fields__", {}))
        missing = [n for n in api.names if n not in have]
        return f"{api.where()}: missing field {', '.join(missing)}" if missing else None
    if api.kind == "import" and not api.name:
        missing = [n for n in api.names if not hasattr(module, n)]
        return f"{api.where()}: missing import {', '.join(missing)}" if missing else None
    # attribute / call / scoped import: read the live object's own source
    tree = _source_tree(obj)
    return check_node(api, tree, tree.body[0])


def installed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def assert_api(required: Iterable[Api] = REQUIRED_API) -> None:
    """Raise :class:`SGLangAPIError` unless the imported SGLang has everything ``required``."""
    required = list(required)
    if any(a.module.split(".")[0] == "sglang" for a in required) and importlib.util.find_spec("sglang") is None:
        raise SGLangAPIError(f"sglang is not installed (the plugin needs sglang=={SGLANG_VERSION})")
    problems, broken = [], set()
    for api in required:
        if api.module in broken:
            continue
        try:
            importlib.import_module(api.module)
        except Exception as exc:  # an import failing is a finding, reported once per module
            broken.add(api.module)
            problems.append(f"{api.module}: {type(exc).__name__}: {exc}")
            continue
        try:
            problem = _check_live(api)
        except Exception as exc:
            problem = f"{api.where()}: {type(exc).__name__}: {exc}"
        if problem:
            problems.append(problem)
    if problems:
        raise SGLangAPIError(
            f"adaptivespec's SGLang plugin is written against sglang=={SGLANG_VERSION}; the installed "
            f"sglang {installed_version() or '(unknown version)'} lacks: " + "; ".join(problems)
        )
