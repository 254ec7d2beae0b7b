"""Serving adaptivespec strategies inside SGLang's EAGLE-3 worker.

Importing this package never imports sglang: only :mod:`adaptivespec.sglang.plugin` and
:mod:`adaptivespec.sglang.workers` do, and only inside the functions SGLang's plugin loader calls
in its own processes. One concept per module:

* :mod:`~adaptivespec.sglang.api` -- the pinned SGLang release and every name the plugin touches,
  checked statically (``ast`` over the sources) or at load time (``inspect``) by
  :mod:`~adaptivespec.sglang.api_check`;
  :mod:`~adaptivespec.sglang.head_config` -- which draft-head config keys SGLang reads.
* :mod:`~adaptivespec.sglang.shapes` -- tree shapes as SGLang's worker runs them.
* :mod:`~adaptivespec.sglang.load_model` -- the shape that gives a batch the most tokens/s.
* :mod:`~adaptivespec.sglang.controller` -- the per-step shape controller around one tree policy.
* :mod:`~adaptivespec.sglang.state_bank` -- one pre-built runtime state per shape.
* :mod:`~adaptivespec.sglang.verification` -- an adaptivespec verifier on SGLang's verify inputs.
* :mod:`~adaptivespec.sglang.trace` and :mod:`~adaptivespec.sglang.metrics` -- what the worker
  records: a per-step trace file, Prometheus series on ``/metrics``.
* :mod:`~adaptivespec.sglang.workers` and :mod:`~adaptivespec.sglang.draft_worker` -- the EAGLE
  worker subclasses (built when SGLang imports).
* :mod:`~adaptivespec.sglang.plugin` -- the ``sglang.srt.plugins`` entry point and its hooks.
* :mod:`~adaptivespec.sglang.platform` -- devices, the CPU backend's flags and mode (AMX, or the
  AVX-512 mode whose ``cpu_shim/sitecustomize.py`` runs inside SGLang's processes), the preflight check.
* :mod:`~adaptivespec.sglang.serve` -- ``adaptivespec serve``'s SGLang side: its flags, the
  ``sglang.launch_server`` command (the front door, :mod:`adaptivespec.serve`, chooses the runtime).
* :mod:`~adaptivespec.sglang.server` -- servers on loopback for tests, the bench and the soak.

The environment variables below are how ``serve`` talks to the plugin inside SGLang's processes.
"""

from __future__ import annotations

from adaptivespec.sglang.api import SGLANG_VERSION

CONFIG_ENV = "ADAPTIVESPEC_CONFIG"
"""Environment variable naming the adaptivespec YAML the SGLang plugin reads in the server."""

PLUGIN_NAME = "adaptivespec"
"""Entry-point name under SGLang's ``sglang.srt.plugins`` group (what ``SGLANG_PLUGINS`` lists)."""

TRACE_ENV = "ADAPTIVESPEC_SGLANG_TRACE"
"""Environment variable naming a JSON-lines file the plugin appends one record per decode step to
(``serve --trace``): the step's shape, batch size and accepted drafted tokens."""

VERIFY_BUDGET_ENV = "ADAPTIVESPEC_SGLANG_VERIFY_BUDGET"
"""Environment variable of ``serve --verify-budget``: the load-aware cap on verified rows per step."""

LOAD_PROFILE_ENV = "ADAPTIVESPEC_SGLANG_LOAD_PROFILE"
"""Environment variable of ``serve --load-profile``: the served step's cost profile (load-aware trees)."""

METRICS_ENV = "ADAPTIVESPEC_SGLANG_METRICS"
"""``0`` turns the worker's ``adaptivespec_*`` series off (``serve --no-metrics`` sets it)."""

__all__ = ["CONFIG_ENV", "LOAD_PROFILE_ENV", "METRICS_ENV", "PLUGIN_NAME", "SGLANG_VERSION", "TRACE_ENV",
           "VERIFY_BUDGET_ENV"]
