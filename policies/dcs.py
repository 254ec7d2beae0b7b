"""Policy ``dcs``: AdaptiveSpec's Draft Confidence Score tree policy.

Urbán, Kwon, Venieris, Mascolo, *Margins, Not Windows: Training-Free Per-Step Lossy Speculative
Decoding* (AdaptiveSpec), section 3, "Dynamic Draft Tree-Shaping". The paper gives the inputs
(draft top-1 probability, an EMA of accepted lengths with alpha = 0.3, a saturation divisor d),
the ends (3, 4, 4) <-> (7, 1, 8) and the five-step circuit breaker; the fusion, the binning and the
rounding below are this implementation's choices.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

import adaptivespec
from adaptivespec.api import (
    StepRecord, StepSignals, TreePolicy, TreeShape, as_tuple, cpu_kind, int_at_least, number_in, one_of,
)

START_LEVEL = {"wide": 0.0, "middle": 0.5, "deep": 1.0}
"""DCS value of each start choice: the start shape is the one this score selects."""


def _finite(inst, attribute, value) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")


def _tree_shape(inst, attribute, value) -> None:
    """A ``[nsteps, topk, ndt]`` triple that makes a valid :class:`TreeShape`."""
    ints = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ints or len(value) != 3:
        shown = list(value) if isinstance(value, tuple) else value
        raise ValueError(f"expected [nsteps, topk, ndt] (three integers), got {shown!r}")
    try:
        TreeShape(*value)
    except ValueError as exc:
        raise ValueError(f"expected a valid tree shape [nsteps, topk, ndt], got {list(value)}: {exc}") from None


@attrs.frozen(kw_only=True)
class DcsEnds:
    """DCS's two ends on one kind of CPU (``policy.on_cpu.<kind>``)."""

    wide: tuple[int, int, int] = attrs.field(converter=as_tuple, validator=_tree_shape)
    deep: tuple[int, int, int] = attrs.field(converter=as_tuple, validator=_tree_shape)


@attrs.frozen(kw_only=True)
class DcsOnCpu:
    """Ends that replace ``wide`` / ``deep`` on a CPU of one kind (:func:`adaptivespec.api.cpu_kind`)."""

    amx: DcsEnds | None = None
    """On a CPU with AMX (``amx_bf16``)."""
    avx512: DcsEnds | None = None
    """On a CPU with AVX-512 bf16 and no AMX."""
    avx2: DcsEnds | None = None
    """On an x86 CPU with AVX2 and no fast bf16 (``dtype: auto`` runs float32 there)."""


@attrs.frozen(kw_only=True)
class DcsParams:
    alpha: float = attrs.field(default=0.3, validator=[_finite, number_in(0, 1, lo_open=True)])
    """EMA weight of the newest step's accepted length (the paper: 0.3)."""
    d: float = attrs.field(default=3.0, validator=[_finite, number_in(0, None, lo_open=True, hi_open=True)])
    """Accepted drafted tokens per step (EMA) at which the history term saturates at 1. The
    default 3 is the depth of the wide end: once the EMA reaches what the shallowest tree can
    accept at most, history no longer argues for shallow trees. Smaller d biases toward deep."""
    weight: float = attrs.field(default=0.5, validator=[_finite, number_in(0, 1)])
    """Fusion weight of draft confidence; history gets 1 - weight."""
    wide: tuple[int, int, int] = attrs.field(default=(3, 4, 4), converter=as_tuple, validator=_tree_shape)
    """``[nsteps, topk, ndt]`` chosen at DCS = 0 (uncertain draft: shallow and wide)."""
    deep: tuple[int, int, int] = attrs.field(default=(7, 1, 8), converter=as_tuple, validator=_tree_shape)
    """``[nsteps, topk, ndt]`` chosen at DCS = 1 (confident draft: deep and narrow)."""
    levels: int = attrs.field(default=5, validator=int_at_least(2))
    """DCS bins, i.e. evenly spaced shapes from ``wide`` to ``deep`` (fewer if rounding merges some)."""
    breaker_steps: int = attrs.field(default=5, validator=int_at_least(1))
    """Consecutive zero-accept steps that trip the circuit breaker (the paper: 5)."""
    start: str = attrs.field(default="middle", validator=one_of(*START_LEVEL))
    """Shape of a sequence's first step and of the step after a breaker trip: the shape selected
    by DCS = 0 (``wide``), 0.5 (``middle``) or 1 (``deep``); the history EMA starts there too."""
    on_cpu: DcsOnCpu = attrs.field(factory=DcsOnCpu)
    """Ends measured for one kind of CPU, used instead of ``wide`` / ``deep`` where the engine runs
    on a CPU of that kind (``runtime.device: cpu``; the torch runtime and the batch engine bind the
    policy to the machine, :meth:`DcsPolicy.bind_costs`, and :attr:`DcsPolicy.cpu` names the kind in
    force). What a shape is worth depends on what its rows cost: on an AMX Xeon a verified row is
    nearly free up to ~32 rows, on an AVX-512 EPYC each row beyond 8 costs ~5% of a step. The
    policy's shapes, and so the bank, come from the ends in force."""


