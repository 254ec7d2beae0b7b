"""This project's C++ kernels, compiled at first use and cached: the int8 target's (``csrc/int8_ops.cpp``,
:func:`ops`) and the bfloat16 attention over a long cache (``csrc/bf16_attention.cpp``, :func:`attention_ops`).

The int8 target's:

Kernels whose every output is computed by the same code in the same order from its own row: per-row
activation quantization, the matmul's per-row scaling, RMSNorm, an AVX512-VNNI int8 matmul for few
rows, and attention over a row's visible keys in ascending order (an online softmax, one pass). They make the int8 target's forward
independent of the layout it runs in (one row, a tree, a prefill chunk, a batch), so strict
speculation reproduces its greedy decoding token for token. Built with torch's C++ extension
loader (a C++ compiler and ninja; ``-march=native``, cached under ``<cache>/native/<cpu>``, ~20 s
once); where it cannot be built the int8 target runs torch's ops instead (say so once) and its
attention rounds by layout (docs/int8.md). ``$ADAPTIVESPEC_NO_NATIVE=1`` skips every kernel here.

The bfloat16 attention (:mod:`adaptivespec.fastpath.forward` calls it for the target's rows, tree,
prefill chunk or one row, where the CPU has AVX512-BF16): a KV head's query heads folded into its
rows, the committed prefix read once for every row and merged with the tree or causal edge in the
same pass, VDPBF16PS dot products; ~2x torch's CPU flash attention at 1k-4k keys (docs/speed.md, *Long prompts*).
Where it cannot be built (no AVX512-BF16, no compiler) torch's SDPA runs, as before.
``$ADAPTIVESPEC_NO_ATTENTION_KERNEL=1`` skips it alone. A row's output is the same sequence of roundings
over its own visible keys whatever else the call holds (docs/batching.md, *Seeds*).

The fixed-order bfloat16 linear (``csrc/bf16_linear.cpp``, :func:`linear_ops`): for the weights whose
oneDNN matmul rounds a row by the number of rows beside it (found by a probe, per shape and thread
count), so that with the attention kernel the bfloat16 forward is batch-invariant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path

from adaptivespec import hardware

DISABLE_ENV = "ADAPTIVESPEC_NO_NATIVE"
ATTENTION_ENV = "ADAPTIVESPEC_NO_ATTENTION_KERNEL"
SOURCE = Path(__file__).parent / "csrc" / "int8_ops.cpp"
OPENMP = "-fopenmp"
"""``at::parallel_for`` is a header: compiled without OpenMP it runs every task on the calling thread (the
kernels here ran on one core of two until 2026-12-07). With it, the tasks go to torch's own OpenMP
threads (the symbols resolve through libtorch's libgomp; no second runtime is linked). A compiler
without OpenMP builds the kernels without it (one thread) rather than not at all."""
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", OPENMP]
"""``-ffp-contract=off``: a multiply and an add stay two roundings, as in torch's ops (the fallback)."""
ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "bf16_attention.cpp"
ATTENTION_FLAGS = ["-O3", "-march=native", "-fno-math-errno", OPENMP]
LINEAR_ENV = "ADAPTIVESPEC_NO_LINEAR_KERNEL"
LINEAR_SOURCE = Path(__file__).parent / "csrc" / "bf16_linear.cpp"

log = logging.getLogger("adaptivespec.native")
_STATE: dict[str, object] = {}


def ops():
    """The compiled module (``quantize_rows``, ``scale_rows``, ``rms_norm``, ``pack_weight``, ``has_vnni``,
    ``int8_linear``, ``has_avx2``, ``pack_weight_avx2``, ``int8_linear_avx2`` (exact int32 sums without VNNI),
    ``attend``), or None (see :func:`why_not`)."""
    if "ops" not in _STATE:
        _STATE["ops"], _STATE["why"] = _build("adaptivespec_int8_ops", SOURCE, FLAGS)
        if _STATE["ops"] is None:
            log.warning("adaptivespec: int8 kernels not built (%s): torch's ops instead; attention rounds by layout",
                        _STATE["why"])
    return _STATE["ops"]


def why_not() -> str | None:
    ops()
    return _STATE["why"]


def _kernel_module(key: str, env: str, name: str, source: Path, feature: str = "bf16_kernels"):
    """A module of ours built once (where the CPU has ``feature``, :func:`adaptivespec.hardware.has`), or
    None; ``$env=1`` skips it (read at every call: a forward built after it is set goes without)."""
    if os.environ.get(env, "0") == "1":
        return None
    if key not in _STATE and not hardware.has(feature):  # nothing compiled for an ISA the CPU lacks
        _STATE[key], _STATE[f"{key}_why"] = None, hardware.missing(feature)
    if key not in _STATE:
        module, why = _build(name, source, ATTENTION_FLAGS)
        if module is not None and not module.available():
            module, why = None, f"{source.name} was built without the instructions it needs ({feature})"
        _STATE[key], _STATE[f"{key}_why"] = module, why
    return _STATE[key]


def attention_ops():
    """The bfloat16 attention module (``attend_bf16``, ``attend_slab``, ``available``) where it builds and
    the CPU has AVX512-BF16, else None (torch's SDPA then; :func:`attention_why_not` says why)."""
    return _kernel_module("attention", ATTENTION_ENV, "adaptivespec_bf16_attention", ATTENTION_SOURCE)


def _why_not(key: str, env: str, load) -> str | None:
    """Why :func:`_kernel_module` ``key`` is None (``load()`` builds it), or None where it is not."""
    if os.environ.get(env, "0") == "1":
        return f"${env}=1"
    load()
    return _STATE[f"{key}_why"]


def attention_why_not() -> str | None:
    return _why_not("attention", ATTENTION_ENV, attention_ops)


def linear_ops():
    """The fixed-order bfloat16 linear (``pack_linear``, ``linear_bf16``, ``available``) where it builds and
    the CPU has AVX512-BF16 and ``$ADAPTIVESPEC_NO_LINEAR_KERNEL`` is not 1, else None. Used for a weight
    whose matmul sums a row differently by the number of rows beside it
    (:class:`adaptivespec.fastpath.prepack.PackedWeight`, ``invariant=True``)."""
    return _kernel_module("linear", LINEAR_ENV, "adaptivespec_bf16_linear", LINEAR_SOURCE)


F32_LINEAR_SOURCE = Path(__file__).parent / "csrc" / "f32_linear.cpp"


def f32_linear_ops():
    """The float32 linear for few rows (``pack_f32``, ``linear_f32``, ``available``) where it builds, the CPU
    has AVX2 + FMA and ``$ADAPTIVESPEC_NO_LINEAR_KERNEL`` is not 1, else None (torch's matmul then; MKL's).
    :class:`adaptivespec.fastpath.forward.Float32Weight` runs it: a weight read once for all of a call's
    rows, each output summed in one fixed order (csrc/f32_linear.cpp)."""
    return _kernel_module("f32_linear", LINEAR_ENV, "adaptivespec_f32_linear", F32_LINEAR_SOURCE, "avx2")


def f32_linear_why_not() -> str | None:
    return _why_not("f32_linear", LINEAR_ENV, f32_linear_ops)


def _flags_key() -> str:
    """A short hash of the CPU's feature flags as the project sees them (capped by
    ``$ADAPTIVESPEC_CPU_ISA``): code compiled for one instruction set is kept apart from another's (two
    CPUs can share a model name, e.g. "AMD EPYC", and differ in AVX-512)."""
    import hashlib

    return hashlib.sha1(" ".join(sorted(hardware.features())).encode()).hexdigest()[:8]


MARCH = {"baseline": "-march=x86-64-v2", "avx2": "-march=x86-64-v3", "avx512": "-march=x86-64-v4"}
"""``-march`` under an ISA cap (:func:`adaptivespec.hardware.isa_cap`): code for the capped level, not for
the machine (``-march=native`` otherwise); ``avx512`` adds VNNI where the CPU has it."""


def _march(flags: list[str]) -> list[str]:
    """``flags`` with ``-march=native`` replaced by the capped level's, where ``$ADAPTIVESPEC_CPU_ISA`` caps it."""
    level = hardware.isa_cap()
    if level is None or level not in MARCH or hardware.isa() == "aarch64":
        return flags
    extra = ["-mavx512vnni"] if level == "avx512" and hardware.has("vnni") else []
    return [f for f in flags if f != "-march=native"] + [MARCH[level], *extra]


def _build(name: str, source: Path, flags: list[str]):
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return None, f"${DISABLE_ENV}=1"
    try:
        from adaptivespec.costmodel import cpu_name
        from adaptivespec.paths import cache_dir

        cpu = re.sub(r"[^A-Za-z0-9]+", "_", cpu_name()).strip("_")[:48] or "cpu"
        where = cache_dir() / "native" / f"{cpu}-{_flags_key()}"
        where.mkdir(parents=True, exist_ok=True)
        flags = _march(flags)
        with _build_lock(where / f"{name}.adaptivespec-lock", source.name):
            return _compile(name, source, flags, where), None
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch path runs
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{type(exc).__name__}: {first[:200]}"


@contextlib.contextmanager
def _build_lock(path: Path, what: str):
    """Hold an exclusive ``flock`` on ``path`` while one process of ours compiles into its folder.

    torch's extension loader guards a build folder with a plain ``lock`` file that a killed build (a
    Ctrl-C during the first run) leaves behind, and every later load then waits on it forever. The
    kernel releases a ``flock`` when its holder dies, so while we hold ours no live process of ours is
    compiling there: a ``lock`` file left in the folder is stale and removed before loading."""
    import fcntl

    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"adaptivespec: waiting for another process compiling {what} for this CPU")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say(text: str) -> None:
    """One line on the terminal (where stderr is one) and in the log."""
    log.info(text)
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def _compile(name: str, source: Path, flags: list[str], where: Path):
    """torch's extension loader over ``source`` in ``where/name`` (under :func:`_build_lock`); a compiler
    without OpenMP gets a one-thread build."""
    import time

    import torch.utils.cpp_extension as ext

    folder = where / name
    folder.mkdir(exist_ok=True)
    (folder / "lock").unlink(missing_ok=True)  # stale: see _build_lock
    fresh = not any(folder.glob("*.so"))
    if fresh:  # the first use on this CPU: say why it pauses
        _say(f"adaptivespec: compiling {source.name} for this CPU ({hardware.isa()}; once, ~20-60 s)")
    start = time.perf_counter()
    try:
        module = ext.load(name=name, sources=[str(source)], extra_cflags=flags, build_directory=str(folder),
                          verbose=False)
    except Exception:  # noqa: BLE001 - e.g. no OpenMP in this compiler: one thread rather than none
        if OPENMP not in flags:
            raise
        serial = where / f"{name}_serial"
        serial.mkdir(exist_ok=True)
        (serial / "lock").unlink(missing_ok=True)
        module = ext.load(name=f"{name}_serial", sources=[str(source)], extra_cflags=[f for f in flags if f != OPENMP],
                          build_directory=str(serial), verbose=False)
        log.warning("adaptivespec: %s built without OpenMP: its kernels run on one thread", source.name)
    if fresh:
        _say(f"adaptivespec: compiled {source.name} in {time.perf_counter() - start:.0f} s (cached)")
    return module
