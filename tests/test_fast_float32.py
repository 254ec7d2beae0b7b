"""The fused forward in float32 (:mod:`adaptivespec.fastpath.forward`): the dtype CPUs without fast
bfloat16 (AVX2 only) run.

transformers' forward stays the reference. The fused float32 forward must be the one a float32 model
on a CPU gets, agree with transformers to float32 rounding (logits, hidden states: prefill, one row,
a tree under a mask, unmasked rows), decode the same greedy tokens on a real prompt, and run on a
CPU capped to AVX2 (no AVX-512, no bf16 kernels: torch's own ops only).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from adaptivespec import hardware
from adaptivespec.fastpath import forward as fastforward
from adaptivespec.fastpath.forward import FastLlama, Float32Weight, fast_forward, supported

from test_fastforward import tiny, trace

TOL = dict(rtol=1e-4, atol=1e-4)
"""float32 against float32: the same maths, summed in another order (concatenated projections, one-op norms)."""


def test_a_float32_llama_on_a_cpu_gets_the_fused_forward_with_torch_ops_only():
    model = tiny(torch.float32)
    assert supported(model) is None
    ff = fast_forward(model)
    assert isinstance(ff, FastLlama) and fast_forward(model) is ff
    assert ff.sgl is None and ff.kernel is None and ff.native is None  # no bf16 / AVX-512 kernels
    assert ff.backend == "torch"
    for L in ff.layers:
        assert all(isinstance(w, Float32Weight) for w in (L.qkv, L.o, L.gate_up, L.down))
    assert isinstance(ff.lm_head, Float32Weight)
    assert ff.layers[0].qkv.out_features == 128 + 2 * 64  # Q|K|V in one matmul (4 heads, 2 KV heads of 32)


def test_a_dtype_change_rebuilds_the_fused_forward():
    model = tiny()
    if supported(model) is not None:
        pytest.skip(f"no bfloat16 fused forward here: {supported(model)}")
    assert fast_forward(model).dtype == torch.bfloat16
    model.float()
    ff = fast_forward(model)
    assert ff.dtype == torch.float32 and isinstance(ff.lm_head, Float32Weight)


def test_the_switch_keeps_transformers_forward_for_float32(monkeypatch):
    from adaptivespec.runtime import TorchRuntime

    model = tiny(torch.float32)
    monkeypatch.setenv(fastforward.DISABLE_ENV, "1")
    assert fast_forward(model) is None and "NO_FASTFORWARD" in supported(model)
    plain = TorchRuntime(model)
    assert plain.fast is None and plain.forward is model
    monkeypatch.delenv(fastforward.DISABLE_ENV)
    fast = TorchRuntime(model)
    assert fast.fast is not None and fast.forward is fast.fast


def test_fused_float32_logits_and_states_follow_transformers():
    model = tiny(torch.float32)
    ff = FastLlama(model)
    ref, got = trace(model, model), trace(ff, model)
    for r, g in zip(ref, got):
        assert g.logits.shape == r.logits.shape and g.logits.dtype == torch.float32
        torch.testing.assert_close(g.logits, r.logits, **TOL)
        assert torch.equal(g.logits.argmax(-1), r.logits.argmax(-1))
        if r.hidden_states is not None:
            assert len(g.hidden_states) == len(r.hidden_states)
            for a, b in zip(g.hidden_states, r.hidden_states):
                torch.testing.assert_close(a, b, **TOL)


def test_torch_runtime_decodes_the_same_float32_tokens_fused_and_not(monkeypatch):
    from adaptivespec.runtime import TorchRuntime

    model = tiny(torch.float32)
    prompt = list(range(3, 20))

    def decode(rt):
        return [rt.prefill(prompt, 24)] + [rt.ar_step() for _ in range(20)]

    fast = TorchRuntime(model)
    assert fast.forward is fast.fast
    monkeypatch.setenv(fastforward.DISABLE_ENV, "1")
    assert decode(fast) == decode(TorchRuntime(model))


@pytest.mark.model
def test_fused_float32_greedy_tokens_equal_transformers_generate_on_a_real_prompt(smol32, greedy_reference):
    from adaptivespec.runtime import TorchRuntime

    model, _ = smol32
    text = "Explain in one sentence what a hash table is."
    ids, want = greedy_reference(text, 40)
    rt = TorchRuntime(model)
    assert rt.fast is not None and rt.forward is rt.fast
    got = [rt.prefill(ids, 40)] + [rt.ar_step() for _ in range(len(want) - 1)]
    assert got == want


AVX2_CHECK = textwrap.dedent("""
    import torch
    from adaptivespec import hardware
    from adaptivespec.fastpath.forward import FastLlama, fast_forward, supported
    from adaptivespec.fastpath.native import attention_ops
    from adaptivespec.runtime import TorchRuntime
    from test_fastforward import tiny, trace

    assert hardware.isa() == "avx2" and not hardware.has("bf16_kernels"), hardware.describe()
    assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
    assert attention_ops() is None
    model = tiny(torch.float32)
    assert supported(model) is None
    ff = fast_forward(model)
    assert ff.kernel is None and ff.sgl is None
    for r, g in zip(trace(model, model), trace(ff, model)):
        torch.testing.assert_close(g.logits, r.logits, rtol=1e-4, atol=1e-4)
    rt = TorchRuntime(model)
    assert rt.forward is rt.fast
    print("tokens", [rt.prefill(list(range(3, 20)), 8)] + [rt.ar_step() for _ in range(6)])
