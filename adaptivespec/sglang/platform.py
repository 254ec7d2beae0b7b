"""Where SGLang serves and what a CPU server needs: device detection, the AMX probe, the CPU flags and
environment of SGLang's Intel AMX backend, and the preflight check before a server starts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from adaptivespec.hardware import cpu_flags, cpu_kind  # tests patch cpu_flags here
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang.api import SGLANG_VERSION
from adaptivespec.sglang.api_check import check_api, installed_version

INSTALL_HINT = (f"install it on a CUDA machine with: pip install 'adaptivespec[sglang]' (sglang=={SGLANG_VERSION}); "
                "on an x86 CPU with AMX or AVX-512 bf16: scripts/install_sglang_cpu.sh")

AVX512_SWITCH_ENV = "ADAPTIVESPEC_SGLANG_AVX512"
"""``0`` turns off the AVX-512 mode: a CPU without AMX is then refused, as SGLang itself would."""

CPU_MODE_ENV = "ADAPTIVESPEC_SGLANG_CPU_MODE"
"""Set to ``avx512`` in the environment of the SGLang processes ``serve`` starts on an AVX-512 CPU
without AMX; :mod:`adaptivespec.sglang.cpu_shim` reads it there."""

SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"
"""Put on ``PYTHONPATH`` of those processes only: its ``sitecustomize`` applies the mode."""

CPU_PRELOADS = ("libiomp5.so", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtbbmalloc.so.2")
"""Libraries SGLang's CPU recipe preloads (Intel OpenMP from the venv, tcmalloc, TBB's malloc); each
only where present."""

KV_BUDGET_BYTES = 1 << 30
"""At most this much memory (and 5% of the available memory) for the CPU server's KV cache."""


def detect_device() -> str:
    """``cuda`` when torch sees a CUDA device, else ``cpu`` (SGLang's Intel AMX backend)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def cpu_mode(flags: frozenset[str] | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """How SGLang's CPU backend runs on this CPU: ``amx`` (a Xeon with AMX, SGLang's supported CPU),
    ``avx512`` (AVX-512 with bf16 and no AMX: adaptivespec's supported mode, where the SGLang
    processes ``serve`` starts are told they may use the AMX backend, :mod:`adaptivespec.sglang.cpu_shim`),
    or None: neither, or the mode turned off (``ADAPTIVESPEC_SGLANG_AVX512=0``)."""
    kind = cpu_kind(cpu_flags() if flags is None else flags)
    env = os.environ if env is None else env
    if kind == "avx512" and env.get(AVX512_SWITCH_ENV, "1") == "0":
        return None
    return kind if kind in ("amx", "avx512") else None  # an AVX2 CPU has no bf16 kernels for SGLang


def cpu_refusal(flags: frozenset[str] | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """Why SGLang's CPU backend cannot run speculative decoding here, as a sentence (None: it can)."""
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    if cpu_mode(flags, env) is not None:
        return None
    if {"avx512f", "avx512_bf16"} <= flags:
        return (f"{AVX512_SWITCH_ENV}=0 turned off the AVX-512 mode and this CPU has no AMX: SGLang's CPU backend "
                "runs speculative decoding only with its AMX kernels; unset it, or serve on a CUDA machine")
    return ("no CUDA device and this CPU has neither AMX (amx_bf16) nor AVX-512 bf16 (avx512_bf16) in "
            "/proc/cpuinfo: SGLang's CPU backend runs speculative decoding only with its AMX kernels; serve on a "
            "CUDA machine, or use --runtime torch")


