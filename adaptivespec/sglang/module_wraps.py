"""Wrapping a function of an SGLang module that its callers look up per call. No sglang import."""

from __future__ import annotations

from typing import Any, Callable


def wrap_once(module: Any, name: str, around: Callable[..., Any]) -> None:
    """Replace ``module.name`` by a function calling ``around(original, *args, **kwargs)``; nothing
    when the module has no such function or it is already wrapped by ``around``."""
    original = getattr(module, name, None)
    if original is None or getattr(original, "_adaptivespec_around", None) is around:
        return

    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)

    wrapped._adaptivespec_around = around
    setattr(module, name, wrapped)
