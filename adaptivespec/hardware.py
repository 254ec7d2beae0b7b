"""What kind of CPU this is, as the settings measured per CPU kind name it (no torch import: the
SGLang wing's platform checks read it too)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (the first ``flags`` line of ``cpuinfo``; empty when it cannot be read)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except (OSError, IndexError):
        pass
    return frozenset()


def cpu_kind(flags: frozenset[str] | None = None) -> str | None:
    """What a bf16 row costs on this CPU, in one word: ``amx`` (AMX tiles, ``amx_bf16``: verified
    rows nearly free up to ~32 on a 2-vCPU Xeon), ``avx512`` (AVX-512 bf16 without AMX: ~0.7 ms a
    row beyond 8 on a 2-vCPU EPYC), else None. ``flags``: default :func:`cpu_flags`."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "amx"
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512"
    return None
