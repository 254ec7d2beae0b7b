"""Where SGLang serves and what a CPU server needs: device detection, the AMX probe, the CPU flags and
environment of SGLang's Intel AMX backend, and the preflight check before a server starts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang.api import SGLANG_VERSION, check_api, installed_version

INSTALL_HINT = (f"install it on a CUDA machine with: pip install 'adaptivespec[sglang]' (sglang=={SGLANG_VERSION}); "
                "on a Xeon with AMX: scripts/install_sglang_cpu.sh")

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


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX (``amx_bf16`` in /proc/cpuinfo): SGLang's CPU speculative path needs it."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


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
    and tbbmalloc where present. Values already in ``base`` are kept."""
    env = dict(os.environ if base is None else base)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
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
    """Fail in one line unless the installed SGLang is there and has the API the plugin needs
    (and, on a CPU, the CPU has AMX)."""
    if (device or detect_device()) == "cpu" and not cpu_has_amx():
        raise AdaptiveSpecError("no CUDA device and this CPU has no AMX (amx_bf16 in /proc/cpuinfo): SGLang's CPU "
                                "backend runs speculative decoding only with AMX; serve on a CUDA machine")
    if importlib.util.find_spec("sglang") is None:
        raise AdaptiveSpecError(f"sglang is not installed; {INSTALL_HINT}")
    problems = check_api()
    if problems:
        raise AdaptiveSpecError(
            f"the installed sglang {installed_version() or '?'} lacks what the plugin (written for "
            f"{SGLANG_VERSION}) needs: {'; '.join(problems)}"
        )
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
