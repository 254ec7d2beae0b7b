"""adaptivespec-fly: FLy's entropy-gated deferred-window acceptance as the verifier ``fly`` (lossy)."""

from __future__ import annotations

from adaptivespec.api import hookimpl
from adaptivespec_fly.verifier import FlyParams, FlyVerifier, strict_run_below, topk_entropy

__all__ = ["FlyParams", "FlyVerifier", "strict_run_below", "topk_entropy"]


@hookimpl
def adaptivespec_register_verifiers(registry):
    registry.register(FlyVerifier)