class DcsPolicy(TreePolicy):
    """Draft Confidence Score policy (AdaptiveSpec): deep narrow trees when confident, wide shallow ones if not.

    Per step, from the draft's top-1 probability ``p1`` at the root (``StepSignals``) and an EMA
    ``A`` of accepted drafted tokens per step (updated by :meth:`observe`)::

        A      <- alpha * accepted + (1 - alpha) * A        alpha = 0.3
        H      =  min(A / d, 1)                             history term, saturates at A = d
        DCS    =  w * clip(p1, 0, 1) + (1 - w) * H          in [0, 1], non-decreasing in p1 and A
        b      =  min(floor(DCS * L), L - 1)                L equal bins of [0, 1] (L = levels)
        q      =  b / (L - 1)                               bin 0 -> wide end, bin L-1 -> deep end
        nsteps =  round(wide.nsteps + q * (deep.nsteps - wide.nsteps))   depth grows with DCS
        topk   =  round(wide.topk   + q * (deep.topk   - wide.topk))     = deep.topk + (1 - q) * (...)
        ndt    =  clip(round(wide.ndt + q * (deep.ndt - wide.ndt)), 2, max_nodes(nsteps, topk) + 1)

    ``round`` is half-up. The ``L`` shapes are computed once, so :meth:`shapes` is exactly what
    :meth:`next_shape` can return; with the defaults they are (3,4,4) (4,3,5) (5,3,6) (6,2,7)
    (7,1,8). Because the shape varies in all three parameters, the drafted compute grows and
    shrinks with confidence instead of being redistributed within a fixed budget.

    Forced steps: the first step of a sequence and the step after the circuit breaker trips use
    the start shape (that of DCS = ``START_LEVEL[start]``); their trace ``dcs`` is None. The
    breaker trips after ``breaker_steps`` consecutive observed steps with ``accepted == 0``; it
    also resets ``A`` to its initial value ``START_LEVEL[start] * d`` (history term = the start
    level), so one bad stretch does not pin the policy to its shallow end. A non-zero accept resets
    the streak. Autoregressive steps (``shape is None``) are not observed.
    """

    name = "dcs"
    Params = DcsParams

    def __init__(self, params: DcsParams | None = None) -> None:
        super().__init__(params)
        self.cpu: str | None = None
        """The CPU kind whose ``on_cpu`` ends are in force (None: ``wide`` / ``deep``)."""
        self._set_ends(self.params.wide, self.params.deep)

    def _set_ends(self, wide: tuple[int, int, int], deep: tuple[int, int, int]) -> None:
        p = self.params
        self._wide, self._deep = TreeShape(*wide), TreeShape(*deep)
        self._table = tuple(self.interpolate(b / (p.levels - 1)) for b in range(p.levels))  # bin -> shape
        self._shapes = tuple(sorted(set(self._table)))
        start = START_LEVEL[p.start]
        self._start_shape = self._table[self.level(start)]
        self._ema0 = start * p.d
        self.reset()

    def bind_costs(self, measure, device: str) -> None:
        """On a CPU whose kind ``on_cpu`` names, its ends replace ``wide`` / ``deep`` (``measure``
        is not read: the ends were measured for the kind). Called once, before :meth:`shapes`."""
        kind = cpu_kind() if device.split(":")[0] == "cpu" else None
        ends = getattr(self.params.on_cpu, kind, None) if kind else None
        if ends is not None:
            self.cpu = kind
            self._set_ends(ends.wide, ends.deep)

    # -- the score and the shape table ---------------------------------------------------------
    def score(self, p1: float, ema: float) -> float:
        """DCS in [0, 1] from the draft top-1 probability and the accepted-length EMA."""
        p = self.params
        p1 = p1 if 0.0 <= p1 <= 1.0 else (1.0 if p1 > 1.0 else 0.0)  # NaN -> 0
        history = min(max(ema, 0.0) / p.d, 1.0)
        return p.weight * p1 + (1.0 - p.weight) * history

    def level(self, dcs: float) -> int:
        """Bin of ``dcs``: ``min(floor(dcs * levels), levels - 1)``."""
        n = self.params.levels
        return min(int(dcs * n), n - 1)

    def interpolate(self, q: float) -> TreeShape:
        """The shape at fraction ``q`` of the way from the wide end to the deep end."""
        w, d = self._wide, self._deep

        def lerp(a: int, b: int) -> int:
            return math.floor(a + q * (b - a) + 0.5)

        nsteps, topk = lerp(w.nsteps, d.nsteps), lerp(w.topk, d.topk)
        cap = topk + (nsteps - 1) * topk * topk + 1  # max_nodes + the root
        return TreeShape(nsteps, topk, min(max(lerp(w.ndt, d.ndt), 2), cap))

    def shape_for(self, dcs: float) -> TreeShape:
        """The shape a given DCS selects."""
        return self._table[self.level(dcs)]

    @property
    def start_shape(self) -> TreeShape:
        return self._start_shape

    # -- TreePolicy ----------------------------------------------------------------------------
    def shapes(self) -> tuple[TreeShape, ...]:
        return self._shapes

    def reset(self) -> None:
        self._ema = self._ema0  # accepted-length EMA
        self._zero_streak = 0
        self._force_start = True  # the first step uses the start shape
        self._trip_pending = False
        # what the last decision read, for state()
        self._dcs: float | None = None
        self._p1: float | None = None
        self._ema_used = self._ema0
        self._tripped = False
        self._streak_used = 0

    def next_shape(self, signals: StepSignals) -> TreeShape:
        p1 = signals.draft_top1_prob
        self._p1, self._ema_used, self._streak_used = p1, self._ema, self._zero_streak
        if self._force_start:
            self._force_start = False
            self._tripped, self._trip_pending = self._trip_pending, False
            self._dcs = None
            return self._start_shape
        self._tripped = False
        self._dcs = dcs = self.score(p1, self._ema)
        return self._table[self.level(dcs)]

    def observe(self, record: StepRecord) -> None:
        if record.shape is None:  # autoregressive step: nothing was drafted
            return
        alpha = self.params.alpha
        self._ema = alpha * record.accepted + (1.0 - alpha) * self._ema
        if record.accepted:
            self._zero_streak = 0
            return
        self._zero_streak += 1
        if self._zero_streak >= self.params.breaker_steps:  # circuit breaker
            self._zero_streak = 0
            self._ema = self._ema0
            self._force_start = self._trip_pending = True

    def state(self) -> dict[str, Any]:
        return {
            "dcs": self._dcs,
            "draft_top1_prob": self._p1,
            "ema_accept": self._ema_used,
            "breaker_tripped": self._tripped,
            "zero_streak": self._streak_used,
        }


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(DcsPolicy)
