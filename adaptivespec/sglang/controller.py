"""The served step controller: asks one tree policy for each step's ``(nsteps, topk, ndt)`` in an
SGLang worker, and builds a config's served strategies. No sglang import."""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable, Iterable, Sequence

import attrs
import torch

from adaptivespec.errors import AdaptiveSpecError, ShapeNotInBankError
from adaptivespec.plugins import get_plugin_host
from adaptivespec.sglang import VERIFY_BUDGET_ENV
from adaptivespec.sglang.load_model import LoadModel
from adaptivespec.sglang.metrics import SpecMetrics
from adaptivespec.sglang.shapes import NO_DRAFT, NoDraft, format_shapes, load_floor_shape, sglang_shape, sglang_shape_problem, sglang_shapes
from adaptivespec.strategies import TreePolicy, Verifier
from adaptivespec.types import StepRecord, StepSignals, TreeShape

SKIP_EXTEND_ENV = "ADAPTIVESPEC_SGLANG_SKIP_EXTEND"
"""``0``: the head's draft-extend runs after every undrafted step (see :attr:`LoadModel.settled`)."""

BATCH_REDUCERS = ("mean", "min", "max")
"""How a batch's per-request signals become the one value a batch-wide shape is chosen from."""


def _reduce(values: Sequence[float], how: str) -> float:
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    return sum(values) / len(values)


# -- the per-step controller ---------------------------------------------------------------------
def root_signals(topk_p: torch.Tensor, reduce: str = "mean", entropy: torch.Tensor | None = None) -> tuple[float, float, float]:
    """The draft's top-1 probability, entropy (nats; 0 when ``entropy`` [bs] is None) and top-4
    probability at the root, each one number for the batch (``reduce`` over requests), in one
    device-to-host transfer. ``topk_p``: [bs, k] probabilities of the root's k best children
    (``EagleDraftInput.topk_p``); the top-4 probability sums the columns there are, at most 4."""
    p = topk_p.float()
    rows = [p.amax(dim=-1), p.topk(min(4, p.shape[1]), dim=-1).values.sum(-1)]
    if entropy is not None:
        rows.append(entropy.float().to(p.device))
    top1, top4, *h = (float(_reduce(r, reduce)) for r in torch.stack(rows).tolist())
    return top1, h[0] if h else 0.0, top4


@attrs.define(eq=False)
class _PendingStep:
    """A step whose shape was chosen and whose accept lengths have not come back yet."""

    step: int
    epoch: int  # the controller's reset count when the step began
    shape: "TreeShape | NoDraft"
    signals: StepSignals
    policy_state: dict[str, Any]
    batch_size: int = 1
    promoted: list[int] | None = None
    started: float = 0.0  # perf_counter() when the shape was chosen (before drafting)
    gap_ms: float | None = None  # from the previous step's accept lengths to this start, same batch
    requested: TreeShape | None = None  # the policy's shape, when the load controls ran a smaller one
    by_source: dict[str, int] | None = None  # accepted drafted tokens per proposer (a merged step)
    width: int | None = None  # verify rows per request of a merged step


