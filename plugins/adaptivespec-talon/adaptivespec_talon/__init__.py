"""adaptivespec-talon: TALON's budget-driven adaptive draft trees as the tree policy ``talon``."""

from __future__ import annotations

from adaptivespec.api import hookimpl
from adaptivespec_talon.policy import TalonParams, TalonPolicy

__all__ = ["TalonParams", "TalonPolicy"]


@hookimpl
def adaptivespec_register_policies(registry):
    registry.register(TalonPolicy)
