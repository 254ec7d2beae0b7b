"""Speculation metrics on SGLang's ``/metrics``: the series of :mod:`adaptivespec.metrics` (their
home, shared with the torch server), written from SGLang's worker next to SGLang's own series.

SGLang runs ``prometheus_client`` in multiprocess mode when metrics are on (``--enable-metrics``,
which ``adaptivespec serve`` passes unless ``--no-metrics``): every process writes its series to the
folder ``PROMETHEUS_MULTIPROC_DIR`` names and the HTTP server's ``/metrics`` collects them all. The
worker's :class:`SpecMetrics` writes there from the scheduler process, so its series appear beside
SGLang's without a server of their own. Without that folder (metrics off) :meth:`SpecMetrics.from_env`
returns None and the worker records nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from adaptivespec import metrics
from adaptivespec.metrics import (ACCEPT_BUCKETS, PREFIX, ROW_BUCKETS, SOURCES, UNDRAFTED_REASONS,
                                  parse_metrics, shape_label)
from adaptivespec.sglang import METRICS_ENV


class SpecMetrics(metrics.SpecMetrics):
    """The worker's series (:class:`adaptivespec.metrics.SpecMetrics`), one per scheduler process,
    made from SGLang's environment by :meth:`from_env`."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SpecMetrics | None":
        """The worker's metrics when SGLang exports them (``PROMETHEUS_MULTIPROC_DIR`` set) and
        ``ADAPTIVESPEC_SGLANG_METRICS`` is not ``0``; else None."""
        env = os.environ if environ is None else environ
        if not env.get("PROMETHEUS_MULTIPROC_DIR") or env.get(METRICS_ENV, "1").strip() == "0":
            return None
        return cls()


__all__ = ["ACCEPT_BUCKETS", "PREFIX", "ROW_BUCKETS", "SOURCES", "UNDRAFTED_REASONS", "SpecMetrics", "parse_metrics",
           "shape_label"]