class TripletController:
    """Asks one tree policy for each step's ``(nsteps, topk, ndt)`` in an SGLang worker.

    Per decode step the worker calls :meth:`begin_step` with the draft input's ``topk_p`` before
    drafting, and :meth:`observe` with the accept lengths when the scheduler has them on the host
    (``on_verify_complete_cpu``). Results come back in launch order, so pending steps form a FIFO:
    with SGLang's overlap scheduler the accept lengths of step t arrive after step t+1 began and the
    policy's ``last_accepted`` then lags one step (``adaptivespec serve`` disables overlap).

    **Batches.** One CUDA graph serves the whole batch, so one shape is chosen per batch: the draft
    top-1 probabilities and the accepted lengths of the requests are reduced with
    ``batch_reduce`` (``mean`` by default; ``min`` picks the shape the least confident request
    wants: wider, shallower trees). At batch size 1 (the paper's setting) every reducer is exact.

    **Sequences.** :meth:`TreePolicy.reset` is called when a step's request ids share none with
    the previous step's (a new request at batch size 1). The circuit breaker lives in the policy
    (the ``dcs`` policy restores its start shape after consecutive zero-accept steps): the
    controller feeds it every step's record, zero-accept steps included.
    """

    def __init__(
        self,
        policy: TreePolicy,
        *,
        batch_reduce: str = "mean",
        on_record: Callable[[StepRecord], None] | None = None,
        on_trace: Callable[[StepRecord, int, float | None], None] | None = None,
        verify_budget: int | None = None,
        load: LoadModel | None = None,
        metrics: SpecMetrics | None = None,
        undrafted: bool = False,
    ) -> None:
        if batch_reduce not in BATCH_REDUCERS:
            raise AdaptiveSpecError(f"batch_reduce: expected one of {', '.join(BATCH_REDUCERS)}, got {batch_reduce!r}")
        if verify_budget is not None and verify_budget < 2:
            raise AdaptiveSpecError(f"verify_budget: expected at least 2 verified rows per step, got {verify_budget}")
        own = sglang_shapes(policy.shapes())
        if (verify_budget is not None or load is not None) and own:
            own.add(load_floor_shape(own))
        shapes = tuple(sorted(own))
        if not shapes:
            raise AdaptiveSpecError(f"policy {policy.name!r} declares no tree shapes")
        problems = [p for p in map(sglang_shape_problem, shapes) if p]
        if problems:
            raise AdaptiveSpecError(f"policy {policy.name!r} declares shapes SGLang cannot run: " + "; ".join(problems))
        self.policy = policy
        self.shapes = shapes
        self.batch_reduce = batch_reduce
        self.on_record = on_record
        self.on_trace = on_trace
        self.verify_budget = verify_budget
        self.load = load
        self.metrics = metrics
        self.undrafted = undrafted
        """Whether the load controls may run :data:`NO_DRAFT` (the worker has a state for it)."""
        self.skip_draft_extend = False
        """Whether the step :meth:`begin_step` just chose drafts nothing and the load model settled on
        that (:attr:`LoadModel.settled`): the worker then skips the head's draft-extend after it."""
        self.skip_settled_extend = True
        """False: never skip it (``$ADAPTIVESPEC_SGLANG_SKIP_EXTEND=0``, :data:`SKIP_EXTEND_ENV`)."""
        self.last_record: StepRecord | None = None
        self._pending: collections.deque[_PendingStep] = collections.deque()
        self._epoch = 0
        self._step = 0
        self._last_accepted = -1
        self._last_requests: frozenset | None = None
        self._observed_at: float | None = None  # perf_counter() of the last observe

    def reset(self) -> None:
        """Start a new sequence: the policy forgets its history; steps still in flight are dropped."""
        self.policy.reset()
        self._epoch += 1
        self._step = 0
        self._last_accepted = -1

    def begin_step(self, topk_p: torch.Tensor, request_ids: Iterable[Any] | None = None,
                   entropy: torch.Tensor | None = None) -> TreeShape | None:
        """The shape of the step about to be drafted; None for an empty (idle) batch.

        ``topk_p``: [bs, k_max] first-level draft probabilities; ``request_ids``: the batch's
        request ids (for sequence boundaries), or None to never reset here; ``entropy``: [bs] the
        draft's entropy at each root (:mod:`adaptivespec.sglang.root_entropy`), None: unknown (0).
        """
        self.skip_draft_extend = False
        if topk_p.shape[0] == 0:
            return None
        now, gap_ms = time.perf_counter(), None
        if request_ids is not None:
            ids = frozenset(request_ids)
            if ids == self._last_requests and self._observed_at is not None and not self._pending:
                gap_ms = (now - self._observed_at) * 1e3  # the same batch: nothing else ran in between
            if self._last_requests is not None and not (ids & self._last_requests):
                self.reset()
            self._last_requests = ids
        top1, h, top4 = root_signals(topk_p, self.batch_reduce, entropy)
        signals = StepSignals(
            step=self._step,
            draft_top1_prob=top1,
            draft_entropy=h,
            draft_top4_prob=top4,
            last_accepted=self._last_accepted,
        )
        shape = sglang_shape(self.policy.next_shape(signals))
        if shape not in self.shapes:
            raise ShapeNotInBankError(
                f"policy {self.policy.name!r} chose {shape}, which is not among the shapes it declared "
                f"(and that were captured): {format_shapes(self.shapes)}"
            )
        bs = int(topk_p.shape[0])
        state = dict(self.policy.state())
        run = self.fit_load(shape, bs)
        if run != shape:
            state["load_capped_from"] = str(shape)
        self.skip_draft_extend = (self.skip_settled_extend and isinstance(run, NoDraft) and self.load is not None
                                  and self.load.settled)
        if self.skip_draft_extend:
            state["draft_extend"] = "skipped"
        self._pending.append(_PendingStep(self._step, self._epoch, run, signals, state, batch_size=bs,
                                          started=now, gap_ms=gap_ms, requested=shape if run != shape else None))
        self._step += 1
        return run

    def skip_prefill_extend(self, live_requests: int) -> bool:
        """Whether requests admitted now skip the head's draft-extend over their prompt: the last
        decode step skipped its own (:attr:`skip_draft_extend`: the load model settled on drafting
        nothing) and drafting nothing still beats every bank tree by the settle margin with
        ``live_requests`` in the batch (:meth:`LoadModel.would_settle`; the live count guards a
        stale flag, e.g. after the server went idle). Counted in the metrics when it is."""
        skip = (self.skip_draft_extend and self.load is not None
                and self.load.would_settle(live_requests, self.shapes))
        if skip and self.metrics is not None:
            self.metrics.observe_prefill_extend_skipped()
        return skip

    def fit_load(self, shape: TreeShape, batch_size: int) -> "TreeShape | NoDraft":
        """The shape to run for a batch of ``batch_size``: the policy's ``shape``, shrunk by the
        load model (:class:`LoadModel`: the shape with the most tokens per second by the served
        step's cost model) and capped so that the verify forward's rows (``batch_size * ndt``) fit
        ``verify_budget`` (the bank's largest shape that fits, the deepest of those, else the
        smallest: :func:`load_floor_shape`). With :attr:`undrafted`, either may run
        :data:`NO_DRAFT` instead: the load model when drafting nothing gives more tokens per second,
        the budget when not even the smallest tree fits."""
        if self.load is not None:
            choice = self.load.choose(shape, batch_size, self.shapes, undrafted=self.undrafted)
            if isinstance(choice, NoDraft):
                return choice
            shape = choice
        budget = self.verify_budget
        if budget is None or batch_size * shape.ndt <= budget:
            return shape
        fits = [s for s in self.shapes if batch_size * s.ndt <= budget and s.ndt <= shape.ndt]
        if fits:
            return max(fits, key=lambda s: (s.ndt, s.nsteps, -s.topk))
        if self.undrafted:
            return NO_DRAFT
        return min(self.shapes, key=lambda s: (s.ndt, s.nsteps * s.topk))

    def note_promoted(self, promoted_per_request: Sequence[int]) -> None:
        """Promoted (lossy-accepted) tokens per request of the newest step, from the verifier."""
        if self._pending:
            self._pending[-1].promoted = list(promoted_per_request)

    def note_sources(self, accepted_by_source: dict[str, int], width: int) -> None:
        """The newest step verified a merged tree of ``width`` rows per request (the draft stage's);
        its accepted drafted tokens per proposer."""
        if self._pending:
            self._pending[-1].by_source = dict(accepted_by_source)
            self._pending[-1].width = width

    def observe(self, num_correct_drafts_per_req: Sequence[int]) -> StepRecord | None:
        """Feed the oldest pending step's accepted drafted tokens (bonus excluded) to the policy.

        Returns its record; None when no step was pending (an idle batch) or the step belonged to
        a sequence that was reset since.
        """
        if not num_correct_drafts_per_req or not self._pending:
            return None
        p = self._pending.popleft()
        if p.epoch != self._epoch:
            return None
        self._observed_at = time.perf_counter()
        step_ms = (self._observed_at - p.started) * 1e3
        per_request = [int(a) for a in num_correct_drafts_per_req]
        if isinstance(p.shape, NoDraft):
            return self._observe_undrafted(p, per_request, step_ms)
        if self.load is not None:
            self.load.observe(p.shape, _reduce(per_request, "mean"), rows=p.width)
        accepted = int(_reduce(per_request, self.batch_reduce))
        promoted = int(_reduce(p.promoted, self.batch_reduce)) if p.promoted else 0
        record = StepRecord(
            step=p.step,
            shape=p.shape,
            tree_size=p.width or p.shape.ndt,  # a merged tree's rows (the draft stage), else the shape's
            accepted=accepted,
            promoted=promoted,
            new_tokens=accepted + 1,
            # host times, no device sync added: the draft and the verify together (from the shape's
            # choice to the accept lengths), and the rest of the previous step (its draft extension
            # and the scheduler, from its accept lengths to this step's start; 0 when the batch changed)
            draft_ms=0.0,
            verify_ms=step_ms,
            other_ms=p.gap_ms or 0.0,
            signals=p.signals,
            policy_state=p.policy_state,
        )
        self.policy.observe(record)
        self._last_accepted = accepted
        if self.metrics is not None:
            self.metrics.observe_step(shape=p.shape, accepted_per_request=per_request, policy_shape=p.requested,
                                      accepted_by_source=p.by_source, verify_width=p.width)
        return self._publish(record, p)

    def _publish(self, record: StepRecord, p: _PendingStep) -> StepRecord:
        """Hand a step's record to the observers, the trace and the state gauges."""
        self.last_record = record
        if self.on_record is not None:
            self.on_record(record)
        if self.on_trace is not None:
            self.on_trace(record, p.batch_size, p.gap_ms)
        if self.metrics is not None:
            self.metrics.observe_state(pending=len(self._pending), tracked=len(self._last_requests or ()))
        return record

    def _observe_undrafted(self, p: _PendingStep, per_request: list[int], step_ms: float) -> StepRecord:
        """A step the load controls ran without drafting: traced and counted, not the policy's
        (it chose a tree; its acceptance history is not a zero-accept step's)."""
        record = StepRecord(step=p.step, shape=None, tree_size=1, accepted=0, promoted=0, new_tokens=1, draft_ms=0.0,
                            verify_ms=step_ms, other_ms=p.gap_ms or 0.0, signals=p.signals,
                            policy_state={**p.policy_state, "undrafted": "load"})
        if self.metrics is not None:
            self.metrics.observe_undrafted("load", extend_skipped=p.policy_state.get("draft_extend") == "skipped",
                                           rows=len(per_request))
        return self._publish(record, p)


