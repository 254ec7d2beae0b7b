"""Reading SGLang's sources with ``ast``, without importing them: where a module's file is, a
definition by dotted name, a function's parameters, a class's fields and ``self.`` attributes, the
names a scope imports and calls, a module constant."""

from __future__ import annotations

import ast
from typing import Any, Iterable


def module_candidates(module: str) -> tuple[str, str]:
    """Relative paths a module's source may have: ``a/b.py`` or ``a/b/__init__.py``."""
    rel = module.replace(".", "/")
    return f"{rel}.py", f"{rel}/__init__.py"


def defs(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Class and function definitions of a block, looking inside if/try/with but not into defs."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from defs(block)
            for handler in getattr(node, "handlers", []):
                yield from defs(handler.body)


def find(tree: ast.AST, dotted: str) -> ast.AST | None:
    node = tree
    for part in dotted.split(".") if dotted else ():
        node = next((d for d in defs(getattr(node, "body", [])) if d.name == part), None)
        if node is None:
            return None
    return node


def params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names | {x.arg for x in (a.vararg, a.kwarg) if x is not None}


def body_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def self_attrs(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def imported(node: ast.AST, top_level: bool) -> set[str]:
    stmts = node.body if top_level else list(ast.walk(node))
    return {a.asname or a.name for s in stmts if isinstance(s, (ast.Import, ast.ImportFrom)) for a in s.names}


def called(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def constant(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value) if isinstance(node.value, ast.Constant) else ...
    return None
