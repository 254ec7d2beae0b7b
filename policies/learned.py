"""Policy ``learned``: the tree shape a fitted model expects to give the most tokens per millisecond.

The model (:class:`~adaptivespec.learned_model.ShapeModel`, fitted by ``adaptivespec
train-policy`` on counterfactual labels of training prompts) reads what is known before drafting
(the draft's top-1 probability, entropy and top-4 probability at the root, the accepted-length EMA,
the last accepted length and whether it filled the tree's depth, the context length, the candidate
sources' match) and picks, among its shape set, the
shape with the most expected tokens per modelled millisecond. The choice is pure: every shape is
verified by the same verifier, so the policy is lossless.

Safety net (``hedge``): per request, a two-armed choice between the learned shape and a static
shape. The learned arm plays by default; the static arm is probed every few steps; each arm's
realised rate (emitted tokens per measured step millisecond, decayed) is kept, and the static shape
takes over while its rate beats the learned arm's by ``margin`` (and hands back when the learned
arm's probes beat it by as much).
"""

from __future__ import annotations

import time
from typing import Any

import attrs

import adaptivespec
from adaptivespec.api import StepRecord, StepSignals, TreePolicy, TreeShape, int_at_least, number_in, one_of
from adaptivespec.costmodel import (
    COST_SOURCES, MEASURED_SOURCE, CostModel, ProfileOrigin, measured_costs, resolve_profile,
)
from adaptivespec.learned_model import ShapeModel, basis

LEARNED, STATIC = 0, 1
ARMS = ("learned", "static")


def _optional_shape(inst, attribute, value) -> None:
    if value is None:
        return
    ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ValueError(f"expected null or [nsteps, topk, ndt] (three integers), got {value!r}")
    TreeShape(*value)


def _optional_str(inst, attribute, value) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"expected null or a file name, got {value!r}")


@attrs.frozen(kw_only=True)
class LearnedParams:
    model: str | None = attrs.field(default=None, validator=_optional_str)
    """Fitted file (``adaptivespec train-policy``): a path or a shipped name; null: the embedded pair's."""
    profile: str | None = attrs.field(default=None, validator=_optional_str)
    """Cost profile (``adaptivespec calibrate``) replacing the fitted file's cost model; null: keep it."""
    costs: str = attrs.field(default="auto", validator=one_of(*COST_SOURCES))
    """What shapes are priced with: ``profile`` (``profile``, else the fitted file's cost model),
    ``measured`` (this machine's cost table, as ``cost_aware``'s) or ``auto`` (measured where that
    cost model was fitted on another CPU)."""
    static: tuple[int, int, int] | None = attrs.field(default=None, validator=_optional_shape,
                                                       converter=lambda v: tuple(v) if isinstance(v, list) else v)
    """The hedge's static shape ``[nsteps, topk, ndt]``; null: the fitted file's (the best static on its data)."""
    hedge: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    """Fall back toward the static shape when the learned choice is measured to do worse."""
    probe_every: int = attrs.field(default=16, validator=int_at_least(2))
    """The arm not in the lead plays once after this many steps (its estimate stays current)."""
    min_steps: int = attrs.field(default=2, validator=int_at_least(1))
    """Steps each arm must have played before the lead can change (until then probes come twice as often)."""
    margin: float = attrs.field(default=0.05, validator=number_in(0, 1))
    """Relative rate by which the trailing arm must beat the leader to take the lead."""
    decay: float = attrs.field(default=0.9, validator=number_in(0, 1, lo_open=True))
    """Weight of an arm's past observations at each new one (1: plain means)."""


