"""adaptivespec: per-step adaptive speculative decoding (AdaptiveSpec, EAGLE-3, TALON, FLy)."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("adaptivespec")
"""Marker for plugin hook implementations: ``@adaptivespec.hookimpl``."""

__all__ = ["hookimpl", "__version__"]
