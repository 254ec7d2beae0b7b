"""The load model: which bank shape gives a batch the most tokens per second, from a cost model of the
served step (``serve --load-profile``) and the accept lengths seen so far. No sglang import."""

from __future__ import annotations

import os
from typing import Iterable

from adaptivespec.costmodel import CostModel
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import LOAD_PROFILE_ENV
from adaptivespec.sglang.shapes import NO_DRAFT, NoDraft
from adaptivespec.types import TreeShape


class LoadModel:
    """Load-aware trees: the shape that gives a batch the most tokens per second, from a cost model
    of the *served* step and the accept lengths seen so far.

    A step of ``bs`` requests at shape ``s`` is priced by the cost model as
    ``step_ms(verified=bs * s.ndt, levels=s.nsteps, nodes=bs * s.nsteps * s.topk)`` and yields
    ``bs * (1 + accepted(s))`` tokens, ``accepted(s)`` the exponential moving average of the
    drafted tokens accepted per request at that shape (unseen shapes: the average over all shapes,
    at most ``s.nsteps``). :meth:`choose` keeps the policy's shape unless a smaller bank shape
    (``ndt`` no larger) is expected to give more tokens per second: as the batch grows, every
    verified row costs more of the step and the tree shrinks, down to the bank's one-drafted-token
    floor, and with ``undrafted`` below it to a step that drafts nothing (:data:`NO_DRAFT`: one verified
    row per request, one token each) when that is expected to give more. At batch size 1 the
    policy's shape always runs (the paper's setting).

    Acceptance is learned only by drafting, so a run of undrafted steps is broken by a probe at the
    bank's cheapest tree, once the run is ``probe_every`` steps long *and* the probe's modelled cost
    is at most ``probe_share`` of the run's (at 8-16 requests on a CPU a merged-tree probe cost 3-5
    undrafted steps: probing every 16th step spent a fifth of the time on probes) *and* what it
    could learn can change the choice: at the highest acceptance that shape has had so far (its
    moving average's peak), the probe's tree would beat drafting nothing at this batch size. Where
    not even that beats it, a probe buys nothing and none runs (at 14-16 requests here each one cost
    ~250 ms against ~52 ms undrafted). A workload whose acceptance rises above anything seen since
    start is found at the smaller batch sizes where the peak still makes probing worth it.

    ``accepted(s)`` is the batch mean, i.e. the sum over the requests divided by the batch size: a
    request whose drafts keep failing adds nothing to a tree's expected tokens, so the batch drafts
    only while the requests whose drafts pay outweigh the rows spent on all of them.

    **Settled.** When drafting nothing beats the best tree by ``settle_margin`` (1.1: not tuned on
    any benchmark) and no probe is due next, :attr:`settled` is set: the worker then skips the head's
    draft-extend after that step (on a 2-vCPU CPU at 8 requests it was about 10% of an undrafted step).
    The step before each probe keeps it, so probes draft from real roots; a request that drafts again
    later does so with a head that missed those positions (lossless; its acceptance may drop, and
    that is what the next probes measure).

    The cost model is fitted from a served trace (``serve --trace`` records each step's time):
    ``python -m adaptivespec.analysis.served_cost``; the embedded pair's CPU profile ships as
    ``sglang-cpu-smollm2-135m-bf16.json``.
    """

    def __init__(self, cost: CostModel, *, decay: float = 0.9, probe_every: int = 16, probe_share: float = 0.05,
                 settle_margin: float = 1.1) -> None:
        if not 0.0 < decay < 1.0:
            raise AdaptiveSpecError(f"load model decay: expected a number in (0, 1), got {decay!r}")
        if probe_every < 1:
            raise AdaptiveSpecError(f"load model probe_every: expected at least 1 step, got {probe_every!r}")
        if not 0.0 < probe_share <= 1.0:
            raise AdaptiveSpecError(f"load model probe_share: expected a share in (0, 1], got {probe_share!r}")
        if settle_margin < 1.0:
            raise AdaptiveSpecError(f"load model settle_margin: expected a ratio of at least 1.0, got {settle_margin!r}")
        self.cost, self.decay, self.probe_every, self.settle_margin = cost, decay, probe_every, settle_margin
        self.probe_share = probe_share
        self._undrafted_ms = 0.0  # modelled time of the undrafted steps since the last probe
        self.settled = False
        """Whether the last choice was :data:`NO_DRAFT` by at least ``settle_margin`` x the best tree's
        expected tokens/s, with no probe due next: the head's draft-extend after that step can be
        skipped (:attr:`~adaptivespec.sglang.controller.TripletController.skip_draft_extend`)."""
        self._undrafted_in_a_row = 0
        self._accepted: dict[TreeShape, float] = {}
        self._peak: dict[TreeShape, float] = {}  # the highest value each moving average has had
        self._rows: dict[TreeShape, float] = {}  # verified rows per request (the draft stage may add some)
        self._overall: float | None = None

    def observe(self, shape: "TreeShape | NoDraft", accepted: float, rows: int | None = None) -> None:
        """A step ran at ``shape`` and accepted ``accepted`` drafted tokens per request (batch mean),
        verifying ``rows`` tokens per request (default ``shape.ndt``; more when the draft stage
        merged candidates in: the step's cost counts them)."""
        if isinstance(shape, NoDraft):
            return
        d = self.decay
        r, prev_rows = float(rows or shape.ndt), self._rows.get(shape)
        self._rows[shape] = r if prev_rows is None else d * prev_rows + (1 - d) * r
        prev = self._accepted.get(shape)
        self._accepted[shape] = accepted if prev is None else d * prev + (1 - d) * accepted
        self._peak[shape] = max(self._peak.get(shape, 0.0), self._accepted[shape])
        self._overall = accepted if self._overall is None else d * self._overall + (1 - d) * accepted

    def accepted(self, shape: "TreeShape | NoDraft") -> float:
        if isinstance(shape, NoDraft):
            return 0.0
        if shape in self._accepted:
            return self._accepted[shape]
        return min(float(shape.nsteps), self._overall if self._overall is not None else 1.0)

    def rows(self, shape: "TreeShape | NoDraft") -> float:
        """Expected verified rows per request at ``shape``: the moving average of what ran, else ``ndt``."""
        return self._rows.get(shape, float(shape.ndt)) if not isinstance(shape, NoDraft) else 1.0

    def step_ms(self, shape: "TreeShape | NoDraft", batch_size: int) -> float:
        return self.cost.step_ms(verified=batch_size * self.rows(shape), levels=shape.nsteps,
                                 nodes=batch_size * shape.nsteps * shape.topk, context=0.0)

    def tokens_per_s(self, shape: "TreeShape | NoDraft", batch_size: int, accepted: float | None = None) -> float:
        """Expected tokens per second of ``shape`` at ``batch_size``, accepting ``accepted`` drafted
        tokens per request (default: :meth:`accepted`)."""
        accepted = self.accepted(shape) if accepted is None else accepted
        return 1e3 * batch_size * (1.0 + accepted) / self.step_ms(shape, batch_size)

    def choose(self, shape: TreeShape, batch_size: int, shapes: Iterable[TreeShape],
               undrafted: bool = False) -> "TreeShape | NoDraft":
        """The shape to run for ``batch_size`` requests when the policy chose ``shape``
        (``undrafted``: :data:`NO_DRAFT` may win too)."""
        self.settled = False
        if batch_size <= 1:
            return shape
        best, best_rate = shape, self.tokens_per_s(shape, batch_size)
        for s in shapes:
            if s.ndt < shape.ndt:
                rate = self.tokens_per_s(s, batch_size)
                if rate > best_rate:
                    best, best_rate = s, rate
        undrafted_rate = self.tokens_per_s(NO_DRAFT, batch_size) if undrafted else 0.0
        if undrafted_rate <= best_rate:
            self._undrafted_in_a_row, self._undrafted_ms = 0, 0.0
            return best
        # acceptance is only learned by drafting: a run of undrafted choices is broken by a probe at
        # the bank's cheapest tree (a probe at a large tree costs several undrafted steps) once it is
        # probe_every steps long and the probe costs at most probe_share of the run's modelled time
        probe = min((s for s in shapes if s.ndt <= shape.ndt), key=lambda s: (s.ndt, s.nsteps * s.topk), default=shape)
        if self._probe_due(probe, batch_size):
            self._undrafted_in_a_row, self._undrafted_ms = 0, 0.0
            return probe
        self._undrafted_in_a_row += 1
        self._undrafted_ms += self.step_ms(NO_DRAFT, batch_size)
        self.settled = undrafted_rate >= self.settle_margin * best_rate and not self._probe_due(probe, batch_size)
        return NO_DRAFT

    def would_settle(self, batch_size: int, shapes: Iterable[TreeShape]) -> bool:
        """Whether drafting nothing beats every one of ``shapes`` by ``settle_margin`` at
        ``batch_size`` (what :meth:`choose` would call settled, probes aside); no state changes.
        The worker asks it when requests are admitted: their head's prefill is skipped when it is
        (:meth:`~adaptivespec.sglang.controller.TripletController.skip_prefill_extend`)."""
        if batch_size <= 1:
            return False
        best = max((self.tokens_per_s(s, batch_size) for s in shapes), default=0.0)
        return self.tokens_per_s(NO_DRAFT, batch_size) >= self.settle_margin * best

    def _probe_due(self, probe: TreeShape, batch_size: int) -> bool:
        return (self._undrafted_in_a_row >= self.probe_every
                and self.probe_share * self._undrafted_ms >= self.step_ms(probe, batch_size)
                and self._worth_probing(probe, batch_size))

    def _worth_probing(self, probe: TreeShape, batch_size: int) -> bool:
        """Whether ``probe`` at its peak acceptance so far (unseen: :meth:`accepted`'s guess) would
        give more tokens per second than drafting nothing: only then can a probe change the choice."""
        optimistic = self.tokens_per_s(probe, batch_size, accepted=self._peak.get(probe))
        return optimistic > self.tokens_per_s(NO_DRAFT, batch_size)