TREE_RULES = ("select_level", "select_final", "verify_shape", "observe_tree")
"""TreePolicy hooks that act inside a step (per draft level, per verified tree): SGLang's EAGLE worker
drafts a fixed beam per level and verifies its own top-``ndt`` nodes, so these have no place there."""


def step_level_notice(policy: TreePolicy) -> str | None:
    """One line saying which of the policy's in-step rules SGLang cannot run (None: none).

    Such a policy is served by its per-step shape choice alone (``next_shape``): each step drafts
    SGLang's EAGLE beam at that shape."""
    own = [r for r in TREE_RULES if getattr(type(policy), r, None) is not getattr(TreePolicy, r)]
    if not own:
        return None
    shapes = format_shapes(policy.shapes())
    return (f"policy {policy.name!r}: its in-step rules ({', '.join(own)}) have no hook in SGLang's EAGLE worker "
            f"(a fixed top-k beam per level, top-ndt nodes verified); served by its per-step shape choice among "
            f"{shapes}")


def build_strategies(config, host=None) -> tuple[TreePolicy, Verifier | None]:
    """The config's policy, and its verifier unless the verifier is lossless (``strict``: then
    SGLang's own verify accepts the same tokens -- greedy: the longest path of target argmaxes;
    sampled: SGLang's lossless tree sampling -- with no host round trip). ``config``:
    :class:`~adaptivespec.config.Config`; ``host``: the plugin host (default: this process's)."""
    host = host if host is not None else get_plugin_host()
    policy = host.policies.get(config.policy.name).cls(config.policy.params)
    verifier_cls = host.verifiers.get(config.verifier.name).cls
    if verifier_cls.lossless:
        return policy, None
    return policy, verifier_cls(config.verifier.params)


def verify_budget_from_env() -> int | None:
    """``ADAPTIVESPEC_SGLANG_VERIFY_BUDGET`` (``serve --verify-budget``): verified rows per step
    (batch size x ndt) past which the controller shrinks the tree; unset or 0: no cap."""
    text = os.environ.get(VERIFY_BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise AdaptiveSpecError(f"{VERIFY_BUDGET_ENV}: expected an integer, got {text!r}") from None
    return value or None
