"""adaptivespec's AVX-512 mode for SGLang's CPU backend, inside SGLang's own processes.

``adaptivespec serve`` (and the bench's and the soak's SGLang servers) put this folder first on
``PYTHONPATH`` of the SGLang processes it starts on an x86 CPU with AVX-512 bf16 and no AMX, with
``ADAPTIVESPEC_SGLANG_CPU_MODE=avx512`` (:func:`adaptivespec.sglang.platform.cpu_env`). Python runs
this ``sitecustomize`` at start-up; it changes exactly one thing: once ``sglang.srt.utils.common``
has executed, its ``is_amx_tile_supported`` (``torch.cpu._is_amx_tile_supported()`` read at import)
is set True, so ``cpu_has_amx_support()`` lets SGLang pick its Intel AMX attention backend and its
packed CPU kernels (whose GEMMs run oneDNN's AVX-512 bf16 code on such a CPU) instead of
``torch_native``, which refuses EAGLE. Nothing else of torch or SGLang is touched, and nothing at all
without the variable. A ``sitecustomize`` further down ``sys.path`` still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODULE = "sglang.srt.utils.common"
FLAG = "is_amx_tile_supported"


class _PatchAfterExec(importlib.abc.MetaPathFinder):
    """Finds :data:`MODULE` through the other finders and sets :data:`FLAG` after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            setattr(module, FLAG, True)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]

        spec.loader.exec_module = exec_and_patch
        return spec


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (a venv's or the system's), as if this one were not here."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_adaptivespec_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("ADAPTIVESPEC_SGLANG_CPU_MODE") == "avx512":
    sys.meta_path.insert(0, _PatchAfterExec())
_chain()
