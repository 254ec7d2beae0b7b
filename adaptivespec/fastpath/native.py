"""The int8 target's C++ kernels (``csrc/int8_ops.cpp``), compiled at first use and cached.

Kernels whose every output is computed by the same code in the same order from its own row: per-row
activation quantization, the matmul's per-row scaling, RMSNorm, an AVX512-VNNI int8 matmul for few
rows, and attention over a row's visible keys in ascending order (an online softmax, one pass). They make the int8 target's forward
independent of the layout it runs in (one row, a tree, a prefill chunk, a batch), so strict
speculation reproduces its greedy decoding token for token. Built with torch's C++ extension
loader (a C++ compiler and ninja; ``-march=native``, cached under ``<cache>/native/<cpu>``, ~20 s
once); where it cannot be built the int8 target runs torch's ops instead (say so once) and its
attention rounds by layout (docs/int8.md). ``$ADAPTIVESPEC_NO_NATIVE=1`` skips it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

DISABLE_ENV = "ADAPTIVESPEC_NO_NATIVE"
SOURCE = Path(__file__).parent / "csrc" / "int8_ops.cpp"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]
"""``-ffp-contract=off``: a multiply and an add stay two roundings, as in torch's ops (the fallback)."""

log = logging.getLogger("adaptivespec.native")
_STATE: dict[str, object] = {}


def ops():
    """The compiled module (``quantize_rows``, ``scale_rows``, ``rms_norm``, ``pack_weight``, ``has_vnni``,
    ``int8_linear``, ``attend``), or None (see :func:`why_not`)."""
    if "ops" not in _STATE:
        _STATE["ops"], _STATE["why"] = _build()
        if _STATE["ops"] is None:
            log.warning("adaptivespec: int8 kernels not built (%s): torch's ops instead; attention rounds by layout",
                        _STATE["why"])
    return _STATE["ops"]


def why_not() -> str | None:
    ops()
    return _STATE["why"]


def _build():
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return None, f"${DISABLE_ENV}=1"
    try:
        import torch.utils.cpp_extension as ext

        from adaptivespec.costmodel import cpu_name
        from adaptivespec.paths import cache_dir

        cpu = re.sub(r"[^A-Za-z0-9]+", "_", cpu_name()).strip("_")[:48] or "cpu"
        where = cache_dir() / "native" / cpu
        where.mkdir(parents=True, exist_ok=True)
        module = ext.load(name="adaptivespec_int8_ops", sources=[str(SOURCE)], extra_cflags=FLAGS,
                          build_directory=str(where), verbose=False)
        return module, None
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch path runs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{type(exc).__name__}: {first[:200]}"