def write_settled_profile(path: "str | os.PathLike[str]") -> None:
    """Write a cost profile under which drafting nothing wins by far from 2 requests on, even if every
    drafted token were accepted (a draft level costs 20 ms, a drafted node 5 ms): a server run with
    it spends its batched steps undrafted and settled (the head's draft-extend skipped), as a loaded
    server does. ``scripts/sglang_load.py CONFIG@settled`` uses it to record those steps for
    :mod:`adaptivespec.analysis.served_cost`; a fit needs them besides the drafted ones
    (``CONFIG@none``), or it prices the undrafted step by extrapolation."""
    CostModel(fixed=5.0, per_draft_level=20.0, per_draft_node=5.0, per_verified_token=5.0).save(path)


def load_model_from_env() -> LoadModel | None:
    """``ADAPTIVESPEC_SGLANG_LOAD_PROFILE`` (``serve --load-profile``): the served step's cost
    profile; the controller then shrinks the tree as the batch grows (:class:`LoadModel`). Unset:
    no load model."""
    path = os.environ.get(LOAD_PROFILE_ENV, "").strip()
    if not path:
        return None
    try:
        return LoadModel(CostModel.load(path))
    except ValueError as exc:
        raise AdaptiveSpecError(f"{LOAD_PROFILE_ENV}: {exc}") from None