class LearnedPolicy(TreePolicy):
    """A fitted model's shape choice, hedged per request against a static shape (module docstring)."""

    name = "learned"
    Params = LearnedParams
    reads_draft_entropy = True

    def __init__(self, params: LearnedParams | None = None, model: ShapeModel | None = None) -> None:
        """``model``: an already loaded fitted model (replays), instead of ``params.model``."""
        super().__init__(params)
        p = self.params
        self._profile = resolve_profile(p.profile, "", "profile") if p.profile else None
        cost = CostModel.load(self._profile) if self._profile else None
        if model is not None and cost is not None:
            model.set_cost(cost)
        self.model = model if model is not None else ShapeModel.load(p.model, cost)
        self.static = TreeShape(*p.static) if p.static else self.model.static
        self._shapes = tuple(sorted(set(self.model.shapes) | {self.static}))
        self.decide_ns = 0
        self.decisions = 0
        self.reset()

    def shapes(self) -> tuple[TreeShape, ...]:
        return self._shapes

    def fitted_on(self) -> list[ProfileOrigin]:
        """The fitted model (its shape choice, and its cost model unless ``profile`` replaces it) and the
        ``profile`` when given."""
        measured = self.model.cost.meta.get("source") == MEASURED_SOURCE  # then no file prices the shapes
        origins = [ProfileOrigin.read("policy.model", self.model.source, timed=self._profile is None and not measured)]
        if self._profile is not None and not measured:
            origins.append(ProfileOrigin.read("policy.profile", self._profile, timed=True))
        return origins

    def bind_costs(self, measure, device: str) -> None:
        """Price the shapes with this machine's measured cost table where ``costs`` asks for it."""
        key, path = ("policy.profile", self._profile) if self._profile else ("policy.model", self.model.source)
        rows = max(s.ndt for s in self._shapes) + self.model.extra_slots  # the most a step verifies
        cost = measured_costs(self.name, self.params.costs, ProfileOrigin.read(key, path, timed=True), measure, device,
                              topk=max(s.topk for s in self._shapes), rows=rows, context_ref=self.model.cost.context_ref)
        if cost is not None:
            self.model.set_cost(cost)

    def reset(self) -> None:
        self._ema = self.model.ema_init
        self._saturated, self._sat_ema = False, 0.0  # did the last step accept its whole depth; EMA of that
        self._tokens = [0.0, 0.0]  # decayed emitted tokens per arm
        self._ms = [0.0, 0.0]  # decayed step milliseconds per arm
        self._n = [0, 0]
        self._lead = LEARNED
        self._since_other = 0
        self._arm = LEARNED
        self._choice: TreeShape | None = None
        self._modelled_ms = 0.0

    # -- the decision ----------------------------------------------------------------------------
    def next_shape(self, signals: StepSignals) -> TreeShape:
        t0 = time.perf_counter_ns()
        m = self.model
        phi = basis(signals.draft_top1_prob, signals.draft_entropy, self._ema, signals.last_accepted,
                    signals.context, signals.source_match, signals.source_nodes, signals.source_top,
                    self._saturated, self._sat_ema, signals.draft_top4_prob)
        ms = m.step_ms(signals.context, signals.source_nodes)
        score = (1.0 + m.expected(phi)) / ms
        i = int(score.argmax())
        self._choice = m.shapes[i]
        self._arm = self._pick_arm() if self.params.hedge else LEARNED
        if self._arm == LEARNED:
            shape, self._modelled_ms = self._choice, float(ms[i])
        else:
            shape = self.static
            self._modelled_ms = m.shape_ms(shape, signals.context, signals.source_nodes)
        self.decide_ns += time.perf_counter_ns() - t0
        self.decisions += 1
        return shape

    def _pick_arm(self) -> int:
        """The lead arm, or the other one when its probe is due."""
        p, other = self.params, 1 - self._lead
        due = p.probe_every if self._n[other] >= p.min_steps else max(2, p.probe_every // 2)
        if self._since_other + 1 >= due:
            return other
        return self._lead

    def rate(self, arm: int) -> float:
        """Realised tokens per millisecond of ``arm`` (0 before it played)."""
        return self._tokens[arm] / self._ms[arm] if self._ms[arm] > 0 else 0.0

    def observe(self, record: StepRecord) -> None:
        if record.shape is None:
            return
        p = self.model
        self._ema = p.ema_alpha * record.accepted + (1.0 - p.ema_alpha) * self._ema
        self._saturated = record.accepted >= record.shape.nsteps
        self._sat_ema = p.ema_alpha * self._saturated + (1.0 - p.ema_alpha) * self._sat_ema
        if not self.params.hedge:
            return
        arm, d = self._arm, self.params.decay
        ms = record.draft_ms + record.verify_ms + record.other_ms
        ms = ms if ms > 0 else self._modelled_ms  # replays carry no timings: the modelled cost
        self._tokens[arm] = d * self._tokens[arm] + record.new_tokens
        self._ms[arm] = d * self._ms[arm] + ms
        self._n[arm] += 1
        self._since_other = 0 if arm != self._lead else self._since_other + 1
        lead, other = self._lead, 1 - self._lead
        if min(self._n) >= self.params.min_steps and self.rate(other) > (1.0 + self.params.margin) * self.rate(lead):
            self._lead, self._since_other = other, 0

    def state(self) -> dict[str, Any]:
        return {"arm": ARMS[self._arm], "learned_shape": str(self._choice), "lead": ARMS[self._lead],
                "ema_accept": self._ema}

    @property
    def decide_us(self) -> float:
        """Mean wall time of one :meth:`next_shape` so far (microseconds)."""
        return self.decide_ns / self.decisions / 1e3 if self.decisions else 0.0


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(LearnedPolicy)
