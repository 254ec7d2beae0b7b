"""What this machine's CPU can do, in one place: every kernel, prepack and dtype choice asks here
(no torch import: the SGLang wing's platform checks and ``adaptivespec doctor``-style reports read it too).

A CPU's instruction sets form a ladder as this project uses them (:data:`LEVELS`):

================  ==========================================================  ==========================
level             what it has (``/proc/cpuinfo`` flags)                        what runs here
================  ==========================================================  ==========================
``amx``           AMX tiles for bf16 (``amx_bf16``) and int8 (``amx_int8``)   bf16, oneDNN AMX kernels
``avx512_bf16``   AVX-512 F/BW/VL/DQ + ``avx512_bf16`` (+ VNNI)               bf16, our AVX512-BF16 kernels
``avx512``        AVX-512 F/BW/VL/DQ (+ ``avx512_vnni``), no bf16 dot product  float32; int8 with VNNI
``avx2``          AVX2 + FMA (most desktops and laptops; ``avx_vnni`` maybe)  float32 (torch's bf16 has
                                                                               no fast path: ~40-500x)
``aarch64``       Arm: NEON, maybe SVE and bf16 (``bf16`` / ``svebf16``)       bf16 with the BF16 extension
``baseline``      anything else (an x86-64 CPU without AVX2)                  float32, torch's own ops
================  ==========================================================  ==========================

``$ADAPTIVESPEC_CPU_ISA`` caps what the project believes the CPU has (one of :data:`LEVELS`, e.g.
``avx2``): on an AVX-512 or AMX machine it runs the paths an AVX2 CPU would (dtype, kernels, tests'
skips). The name is a contract checks outside the repository use. torch's and oneDNN's own dispatch
read their own settings, to be set beside it: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`` (:func:`capped_env` gives them all).
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

ISA_ENV = "ADAPTIVESPEC_CPU_ISA"
LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
"""x86-64 levels, lowest first (``aarch64`` stands apart: :func:`isa`)."""
AVX512_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
"""What oneDNN's bf16 reorder and every AVX-512 kernel of ours need beside the level's own flag."""


def _level_of(flag: str) -> str | None:
    """The level that brings ``flag`` (None: below AVX2, or not an instruction-set flag we rank)."""
    if flag.startswith("amx"):
        return "amx"
    if flag == "avx512_bf16":
        return "avx512_bf16"
    if flag.startswith("avx512"):
        return "avx512"
    if flag in ("avx2", "fma", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"):
        return "avx2"
    return None


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them (x86 ``flags``, Arm ``Features``; empty
    when it cannot be read). Not capped: :func:`features` applies ``$ADAPTIVESPEC_CPU_ISA``."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except (OSError, IndexError):
        pass
    return frozenset()


class IsaCapError(ValueError):
    """``$ADAPTIVESPEC_CPU_ISA`` names no level (the CLI prints it as one line, exit 2)."""


def isa_cap(env: dict | None = None) -> str | None:
    """``$ADAPTIVESPEC_CPU_ISA`` when set (lower-cased), else None. A value outside :data:`LEVELS`
    raises ValueError naming it (the CLI turns that into one line and exit 2)."""
    value = (os.environ if env is None else env).get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise IsaCapError(f"${ISA_ENV}: expected one of {', '.join(LEVELS)}, got {value!r}")
    return value


def cap(flags: frozenset[str], level: str | None) -> frozenset[str]:
    """``flags`` without those a level above ``level`` brings (None: unchanged). ``avx_ne_convert``
    (oneDNN's bf16 reorder on AVX2-class chips) goes with any cap below ``avx512_bf16``."""
    if level is None:
        return flags
    top = LEVELS.index(level)
    keep = set()
    for f in flags:
        lv = _level_of(f)
        if f == "avx_ne_convert" and top < LEVELS.index("avx512_bf16"):
            continue
        if lv is None or LEVELS.index(lv) <= top:
            keep.add(f)
    return frozenset(keep)


@lru_cache(maxsize=8)
def _features(cpuinfo: str, level: str | None) -> frozenset[str]:
    return cap(cpu_flags(cpuinfo), level)


def features(flags: frozenset[str] | None = None) -> frozenset[str]:
    """The flags the project believes the CPU has: ``flags`` (default :func:`cpu_flags`) capped by
    ``$ADAPTIVESPEC_CPU_ISA``."""
    level = isa_cap()
    if flags is None:
        return _features("/proc/cpuinfo", level)
    return cap(flags, level)


def isa(flags: frozenset[str] | None = None) -> str:
    """This CPU's level: one of :data:`LEVELS`, or ``aarch64``."""
    f = features(flags)
    if flags is None and platform.machine().lower() in ("aarch64", "arm64"):
        return "aarch64"
    if {"amx_bf16", "amx_tile"} <= f and AVX512_BASE <= f:
        return "amx"
    if AVX512_BASE <= f and "avx512_bf16" in f:
        return "avx512_bf16"
    if AVX512_BASE <= f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return "baseline"


def has(feature: str, flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has ``feature`` as the project uses it:

    - ``bf16_kernels``: our AVX512-BF16 kernels and oneDNN's bf16 prepack (AVX-512 F/BW/VL/DQ + bf16);
    - ``onednn_bf16``: oneDNN's bf16 weight reorder at all (AVX-512 BW/VL/DQ, or ``avx_ne_convert``);
    - ``vnni``: AVX512-VNNI (our int8 kernel, oneDNN's exact u8s8 sums);
    - ``amx``: AMX bf16 tiles;
    - ``avx2``: AVX2 + FMA;
    - any other name: that raw flag (capped)."""
    f = features(flags)
    if feature == "bf16_kernels":
        return AVX512_BASE <= f and "avx512_bf16" in f
    if feature == "onednn_bf16":
        return AVX512_BASE <= f or "avx_ne_convert" in f
    if feature == "vnni":
        return AVX512_BASE <= f and "avx512_vnni" in f
    if feature == "amx":
        return {"amx_bf16", "amx_tile"} <= f
    if feature == "avx2":
        return {"avx2", "fma"} <= f
    return feature in f


def missing(feature: str, flags: frozenset[str] | None = None) -> str | None:
    """None where :func:`has` ``feature``; else one line for a skip or a log: "needs AVX512-BF16: this
    CPU has avx2"."""
    if has(feature, flags):
        return None
    names = {"bf16_kernels": "AVX512-BF16", "onednn_bf16": "AVX-512 (BW/VL/DQ) for oneDNN's bf16",
             "vnni": "AVX512-VNNI", "amx": "AMX", "avx2": "AVX2"}
    capped = f" (capped by ${ISA_ENV})" if isa_cap() else ""
    return f"needs {names.get(feature, feature)}: this CPU has {isa(flags)}{capped}"


def cpu_kind(flags: frozenset[str] | None = None) -> str | None:
    """What a verified row costs on this CPU, in one word: ``amx`` (AMX tiles, ``amx_bf16``: bf16
    rows nearly free up to ~32 on a 2-vCPU Xeon), ``avx512`` (AVX-512 bf16 without AMX: ~0.7 ms a
    bf16 row beyond 8 on a 2-vCPU EPYC), ``avx2`` (an x86 CPU with AVX2 + FMA and no fast bf16, so
    ``dtype: auto`` runs float32: with our float32 matmul 2-6 rows cost 1.04-1.24x one row, 16 rows 1.9x, on a
    2-vCPU EPYC under the AVX2 cap),
    else None (Arm, or an x86 CPU older than AVX2). ``flags``: default :func:`cpu_flags` (capped by
    ``$ADAPTIVESPEC_CPU_ISA`` either way)."""
    f = features(flags)
    if "amx_bf16" in f:
        return "amx"
    if {"avx512f", "avx512_bf16"} <= f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return None


def fast_bf16(device: str = "cpu") -> bool:
    """Whether bfloat16 is the faster dtype on ``device``: a GPU; an x86 CPU with AMX or AVX512-BF16;
    an Arm CPU with the BF16 extension."""
    kind = str(device).split(":")[0]
    if kind != "cpu":
        return True
    level = isa()
    if level in ("amx", "avx512_bf16"):
        return True
    if level == "aarch64":  # Armv8.6 BF16 (``bf16`` / ``svebf16`` in Features): bf16 dot products
        return bool({"bf16", "svebf16"} & features())
    return False


def auto_dtype(device: str = "cpu") -> str:
    """``runtime.dtype: auto``: ``bfloat16`` where :func:`fast_bf16`, else ``float32``."""
    return "bfloat16" if fast_bf16(device) else "float32"


def slow_dtype_warning(dtype: str, device: str = "cpu") -> str | None:
    """One line when an explicit ``dtype`` is the slow choice on this machine, else None."""
    if dtype != "bfloat16" or fast_bf16(device):
        return None
    return (f"adaptivespec: runtime.dtype bfloat16 on a CPU without fast bf16 ({describe()}): torch's bf16 has "
            f"no fast path here (~40x slower); runtime.dtype: auto (or float32) is faster")


def describe(flags: frozenset[str] | None = None) -> str:
    """``"AMD EPYC, avx2"``: the CPU's name and level, for summaries, logs and skip reasons."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    capped = f", capped by ${ISA_ENV}" if isa_cap() else ""
    return f"{name}, {isa(flags)}{capped}"


def capped_env(level: str, env: dict | None = None) -> dict:
    """An environment (a copy of ``env`` or ``os.environ``) in which this project, torch and oneDNN all
    believe the CPU tops out at ``level`` (``avx2`` or ``avx512``; ``baseline`` too)."""
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    out = dict(os.environ if env is None else env)
    out[ISA_ENV] = level
    onednn = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16",
              "amx": "AVX512_CORE_AMX"}[level]
    aten = {"baseline": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}[level]
    mkl = {"baseline": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": "AVX512"}[level]
    out["ONEDNN_MAX_CPU_ISA"] = onednn
    out["ATEN_CPU_CAPABILITY"] = aten
    out["MKL_ENABLE_INSTRUCTIONS"] = mkl  # float32 matmuls (MKL's sgemm) too
    return out
