"""SGLang's CPU kernels compute what plain torch computes, to bf16 rounding, at the embedded pair's shapes.

One test per check of :mod:`adaptivespec.analysis.sglang_kernels` (the kernels SGLang's CPU backend and
the torch fast path call), skipped where ``sgl_kernel`` does not import; and tests that the checker can
fail: a wrong reference, a kernel a few bits less precise than bf16, a tree mask ignored. A few seconds
on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from adaptivespec.analysis import sglang_kernels as sk

CHECKS = sk.checks()
BY_NAME = {c.name: c for c in CHECKS}


@pytest.fixture(scope="module")
def ops():
    found = sk.sgl_ops()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_kernel_agrees_with_torch_to_bf16_rounding(check, ops):
    result = sk.run_check(check, ops)
    assert result.passed, sk.format_result(result)


def test_every_served_kernel_has_a_check():
    ops_checked = {c.kernel_op for c in CHECKS}
    for op in ("rmsnorm_cpu", "fused_add_rmsnorm_cpu", "silu_and_mul_cpu", "rotary_embedding_cpu",
               "convert_weight_packed + weight_packed_linear", "decode_attention_cpu", "extend_attention_cpu",
               "store_cache_cpu"):
        assert op in ops_checked
    assert any("tree" in c.name and "extend_attention_cpu" == c.kernel_op for c in CHECKS)
    assert any(c.kernel_op == "build_tree_kernel_efficient_cpu + extend_attention_cpu" for c in CHECKS)
    assert len(BY_NAME) == len(CHECKS)  # names are unique (they seed the inputs)


def _truncate(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` with its float32 significand cut to ``bits`` bits (bf16 keeps 8): a kernel losing precision."""
    i = t.float().contiguous().view(torch.int32)
    return (i & ~((1 << (24 - bits)) - 1)).view(torch.float32).to(t.dtype)


def test_a_wrong_reference_fails(ops):
    check = BY_NAME["silu_and_mul_cpu rows 1,7,64"]
    inter = sk.INTER

    def swapped(inp):  # SiLU of the up half times the gate half: the wrong order
        return tuple(torch.nn.functional.silu(x.float()[:, inter:]) * x.float()[:, :inter] for x in inp["xs"])

    result = sk.run_check(dataclasses.replace(check, reference=swapped), ops)
    # torch's bf16 is as far from a wrong reference as the kernel: the absolute bound catches it
    assert not result.passed and "the reference is wrong" in result.note


@pytest.mark.parametrize("name", ["weight_packed_linear target qkv rows 5,8,16,33,64,256",
                                  "extend_attention_cpu target verify tree n=16", "rmsnorm_cpu rows 16,64"])
def test_a_kernel_three_bits_short_of_bf16_fails(name, ops):
    check = BY_NAME[name]
    kernel = check.kernel
    def short_kernel(o, inp):  # 5 significant bits: 3 fewer than bf16's
        return tuple(_truncate(t, 5) for t in kernel(o, inp))

    result = sk.run_check(dataclasses.replace(check, kernel=short_kernel), ops)
    assert not result.passed, sk.format_result(result)


@pytest.mark.parametrize("name", ["extend_attention_cpu target verify tree n=8",
                                  "extend_attention_cpu verify, SGLang's tree (6,4,12)"])
def test_the_tree_mask_is_honoured(name, ops):
    check = BY_NAME[name]
    kernel = check.kernel

    def causal_kernel(o, inp):  # the kernel without the tree mask: plain causal attention over the drafts
        return kernel(o, dict(inp, mask=None))

    assert not sk.run_check(dataclasses.replace(check, kernel=causal_kernel), ops).passed
    assert sk.run_check(check, ops).passed


def test_cli_prints_the_cpu_and_one_line_per_kernel_and_writes_json(ops, tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert sk.main(["--only", "rmsnorm_cpu rows", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ") and "amx_bf16" in lines[0] and "avx512_bf16" in lines[0]
    assert sum(line.startswith("PASS  ") and "rmsnorm_cpu rows" in line for line in lines) == 4
    data = json.loads(out.read_text())
    assert {r["name"] for r in data["results"]} == {f"{op} rows {rows}" for op in ("rmsnorm_cpu", "fused_add_rmsnorm_cpu")
                                                    for rows in ("1,3", "16,64")}
    assert data["cpu"]["model"] and data["plain_torch"]


def test_cli_exits_1_on_a_failure(ops, monkeypatch, capsys):
    bad = dataclasses.replace(BY_NAME["rmsnorm_cpu rows 1,3"],
                              reference=lambda inp: tuple(2 * x.float() for x in inp["xs"]))
    monkeypatch.setattr(sk, "checks", lambda: [bad])
    assert sk.main([]) == 1
    assert "FAIL  rmsnorm_cpu rows 1,3" in capsys.readouterr().out


def test_without_the_kernels_it_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # import sgl_kernel now raises ImportError
    reason = sk.sgl_ops()
    assert isinstance(reason, str) and "\n" not in reason and "sgl_kernel" in reason
    assert sk.main([]) == 2
    assert capsys.readouterr().out.strip() == reason


def _module(*args, **env):
    full = dict(os.environ, **env)
    full.pop("ONEDNN_MAX_CPU_ISA", None)
    return subprocess.run([sys.executable, "-m", "adaptivespec.analysis.sglang_kernels", *args], env=full,
                          capture_output=True, text=True, timeout=300)


def test_brgemm_kernels_on_oneDNN_avx512_bf16_code(ops):
    """``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``: the matmuls of more than 4 rows and the extend attention
    run oneDNN's AVX-512-bf16 brgemm, what a CPU without AMX runs (on an AMX Xeon they run AMX otherwise)."""
    # a representative subset (the packed QKVs of target and head at 5-256 rows, every extend attention); the module
    # runs them all: python -m adaptivespec.analysis.sglang_kernels --onednn-isa AVX512_CORE_BF16
    proc = _module("--onednn-isa", "AVX512_CORE_BF16", "--only", "qkv rows 5,", "--only", "extend_attention_cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in proc.stdout
    brgemm = [line for line in proc.stdout.splitlines() if line.startswith("PASS") and "(oneDNN brgemm)" in line]
    expected = [c for c in CHECKS if "qkv rows 5," in c.name or "extend_attention_cpu" in c.name]
    assert len(brgemm) == len(expected) and all("[avx512-bf16 (oneDNN brgemm)]" in line for line in brgemm), proc.stdout
    if sk.cpu_info()["avx512_bf16"]:  # oneDNN's own word for the code it ran (its verbose header)
        proc = _module("--onednn-isa", "AVX512_CORE_BF16", "--only", "target qkv rows 5", ONEDNN_VERBOSE="1")
        isa = [line for line in proc.stdout.splitlines() if "onednn_verbose" in line and ",isa:" in line]
        assert proc.returncode == 0 and isa and "AMX" not in isa[0] and "bfloat16" in isa[0], isa
        assert "ukernel,exec,cpu,brgemm" in proc.stdout  # the check did run oneDNN's brgemm
