"""Every CPU the README meets: what the project believes the CPU has (adaptivespec.hardware), the dtype
it picks, no kernel compiled for an ISA the CPU lacks, a killed first compile that does not hang the
next run, and the shipped configs under an AVX2 cap (``$ADAPTIVESPEC_CPU_ISA=avx2``) on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adaptivespec import hardware

ROOT = Path(__file__).resolve().parents[1]
# flags lines as /proc/cpuinfo lists them on the three CPU kinds CI has met (trimmed to what matters)
AVX2_EPYC = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 adx sha_ni".split())
AVX512_EPYC = AVX2_EPYC | frozenset("avx512f avx512dq avx512bw avx512vl avx512cd avx512_vnni avx512_bf16 avx512vbmi".split())
AMX_XEON = AVX512_EPYC | frozenset("amx_tile amx_bf16 amx_int8 avx_vnni".split())


@pytest.mark.parametrize(("flags", "level", "dtype"), [
    (AVX2_EPYC, "avx2", "float32"), (AVX512_EPYC, "avx512_bf16", "bfloat16"), (AMX_XEON, "amx", "bfloat16"),
    (AVX512_EPYC - {"avx512_bf16"}, "avx512", "float32"), (frozenset({"sse2"}), "baseline", "float32"),
])
def test_each_cpu_kind_gets_its_level_and_dtype(flags, level, dtype, monkeypatch):
    monkeypatch.delenv(hardware.ISA_ENV, raising=False)
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a: flags)
    hardware._features.cache_clear()
    try:
        assert hardware.isa(flags) == level
        assert hardware.isa() == level or hardware.isa() == "aarch64"
        if hardware.isa() != "aarch64":
            assert hardware.auto_dtype("cpu") == dtype
            assert hardware.has("bf16_kernels") == (dtype == "bfloat16")
    finally:
        hardware._features.cache_clear()
    assert hardware.auto_dtype("cuda:0") == "bfloat16"


@pytest.mark.parametrize(("flags", "kind"), [
    (AVX2_EPYC, "avx2"), (AVX512_EPYC, "avx512"), (AMX_XEON, "amx"),
    (AVX512_EPYC - {"avx512_bf16"}, "avx2"),  # AVX-512 without bf16 runs float32 like an AVX2 CPU
    (frozenset({"sse2"}), None),
])
def test_cpu_kind_follows_what_runs_there(flags, kind, monkeypatch):
    monkeypatch.delenv(hardware.ISA_ENV, raising=False)
    assert hardware.cpu_kind(flags) == kind
    assert (kind in ("amx", "avx512")) == hardware.has("bf16_kernels", flags)  # the bf16 kinds are where bf16 is fast


@pytest.mark.parametrize("flags", [AVX512_EPYC, AMX_XEON])
def test_a_cap_makes_any_cpu_an_avx2_one(flags, monkeypatch):
    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    assert hardware.isa(flags) == "avx2"
    assert not hardware.has("bf16_kernels", flags) and not hardware.has("vnni", flags)
    assert not hardware.has("onednn_bf16", flags) and hardware.has("avx2", flags)
    assert hardware.cpu_kind(flags) == "avx2"  # settings measured per CPU kind follow the cap too
    assert hardware.missing("bf16_kernels", flags) == \
        "needs AVX512-BF16: this CPU has avx2 (capped by $ADAPTIVESPEC_CPU_ISA)"
    monkeypatch.setenv(hardware.ISA_ENV, "avx512")
    assert hardware.isa(AMX_XEON) == "avx512" and hardware.has("vnni", AMX_XEON)


def test_a_bad_cap_is_one_line_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(hardware.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"\$ADAPTIVESPEC_CPU_ISA: expected one of baseline, avx2, avx512, avx512_bf16, amx, got 'avx3'"):
        hardware.isa()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {drafter: null}\n")
    proc = subprocess.run([sys.executable, "-m", "adaptivespec", "generate", "--config", str(cfg), "--prompt", "hi"],
                          capture_output=True, text=True, env={**os.environ, hardware.ISA_ENV: "avx3"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("runtime.dtype: auto: $ADAPTIVESPEC_CPU_ISA: expected one of "
                                                         "baseline, avx2, avx512, avx512_bf16, amx, got 'avx3'")


def test_capped_env_sets_torch_and_onednn_beside_ours():
    env = hardware.capped_env("avx2", {})
    assert env == {"ADAPTIVESPEC_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_dtype_auto_resolves_when_the_config_loads(monkeypatch):
    from adaptivespec.config import load_config

    for level, want in (("avx2", "float32"), ("avx512", "float32")):
        monkeypatch.setenv(hardware.ISA_ENV, level)
        cfg = load_config(ROOT / "configs" / "hybrid.yaml")
        if hardware.isa() != "aarch64":
            assert cfg.runtime.dtype == want and cfg.runtime.precision == want
        assert load_config(ROOT / "configs" / "ar-int8.yaml").runtime.precision.startswith(f"int8-{cfg.runtime.dtype}")
        assert load_config(None, ["runtime.dtype=bfloat16"]).runtime.dtype == "bfloat16"  # explicit stays
    monkeypatch.delenv(hardware.ISA_ENV)
    assert load_config(None).runtime.dtype == hardware.auto_dtype()
    assert load_config(None, ["runtime.device=cuda"]).runtime.dtype == "bfloat16"


def test_every_shipped_config_says_auto():
    import yaml

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        runtime = (yaml.safe_load(path.read_text()) or {}).get("runtime") or {}
        assert runtime.get("dtype", "auto") == "auto", f"{path.name}: runtime.dtype {runtime.get('dtype')!r}"


def test_no_bf16_kernel_is_compiled_for_a_cpu_without_it(monkeypatch, tmp_path):
    from adaptivespec.fastpath import native, prepack

    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    monkeypatch.setenv("ADAPTIVESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_build", lambda *a: pytest.fail(f"compiled {a[0]} on a capped CPU"))
    assert native.attention_ops() is None and native.linear_ops() is None
    assert native.attention_why_not() == "needs AVX512-BF16: this CPU has avx2 (capped by $ADAPTIVESPEC_CPU_ISA)"
    assert prepack.sgl_ops() is None
    import torch

    lin = torch.nn.Linear(8, 8).bfloat16()
    assert not prepack.can_prepack(lin) and prepack.prepack_linears(lin) == 0  # no oneDNN bf16 reorder: it raises there


def test_native_code_under_a_cap_is_compiled_for_the_capped_level(monkeypatch):
    from adaptivespec.fastpath import native

    monkeypatch.setenv(hardware.ISA_ENV, "avx2")
    assert native._march(native.FLAGS)[-1] == "-march=x86-64-v3" and "-march=native" not in native._march(native.FLAGS)
    capped = native._flags_key()
    monkeypatch.delenv(hardware.ISA_ENV)
    assert native._march(native.FLAGS) == native.FLAGS
    assert native._flags_key() != capped or hardware.isa() in ("avx2", "aarch64")  # kept apart in the cache


TINY = "#include <torch/extension.h>\nint answer() { return 42; }\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n"


def _load_tiny(cache: Path, source: Path, timeout: float):
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from adaptivespec.fastpath import native
        start = time.perf_counter()
        module, why = native._build("adaptivespec_tiny_test", Path({str(source)!r}), ["-O0"])
        print(module.answer() if module else why, round(time.perf_counter() - start, 1))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ADAPTIVESPEC_CACHE": str(cache)})


@pytest.mark.skipif(sys.platform != "linux", reason="flock and torch's extension loader as on Linux")
def test_a_compile_killed_midway_does_not_hang_the_next_run(tmp_path):
    """A first run's compile killed (Ctrl-C) left torch's ``lock`` file, and every later run waited on it."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    cache = tmp_path / "cache"
    code = textwrap.dedent(f"""
        from pathlib import Path
        from adaptivespec.fastpath import native
        native._build("adaptivespec_tiny_test", Path({str(source)!r}), ["-O0"])
    """)
    killed = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "ADAPTIVESPEC_CACHE": str(cache)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(cache.glob("native/*/adaptivespec_tiny_test/lock")):
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert list(cache.glob("native/*/adaptivespec_tiny_test/lock")), "torch's build lock was never taken"
    done = _load_tiny(cache, source, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "42"


@pytest.mark.model
def test_an_explicit_bf16_on_a_cpu_without_it_runs_and_says_so_once():
    env = hardware.capped_env("avx2")
    proc = subprocess.run([sys.executable, "-m", "adaptivespec", "generate", "--config", str(ROOT / "configs" / "ar.yaml"),
                           "--set", "runtime.dtype=bfloat16", "--prompt", "Say hi.", "--max-new-tokens", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "without fast bf16" in line]
    assert len(warnings) == 1 and "avx2" in warnings[0] and "runtime.dtype: auto (or float32) is faster" in warnings[0]
    assert "torch bfloat16 on avx2]" in proc.stdout


SHIPPED_UNDER_A_CAP = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    root, prompts, n = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    out = {}
    for path in sorted((root / "configs").glob("*.yaml")):
        config = load_config(path, [f"generation.max_new_tokens={n}"])
        engine = Engine(config)
        texts = [engine.generate_ids(engine.encode(p)).text for p in prompts]
        out[path.stem] = {"texts": texts, "lossless": engine.lossless, "precision": config.runtime.precision,
                          "plain": config.autoregressive and not config.sources}
    print(json.dumps(out))
""")


@pytest.mark.model
def test_every_shipped_config_runs_on_avx2_and_lossless_ones_equal_ar():
    """Under ``$ADAPTIVESPEC_CPU_ISA=avx2`` (torch and oneDNN capped alike), on whatever CPU CI has: every
    shipped config loads and generates (no bf16 reorder, no AVX-512 kernel), in float32, and every lossless
    one writes ``ar``'s text (``ar-int8``'s for the int8 target)."""
    prompts = ["Write a Python function that returns the factorial of n.",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?"]
    proc = subprocess.run([sys.executable, "-c", SHIPPED_UNDER_A_CAP, str(ROOT), json.dumps(prompts), "24"],
                          capture_output=True, text=True, env=hardware.capped_env("avx2"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runs) >= 20, sorted(runs)
    plain = {run["precision"]: run["texts"] for run in runs.values() if run["plain"]}  # ar, ar-int8
    compared = 0
    for name, run in runs.items():
        assert run["precision"].replace("int8-", "").startswith("float32"), (name, run["precision"])
        assert all(run["texts"]), name
        if run["lossless"] and run["precision"] in plain:
            assert run["texts"] == plain[run["precision"]], name
            compared += 1
    assert compared >= 15 and {"float32", runs["ar-int8"]["precision"]} <= set(plain)
