"""Performance regression suite (pytest-benchmark); skipped by the default run (``--benchmark-skip``).

Run, save a baseline, compare against it::

    python -m pytest tests/benchmarks --benchmark-only
    python -m pytest tests/benchmarks --benchmark-only --benchmark-save=baseline
    python -m pytest tests/benchmarks --benchmark-only --benchmark-compare --benchmark-compare-fail=mean:10%

Saved runs live in ``.benchmarks/`` (per machine and Python); ``--benchmark-compare`` alone picks
the latest, ``--benchmark-compare=0001`` a given one. ``--benchmark-group-by=group`` (the default)
tabulates policy, verifier, tree, cache and e2e separately.
"""

from __future__ import annotations

import os

import pytest
import torch

THREADS_ENV = "ADAPTIVESPEC_BENCH_THREADS"


@pytest.fixture(autouse=True)
def bench_threads():
    """torch intra-op threads for every benchmark: ``$ADAPTIVESPEC_BENCH_THREADS``, default 1.

    One thread makes batch-1 timings reproducible: on a loaded machine a multi-threaded 32x32
    matmul can wait ~25 ms for a descheduled worker. ``0`` keeps torch's default.
    """
    threads = int(os.environ.get(THREADS_ENV, "1"))
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    yield
    torch.set_num_threads(before)
