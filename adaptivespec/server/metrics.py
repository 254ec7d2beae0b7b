"""The torch server's ``/metrics``: the ``adaptivespec_*`` speculation series SGLang's worker
exports too (:class:`adaptivespec.metrics.SpecMetrics`, the same names and definitions, fed from the
engine's step records) and the server's own ``adaptivespec_server_*`` series.

Of the shared series, those of SGLang's load controller (``load_choice_draft_tokens``,
``load_capped_steps_total``, ``controller_*``) are not fed here: the batch engine's own row budget
has its series below (``load_choice_draft_tokens{batch_size="1"}`` shows the last step's ndt, the
others stay at zero). Server series:

=================================================  =========  =============================================
name                                               type       what
=================================================  =========  =============================================
``adaptivespec_server_queue_seconds``              histogram  time a request waited in the FIFO queue (to its
                                                              hand-over to the engine)
``adaptivespec_server_queue_depth``                gauge      requests waiting for a slot (running ones not
                                                              counted)
``adaptivespec_server_requests_total{outcome}``    counter    requests by outcome: ``completed``,
                                                              ``cancelled`` (client gone), ``rejected``
                                                              (queue full: 503), ``bad`` (4xx), ``failed``
``adaptivespec_server_generation_seconds``         histogram  wall time of a generation (prefill included)
``adaptivespec_server_first_token_seconds``        histogram  generation start to the first token
``adaptivespec_server_prompt_tokens_total``        counter    prompt tokens of the requests handed to the engine
``adaptivespec_server_cached_tokens_total``        counter    of those, taken from the prefix cache, not read
                                                              (``batch.prefix_cache_mb``; ``--parallel`` > 1)
``adaptivespec_server_generated_tokens_total``     counter    tokens generated
``adaptivespec_server_trim_seconds``               histogram  time handing the heap's free pages back after a
                                                              generation (``malloc_trim``; not with ``--no-trim``)
``adaptivespec_server_batch_size``                 gauge      requests in the last step (``--parallel``)
``adaptivespec_server_batch_requests``             histogram  requests per step
``adaptivespec_server_step_rows``                  histogram  rows per packed target forward (prompt chunks,
                                                              roots and verified draft rows)
``adaptivespec_server_budget_rows``                histogram  draft rows the row budget chose per step
                                                              (``batch.row_budget: goodput``)
``adaptivespec_server_request_accept_length``      histogram  per finished request: tokens per target forward
``adaptivespec_server_info{runtime,dtype,...}``    gauge      1, labelled with what runs: ``runtime``,
                                                              ``dtype`` (``runtime.dtype: auto`` resolved),
                                                              ``precision`` (``int8-float32`` ...), ``isa``
                                                              (:func:`adaptivespec.hardware.isa`), ``target``
=================================================  =========  =============================================
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from adaptivespec.metrics import PREFIX, UNDRAFTED_REASONS, SpecMetrics
from adaptivespec.types import StepRecord

OUTCOMES = ("completed", "cancelled", "rejected", "bad", "failed")
ROW_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The registry behind ``/metrics`` (one per server; tests make their own)."""

    def __init__(self, sources: tuple[str, ...] = ()) -> None:
        self.registry = reg = CollectorRegistry()
        self.spec = SpecMetrics(reg)
        self.spec.declare_sources(sources)
        p = f"{PREFIX}_server"
        self.queue_seconds = Histogram(f"{p}_queue_seconds", "Time a request waited in the FIFO queue",
                                       buckets=SECONDS_BUCKETS, registry=reg)
        self.queue_depth = Gauge(f"{p}_queue_depth", "Requests waiting for a slot (running ones not counted)",
                                 registry=reg)
        self.requests = Counter(f"{p}_requests", "Requests by outcome", ["outcome"], registry=reg)
        self.generation_seconds = Histogram(f"{p}_generation_seconds", "Wall time of a generation (prefill included)",
                                            buckets=SECONDS_BUCKETS, registry=reg)
        self.first_token_seconds = Histogram(f"{p}_first_token_seconds", "Generation start to the first token",
                                             buckets=SECONDS_BUCKETS, registry=reg)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of the requests handed to the engine",
                                     registry=reg)
        self.cached_tokens = Counter(f"{p}_cached_tokens", "Prompt tokens taken from the prefix cache, not read",
                                     registry=reg)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Tokens generated", registry=reg)
        self.trim_seconds = Histogram(f"{p}_trim_seconds", "Time handing the C heap's free pages back after a generation",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=reg)
        self.batch_size = Gauge(f"{p}_batch_size", "Requests in the last step", registry=reg)
        self.batch_requests = Histogram(f"{p}_batch_requests", "Requests per step", buckets=ROW_COUNTS[:9], registry=reg)
        self.step_rows = Histogram(f"{p}_step_rows", "Rows per packed target forward", buckets=ROW_COUNTS, registry=reg)
        self.budget_rows = Histogram(f"{p}_budget_rows", "Draft rows the row budget chose per step", buckets=ROW_COUNTS,
                                     registry=reg)
        self.request_accept_length = Histogram(f"{p}_request_accept_length", "Tokens per target forward, per request",
                                               buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0),
                                               registry=reg)
        self.info = Gauge(f"{p}_info", "What runs: runtime, dtype, precision, CPU level, target (value 1)",
                          ["runtime", "dtype", "precision", "isa", "target"], registry=reg)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)

    def describe(self, config) -> None:
        """Label ``adaptivespec_server_info`` with what ``config`` runs on this machine (its dtype resolved)."""
        from adaptivespec import hardware

        rt = config.runtime
        self.info.labels(runtime=rt.name, dtype=rt.dtype, precision=rt.precision, isa=hardware.isa(),
                         target=str(config.model.target)).set(1)

    def observe_step(self, record: StepRecord) -> None:
        """One step of the one-request engine (a step is a target forward; called from the worker thread)."""
        if record.undrafted == "autoregressive":  # a config that never drafts: no speculation series
            return
        if record.undrafted is not None or record.tree_size <= 1 or record.shape is None:
            # nothing drafted: the policy's (or the sources') choice, or the load's
            self.spec.observe_undrafted(record.undrafted or "policy", rows=1)
            return
        self.spec.observe_step(shape=record.shape, accepted_per_request=[record.accepted],
                               accepted_by_source=record.accepted_by_source, verify_width=record.tree_size)

    def observe_batch(self, *, requests: int, rows: int, budget_rows: int | None, records: Sequence[StepRecord] = (),
                      undrafted: str | None = None, verify_rows: int = 0) -> None:
        """One step of the batch engine, one packed forward: its requests, its rows, the row budget's
        choice (None: no budget), and by SGLang's definitions per forward: the decoders' step
        ``records`` (accepted tokens, shapes), the rows they verified (``verify_rows``, once), and
        ``undrafted`` when the whole step drafted nothing (``"load"``: the row budget's choice)."""
        self.batch_size.set(requests)
        self.batch_requests.observe(requests)
        self.step_rows.observe(rows)
        if budget_rows is not None:
            self.budget_rows.observe(budget_rows)
        for rec in records:
            if rec.undrafted is None and rec.tree_size > 1 and rec.shape is not None:
                self.spec.observe_request_step(shape=rec.shape, accepted=rec.accepted,
                                               accepted_by_source=rec.accepted_by_source)
            elif rec.undrafted is None:  # the policy drafted nothing for this request
                self.spec.observe_undrafted("policy")
        if undrafted in UNDRAFTED_REASONS:
            self.spec.observe_undrafted(undrafted, rows=verify_rows or None)
        elif verify_rows and any(rec.undrafted != "autoregressive" for rec in records):
            self.spec.observe_rows(verify_rows)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