def sglang_unavailable_reason(device: str | None = None) -> str | None:
    """Why ``adaptivespec serve --runtime sglang`` cannot run here, as one sentence (None: it can):
    SGLang not installed, a CPU it cannot run speculative decoding on, or an installed SGLang
    without the API the plugin needs. Imports no sglang (only its package metadata and sources)."""
    if (device or detect_device()) == "cpu":
        refusal = cpu_refusal()
        if refusal:
            return refusal
    if importlib.util.find_spec("sglang") is None:
        return f"sglang is not installed; {INSTALL_HINT}"
    problems = check_api()
    if problems:
        return (f"the installed sglang {installed_version() or '?'} lacks what the plugin (written for "
                f"{SGLANG_VERSION}) needs: {'; '.join(problems)}")
    return None


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def kv_tokens(target: str, available: int | None = None, budget: int = KV_BUDGET_BYTES) -> int:
    """``--max-total-tokens`` for a CPU server: the KV cache of ``target`` (a folder with a
    ``config.json``; bf16 K and V of every layer) in min(``budget``, 5% of the available memory),
    in multiples of 1024, at least 8192 (what one 8k-context request needs) and at most 262144.
    Without it SGLang sizes the cache as for a GPU (18 GB for the embedded model)."""
    import json

    per_token = 30 * 2 * 3 * 64 * 2  # the embedded model's, when the folder cannot be read
    try:
        c = json.loads((Path(target) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        per_token = c["num_hidden_layers"] * 2 * kv_heads * head_dim * 2
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    avail = _available_memory() if available is None else available
    tokens = min(budget, avail // 20) // per_token // 1024 * 1024
    return max(8192, min(tokens, 262144))


def cpu_args(target: str, extra_args: Sequence[str] = ()) -> list[str]:
    """The flags a CPU server needs (those the user already passes after ``--`` are left out):
    ``--device cpu``, ``--dtype bfloat16`` (the draft otherwise runs float16 against a bf16 target
    and the AMX GEMM refuses the mix), ``--max-total-tokens`` (:func:`kv_tokens`) and
    ``--sleep-on-idle`` (an idle scheduler otherwise busy-polls 20-40% of a core, taken from
    whatever else runs on the machine; it wakes on the next request)."""
    given = {a.split("=", 1)[0] for a in extra_args if a.startswith("--")}
    for i, a in enumerate(extra_args):
        value = a.split("=", 1)[1] if a.startswith("--dtype=") else (
            extra_args[i + 1] if a == "--dtype" and i + 1 < len(extra_args) else None)
        if value in ("float32", "float"):
            raise AdaptiveSpecError(f"--dtype {value}: SGLang's CPU kernels run bfloat16 only (their RMSNorm has no "
                                    "float32 kernel); drop --dtype, serve picks bfloat16")
    out: list[str] = []
    for flag, value in (("--device", "cpu"), ("--dtype", "bfloat16"), ("--max-total-tokens", None)):
        if flag not in given:
            out += [flag, value if value is not None else str(kv_tokens(target))]
    if "--sleep-on-idle" not in given:
        out.append("--sleep-on-idle")
    return out


def cpu_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What SGLang's CPU engine reads: ``SGLANG_USE_CPU_ENGINE=1``, OpenMP threads bound to this
    process's CPUs (``SGLANG_CPU_OMP_THREADS_BIND``), and ``LD_PRELOAD`` of Intel OpenMP, tcmalloc
    and tbbmalloc where present; on an AVX-512 CPU without AMX (:func:`cpu_mode` ``avx512``) the
    mode's :data:`CPU_MODE_ENV` and :data:`SHIM_DIR` first on ``PYTHONPATH``. Values already in
    ``base`` are kept."""
    env = dict(os.environ if base is None else base)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if cpu_mode(env=env) == "avx512" and CPU_MODE_ENV not in env:
        env[CPU_MODE_ENV] = "avx512"
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *filter(None, [env.get("PYTHONPATH")])])
    if "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["SGLANG_CPU_OMP_THREADS_BIND"] = _ranges(cpus)
    if "LD_PRELOAD" not in env:
        prefix = Path(sys.prefix) / "lib"
        libs = [str(prefix / p) if "/" not in p else p for p in CPU_PRELOADS]
        present = [p for p in libs if Path(p).is_file()]
        if present:
            env["LD_PRELOAD"] = ":".join(present)
    return env


def _ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = None
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


def preflight(device: str | None = None) -> None:
    """Fail in one line unless SGLang can serve here (:func:`sglang_unavailable_reason`): on a CPU,
    AMX or AVX-512 bf16 (:func:`cpu_mode`), and the installed SGLang with the API the plugin needs."""
    reason = sglang_unavailable_reason(device)
    if reason:
        raise AdaptiveSpecError(reason)
    version = installed_version()
    if version != SGLANG_VERSION:
        print(f"adaptivespec: warning: sglang {version} installed, the plugin is checked against {SGLANG_VERSION}", file=sys.stderr)


def unsupported_reason(*, adaptive: bool, rejection_sampling: bool, tp_size: int, pp_size: int) -> str | None:
    """Why the adaptivespec worker cannot run with these server settings, as a sentence."""
    if adaptive:
        return "--speculative-adaptive is SGLang's own step controller; adaptivespec replaces it: drop the flag"
    if rejection_sampling:
        return "--speculative-use-rejection-sampling runs topk=1 chains only; drop it to vary the tree shape"
    if tp_size != 1 or pp_size != 1:
        return f"tp_size={tp_size}, pp_size={pp_size}: each rank would pick shapes from its own draft probabilities; use 1 and 1"
    return None
