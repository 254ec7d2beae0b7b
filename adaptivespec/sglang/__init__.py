"""Serving adaptivespec strategies inside SGLang's EAGLE-3 worker.

Importing this package never imports sglang: only :mod:`adaptivespec.sglang.plugin` does, and only
inside the functions SGLang's plugin loader calls in its own processes.

* :mod:`~adaptivespec.sglang.api` -- the pinned SGLang release and every name the plugin touches,
  checked statically (``ast`` over the sources) or at load time (``inspect``).
* :mod:`~adaptivespec.sglang.policy_bridge` -- pure-torch glue, testable on CPU: the per-step
  triplet controller, the bank of per-shape runtime states, the verifier wrapper.
* :mod:`~adaptivespec.sglang.plugin` -- the ``sglang.srt.plugins`` entry point.
* :mod:`~adaptivespec.sglang.serve` -- ``adaptivespec serve``: the ``sglang.launch_server`` command.
"""

from __future__ import annotations

from adaptivespec.sglang.api import SGLANG_VERSION

CONFIG_ENV = "ADAPTIVESPEC_CONFIG"
"""Environment variable naming the adaptivespec YAML the SGLang plugin reads in the server."""

PLUGIN_NAME = "adaptivespec"
"""Entry-point name under SGLang's ``sglang.srt.plugins`` group (what ``SGLANG_PLUGINS`` lists)."""

__all__ = ["CONFIG_ENV", "PLUGIN_NAME", "SGLANG_VERSION"]
