"""The speculation metrics both engines export on ``/metrics``: what the policy, its shapes and the
load controls do, in Prometheus text. SGLang's worker writes them beside SGLang's own series
(:mod:`adaptivespec.sglang.metrics`); the torch server feeds them from the engine's step records
(:mod:`adaptivespec.server.metrics`). Neither engine is imported here, nor ``prometheus_client``
until a :class:`SpecMetrics` is made.

Series (all named ``adaptivespec_*``; ``shape`` labels read ``nsteps,topk,ndt``):

===========================================================  =========  =================================
name                                                         type       what
===========================================================  =========  =================================
``adaptivespec_accepted_tokens_per_step``                    histogram  drafted tokens one request had
                                                                        accepted in one step (bonus not
                                                                        counted)
``adaptivespec_steps_total{shape}``                          counter    decode steps run at each shape
``adaptivespec_accepted_tokens_total{source}``               counter    accepted drafted tokens by who
                                                                        proposed them (``head`` today;
                                                                        candidate sources once served)
``adaptivespec_undrafted_steps_total{reason}``               counter    steps run without drafting, by
                                                                        why (``load``, ``policy``)
``adaptivespec_draft_extend_skipped_steps_total``            counter    undrafted steps after which the
                                                                        head's draft-extend was skipped
                                                                        (the load model settled on not
                                                                        drafting)
``adaptivespec_prefill_draft_extend_skipped_batches_total``  counter    prefill batches admitted while
                                                                        settled whose head's draft-extend
                                                                        over the prompt was skipped
``adaptivespec_verify_rows_per_step``                        histogram  rows the target verified in one
                                                                        forward (batch size x ndt; a
                                                                        batch's: its decoders' trees and
                                                                        plain rows, once per forward)
``adaptivespec_load_choice_draft_tokens{batch_size}``        gauge      ndt the load controller last ran
                                                                        at that batch size
``adaptivespec_load_capped_steps_total{batch_size}``         counter    steps the load controller ran
                                                                        smaller than the policy's shape
``adaptivespec_controller_pending_steps``                    gauge      steps drafted whose accept
                                                                        lengths have not come back
``adaptivespec_controller_tracked_requests``                 gauge      request ids the controller holds
                                                                        (the last batch's)
===========================================================  =========  =================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adaptivespec.types import TreeShape

PREFIX = "adaptivespec"
SOURCES = ("head",)
"""Proposers whose accepted tokens are counted (extended as candidate sources are served)."""
UNDRAFTED_REASONS = ("load", "policy")
ACCEPT_BUCKETS = tuple(float(b) for b in range(0, 17))
ROW_BUCKETS = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0)


def shape_label(shape: TreeShape) -> str:
    return f"{shape.nsteps},{shape.topk},{shape.ndt}"


class SpecMetrics:
    """The speculation series (see the module docstring), all in one registry.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (the torch server's own; tests read it
    back); None: the default registry, which SGLang's multiprocess collector exports (see
    :class:`adaptivespec.sglang.metrics.SpecMetrics`, which adds how SGLang's worker turns them on)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        p = PREFIX
        self.accepted_per_step = Histogram(f"{p}_accepted_tokens_per_step",
                                           "Drafted tokens one request had accepted in one decode step (bonus not counted)",
                                           buckets=ACCEPT_BUCKETS, registry=reg)
        self.steps = Counter(f"{p}_steps", "Decode steps run at each tree shape (nsteps,topk,ndt)", ["shape"], registry=reg)
        self.accepted = Counter(f"{p}_accepted_tokens", "Accepted drafted tokens by the proposer that drafted them",
                                ["source"], registry=reg)
        self.undrafted = Counter(f"{p}_undrafted_steps", "Decode steps run without drafting, by why", ["reason"], registry=reg)
        self.extend_skipped = Counter(f"{p}_draft_extend_skipped_steps",
                                      "Undrafted steps after which the head's draft-extend was skipped", registry=reg)
        self.prefill_extend_skipped = Counter(f"{p}_prefill_draft_extend_skipped_batches",
                                              "Prefill batches admitted while settled whose head's draft-extend "
                                              "over the prompt was skipped", registry=reg)
        self.verify_rows = Histogram(f"{p}_verify_rows_per_step", "Rows the target verified in one step (batch size x ndt)",
                                     buckets=ROW_BUCKETS, registry=reg)
        self.load_choice = Gauge(f"{p}_load_choice_draft_tokens", "Draft tokens (ndt) the load controller last ran at a batch size",
                                 ["batch_size"], registry=reg, multiprocess_mode="mostrecent")
        self.load_capped = Counter(f"{p}_load_capped_steps", "Steps the load controller ran smaller than the policy's shape",
                                   ["batch_size"], registry=reg)
        self.pending = Gauge(f"{p}_controller_pending_steps", "Drafted steps whose accept lengths have not come back",
                             registry=reg, multiprocess_mode="mostrecent")
        self.tracked = Gauge(f"{p}_controller_tracked_requests", "Request ids the shape controller holds",
                             registry=reg, multiprocess_mode="mostrecent")
        for source in SOURCES:  # every series is exported from the start, at zero
            self.accepted.labels(source=source)
        for reason in UNDRAFTED_REASONS:
            self.undrafted.labels(reason=reason)

    def observe_step(self, *, shape: TreeShape, accepted_per_request: Sequence[int], policy_shape: TreeShape | None = None,
                     accepted_by_source: Mapping[str, int] | None = None, verify_width: int | None = None) -> None:
        """One verified step of ``len(accepted_per_request)`` requests run at ``shape`` (the policy
        asked for ``policy_shape``; the load controller ran ``shape``); ``verify_width``: rows per
        request when the draft stage merged candidates in (default ``shape.ndt``), and
        ``accepted_by_source`` the accepted tokens per proposer then (default: all the head's)."""
        bs = len(accepted_per_request)
        if bs == 0:
            return
        for a in accepted_per_request:
            self.accepted_per_step.observe(a)
        self.steps.labels(shape=shape_label(shape)).inc()
        self.observe_rows(bs * (verify_width or shape.ndt))
        by_source = accepted_by_source if accepted_by_source is not None else {"head": sum(accepted_per_request)}
        self._accepted(by_source)
        self.load_choice.labels(batch_size=str(bs)).set(shape.ndt)
        if policy_shape is not None and policy_shape != shape:
            self.load_capped.labels(batch_size=str(bs)).inc()

    def observe_request_step(self, *, shape: TreeShape, accepted: int, accepted_by_source: Mapping[str, int]) -> None:
        """One request's drafted step inside a packed forward of many (the forward's rows go to
        :meth:`observe_rows` once): its accepted tokens, its shape, who proposed what."""
        self.accepted_per_step.observe(accepted)
        self.steps.labels(shape=shape_label(shape)).inc()
        self._accepted(accepted_by_source)

    def observe_rows(self, rows: int) -> None:
        """One target forward verified ``rows`` rows (its decoding requests' trees and plain rows)."""
        self.verify_rows.observe(rows)

    def _accepted(self, by_source: Mapping[str, int]) -> None:
        for source, n in by_source.items():
            if n:
                self.accepted.labels(source=source).inc(n)

    def declare_sources(self, names: Sequence[str]) -> None:
        """Export ``accepted_tokens_total`` for these proposers from the start, at zero."""
        for name in names:
            self.accepted.labels(source=name)

    def observe_undrafted(self, reason: str, extend_skipped: bool = False, rows: int | None = None) -> None:
        """A step that ran without drafting (``reason``: one of :data:`UNDRAFTED_REASONS`;
        ``extend_skipped``: the head's draft-extend after it was skipped; ``rows``: the rows it
        verified, one per request, counted in the verify-rows histogram like a drafted step's)."""
        if reason not in UNDRAFTED_REASONS:
            raise ValueError(f"undrafted reason: expected one of {', '.join(UNDRAFTED_REASONS)}, got {reason!r}")
        self.undrafted.labels(reason=reason).inc()
        if extend_skipped:
            self.extend_skipped.inc()
        if rows is not None:
            self.verify_rows.observe(rows)

    def observe_prefill_extend_skipped(self) -> None:
        """A prefill batch admitted while settled skipped the head's draft-extend over its prompts."""
        self.prefill_extend_skipped.inc()

    def observe_state(self, *, pending: int, tracked: int) -> None:
        """The controller's per-request state sizes (bounded by the batch: tested by the soak)."""
        self.pending.set(pending)
        self.tracked.set(tracked)


def parse_metrics(text: str, prefix: str = PREFIX) -> dict[str, float]:
    """``{series with labels: value}`` of the Prometheus text lines starting with ``prefix``
    (``adaptivespec_steps_total{shape="3,4,8"}`` -> its value); comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