""")


@pytest.mark.skipif(not hardware.has("avx2"), reason="needs AVX2 (the cap can only lower what the CPU has)")
def test_the_fused_float32_forward_runs_on_a_cpu_capped_to_avx2(tmp_path):
    from pathlib import Path

    tests = str(Path(__file__).parent)
    env = hardware.capped_env("avx2")
    env["PYTHONPATH"] = tests + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens" in done.stdout


# -- our float32 matmul for few rows (csrc/f32_linear.cpp) ------------------------------------------------
def _f32_ops():
    from adaptivespec.fastpath import native

    ops = native.f32_linear_ops()
    if ops is None:
        pytest.skip(f"our float32 kernel is not built here: {native.f32_linear_why_not()}")
    return ops


@pytest.mark.parametrize(("N", "K"), [(37, 20), (64, 576), (1000, 96)])
def test_our_float32_matmul_computes_x_times_w_transposed_plus_bias(N, K):
    ops = _f32_ops()
    gen = torch.Generator().manual_seed(N * K)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    packed = ops.pack_f32(w)
    for M in (1, 2, 3, 6, 7, 13, 40):
        x = torch.randn(M, K, generator=gen)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(ops.linear_f32(x, packed, N, b).double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)
        torch.testing.assert_close(ops.linear_f32(x, packed, N, None).double(), want - b.double(),
                                   rtol=1e-5, atol=1e-5 * K ** 0.5)
    strided = torch.randn(5, 2 * K, generator=gen)[:, :K]  # rows further apart than K
    torch.testing.assert_close(ops.linear_f32(strided, packed, N, b), ops.linear_f32(strided.contiguous(), packed, N, b),
                               rtol=0, atol=0)


def test_a_row_of_our_float32_matmul_has_the_same_bits_alone_or_beside_others():
    ops = _f32_ops()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=gen)
    packed = ops.pack_f32(w)
    x = torch.randn(17, 576, generator=gen)
    together = ops.linear_f32(x, packed, 200, None)
    alone = torch.cat([ops.linear_f32(x[i:i + 1], packed, 200, None) for i in range(17)])
    assert torch.equal(together, alone)  # what decides a tree's root: the same as a plain step's row
    assert torch.equal(ops.linear_f32(x[3:9], packed, 200, None), together[3:9])


def test_float32_weights_run_our_kernel_where_it_builds_and_torch_without_it(monkeypatch):
    from adaptivespec.fastpath import native

    ops = _f32_ops()
    gen = torch.Generator().manual_seed(11)
    w, b, x = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen), torch.randn(3, 4, 32, generator=gen)
    ours = Float32Weight(w, b)
    assert ours.ours is ops
    monkeypatch.setenv(native.LINEAR_ENV, "1")  # the switch: torch's matmul (MKL) as before
    theirs = Float32Weight(w, b)
    assert theirs.ours is None
    torch.testing.assert_close(ours(x), theirs(x), **TOL)
    assert ours(x).shape == (3, 4, 48)


def test_a_float32_cost_table_names_the_matmul_that_priced_it(monkeypatch):
    from adaptivespec.fastpath import costs, native

    key = costs.machine_key("smollm2-135m-instruct", "float32")
    assert key["linear"] == ("kernel" if native.f32_linear_ops() is not None else "torch")
    assert "linear" not in costs.machine_key("smollm2-135m-instruct", "bfloat16")  # bf16 tables stay valid
    monkeypatch.setenv(native.LINEAR_ENV, "1")
    assert costs.machine_key("smollm2-135m-instruct", "float32")["linear"] == "torch"  # a table of the other is measured again
