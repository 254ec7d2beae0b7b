"""Policy ``static``: one fixed tree shape for every step (EAGLE-3's setting)."""

from __future__ import annotations

import attrs

import adaptivespec
from adaptivespec.api import StepSignals, TreePolicy, TreeShape, positive_int


@attrs.frozen(kw_only=True)
class StaticParams:
    nsteps: int = attrs.field(default=5, validator=positive_int)
    """Draft depth (levels below the root)."""
    topk: int = attrs.field(default=4, validator=positive_int)
    """Branching: children per expanded node and beam width."""
    ndt: int = attrs.field(default=8, validator=positive_int)
    """Tokens verified per step, root included."""

    def __attrs_post_init__(self) -> None:
        TreeShape(self.nsteps, self.topk, self.ndt)  # raises ValueError naming the problem


class StaticPolicy(TreePolicy):
    """The same ``(nsteps, topk, ndt)`` at every step."""

    name = "static"
    Params = StaticParams
    adapts_shape = False

    def __init__(self, params: StaticParams | None = None) -> None:
        super().__init__(params)
        self.shape = TreeShape(self.params.nsteps, self.params.topk, self.params.ndt)

    def shapes(self) -> tuple[TreeShape, ...]:
        return (self.shape,)

    def next_shape(self, signals: StepSignals) -> TreeShape:
        return self.shape


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(StaticPolicy)
