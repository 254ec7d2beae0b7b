"""The AVX-512 mode of SGLang's CPU backend: which CPUs get which mode, what ``serve`` puts in the
SGLang processes' environment, and what the shim does inside them (with a stand-in ``sglang``
package, so these run on any machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import platform

AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.fixture(autouse=True)
def _uncapped(monkeypatch):
    """The flag sets here stand for other machines: a cap on this one ($ADAPTIVESPEC_CPU_ISA) is not theirs."""
    monkeypatch.delenv("ADAPTIVESPEC_CPU_ISA", raising=False)
AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512_bf16"})
AVX512_ONLY = frozenset({"avx512f", "avx512bw"})
AVX2 = frozenset({"avx2", "fma"})


def test_flags_are_read_from_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert platform.cpu_flags(info) == {"fpu", "avx512f", "avx512_bf16"}
    assert platform.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("flags,env,mode", [
    (AMX, {}, "amx"),
    (AMX, {platform.AVX512_SWITCH_ENV: "0"}, "amx"),  # the switch turns off only the AVX-512 mode
    (AVX512_BF16, {}, "avx512"),
    (AVX512_BF16, {platform.AVX512_SWITCH_ENV: "1"}, "avx512"),
    (AVX512_BF16, {platform.AVX512_SWITCH_ENV: "0"}, None),
    (AVX512_ONLY, {}, None),  # AVX-512 without bf16: the kernels' bf16 GEMMs have no path
    (AVX2, {}, None),
])
def test_mode_by_cpu(flags, env, mode):
    assert platform.cpu_mode(flags, env) == mode
    refusal = platform.cpu_refusal(flags, env)
    assert (refusal is None) == (mode is not None)
    if refusal:
        assert "\n" not in refusal and "SGLang's CPU backend" in refusal


def test_refusals_say_what_is_missing_and_what_to_do():
    off = platform.cpu_refusal(AVX512_BF16, {platform.AVX512_SWITCH_ENV: "0"})
    assert f"{platform.AVX512_SWITCH_ENV}=0" in off and "unset it" in off
    none = platform.cpu_refusal(AVX2, {})
    assert "neither AMX (amx_bf16) nor AVX-512 bf16 (avx512_bf16)" in none and "--runtime torch" in none


def test_avx512_mode_puts_the_shim_first_on_pythonpath_of_sglang_only(monkeypatch):
    monkeypatch.setattr(platform, "cpu_flags", lambda *a: AVX512_BF16)
    env = platform.cpu_env({"PYTHONPATH": "/mine", "PATH": "/bin"})
    assert env[platform.CPU_MODE_ENV] == "avx512"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(platform.SHIM_DIR), "/mine"]
    assert (platform.SHIM_DIR / "sitecustomize.py").is_file()
    assert "PYTHONPATH" not in os.environ or str(platform.SHIM_DIR) not in os.environ["PYTHONPATH"]  # this process untouched
    # given once, not doubled when the environment passes through again (bench peers, soak)
    assert platform.cpu_env(env)["PYTHONPATH"] == env["PYTHONPATH"]
    off = platform.cpu_env({platform.AVX512_SWITCH_ENV: "0"})
    assert platform.CPU_MODE_ENV not in off and "PYTHONPATH" not in off


def test_amx_cpu_gets_no_shim(monkeypatch):
    monkeypatch.setattr(platform, "cpu_flags", lambda *a: AMX)
    env = platform.cpu_env({"PATH": "/bin"})
    assert platform.CPU_MODE_ENV not in env and "PYTHONPATH" not in env


def test_preflight_refuses_a_cpu_without_amx_or_avx512_bf16_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(platform, "cpu_flags", lambda *a: AVX2)
    with pytest.raises(AdaptiveSpecError, match="neither AMX"):
        platform.preflight("cpu")
    assert platform.sglang_unavailable_reason("cpu") == platform.cpu_refusal(AVX2, {})
    monkeypatch.setattr(platform, "cpu_flags", lambda *a: AVX512_BF16)
    assert platform.cpu_refusal() is None  # the CPU passes; what is left is SGLang itself


def _fake_sglang(root, flag_value: bool = False):
    """A stand-in ``sglang.srt.utils.common`` whose AMX flag says what SGLang read from torch."""
    pkg = root / "sglang" / "srt" / "utils"
    pkg.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "common.py").write_text(textwrap.dedent(f"""
        is_amx_tile_supported = {flag_value}
        def cpu_has_amx_support():
            return is_amx_tile_supported
    """))


def _run(env_extra, pythonpath):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", platform.CPU_MODE_ENV)}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    code = ("import sglang.srt.utils.common as c, sys; "
            "print(c.cpu_has_amx_support(), sys.modules.get('_next_ran') is not None)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_the_shim_flips_only_sglangs_amx_flag_and_only_in_the_mode(tmp_path):
    fake = tmp_path / "site"
    _fake_sglang(fake)
    assert _run({}, [platform.SHIM_DIR, fake]) == ["False", "False"]  # without the variable: nothing
    assert _run({platform.CPU_MODE_ENV: "avx512"}, [platform.SHIM_DIR, fake]) == ["True", "False"]
    assert _run({platform.CPU_MODE_ENV: "avx512"}, [fake]) == ["False", "False"]  # the variable alone does nothing


def test_the_shim_still_runs_the_next_sitecustomize(tmp_path):
    fake, other = tmp_path / "site", tmp_path / "other"
    _fake_sglang(fake)
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys, types\nsys.modules['_next_ran'] = types.ModuleType('_next_ran')\n")
    assert _run({platform.CPU_MODE_ENV: "avx512"}, [platform.SHIM_DIR, other, fake]) == ["True", "True"]


@pytest.mark.parametrize(("flags", "kind", "mode"), [
    (AMX, "amx", "amx"), (AVX512_BF16, "avx512", "avx512"), (AVX2, "avx2", None), (frozenset(), None, None),
])
def test_cpu_kind_names_what_a_row_costs_here(flags, kind, mode):
    from adaptivespec.api import cpu_kind

    assert cpu_kind(flags) == kind
    assert platform.cpu_mode(flags, env={}) == mode  # SGLang's mode: the bf16 kinds only, unless switched off
