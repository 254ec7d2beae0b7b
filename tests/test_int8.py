"""The int8 target (``runtime.quantization: int8``, :mod:`adaptivespec.fastpath.int8`).

The kernel against its float reference bit for bit (int32 sums are exact, so no tolerance); a row's
result independent of the rows beside it, from one matmul up to the whole fused forward; and the
engine's promise in int8 itself: strict configs reproduce the int8 target's own greedy decoding, one
request alone and every request of a batch with requests joining and leaving.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptivespec import hardware
from adaptivespec.config import load_config
from adaptivespec.fastpath import native
from adaptivespec.fastpath.int8 import (FLOAT_EXACT_K, Int8Linear, Int8Weight, float_products, kernel_name,
                                        quantization_of, quantize_linears, quantize_rows, quantize_weight,
                                        reference_linear, reference_products)

ROOT = Path(__file__).parents[1]
needs_native = pytest.mark.skipif(native.ops() is None,
                                  reason=f"the int8 target's C++ kernels did not build: {native.why_not()}")


# -- the matmul ---------------------------------------------------------------------------------------
def test_rows_quantize_round_half_up_within_127():
    x = torch.tensor([[127.0, -127.0, 63.5, -63.5, 0.25, 0.0], [0.0] * 6])
    q, amax = quantize_rows(x)
    assert q.dtype == torch.uint8 and amax[0, 0].item() == 127.0
    assert (q[0].int() - 128).tolist() == [127, -127, 64, -63, 0, 0]  # floor(v + 0.5)
    assert (q[1].int() - 128).tolist() == [0] * 6  # a padded row of zeros stays zeros


def test_weights_quantize_per_output_channel():
    w = torch.tensor([[1.0, -0.5, 0.25], [-100.0, 50.0, 0.0]])
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q[:, 0].abs().tolist() == [127, 127]
    torch.testing.assert_close(q.float() * scale[:, None], w, atol=scale.max().item() / 2, rtol=0)


@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (1536, 576, False), (64, 96, True), (576, 4096, False)])
def test_kernel_is_its_reference_bit_for_bit_and_rows_do_not_see_each_other(k, n, bias):
    torch.manual_seed(k + n)
    lin = torch.nn.Linear(k, n, bias=bias).bfloat16()
    layer = Int8Linear(lin)
    x = (torch.randn(70, k) * torch.logspace(-2, 2, 70)[:, None]).bfloat16()  # rows of very different scales
    x[3] = 0  # a padded row
    full = layer(x)
    ref = reference_linear(x, layer.qweight, layer.scale, lin.bias)
    assert full.dtype == torch.bfloat16 and torch.equal(full, ref)
    for rows in (slice(0, 1), slice(5, 8), slice(10, 27), slice(1, 70)):  # 1 row, a tree, > 16 rows
        assert torch.equal(layer(x[rows]), full[rows])
    close = lin(x).float()
    assert ((full.float() - close).norm() / close.norm()) < 0.03  # and it is still the layer it replaced


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_quantize_and_epilogue_are_the_torch_ops_bit_for_bit(dtype):
    from adaptivespec.fastpath.int8 import scale_rows

    torch.manual_seed(1)
    x = (torch.randn(37, 576) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[5] = 0
    smooth = torch.rand(576) + 0.5
    for s in (None, smooth):
        q0, a0 = quantize_rows(x, s)
        q1, a1 = quantize_rows(x, s, native.ops())
        assert torch.equal(q0, q1) and torch.equal(a0, a1)
    y, bias = torch.randn(37, 960), torch.randn(960)
    for b in (None, bias):
        assert torch.equal(scale_rows(y.clone(), a0, b, dtype), scale_rows(y.clone(), a0, b, dtype, native.ops()))


@needs_native
def test_invariant_attention_is_attention_and_ignores_masked_and_trailing_keys():
    """Against SDPA in float32; a row's output identical alone, among other rows, with masked keys
    interleaved before its own and unused keys after them."""
    torch.manual_seed(2)
    H, Hkv, D, S = 9, 3, 64, 40
    q = torch.randn(1, H, 6, D)
    k, v = torch.randn(1, Hkv, S + 10, D), torch.randn(1, Hkv, S + 10, D)
    ops = native.ops()
    limit = torch.arange(S - 6, S)
    causal = ops.attend(q[0], k[0, :, :S], v[0, :, :S], None, S - 6, limit, D ** -0.5)  # [6, H * D]
    mask = torch.ones(6, S, dtype=torch.bool).tril(S - 6)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(causal, want[0].transpose(0, 1).reshape(6, H * D), atol=1e-5, rtol=1e-5)
    last = ops.attend(q[0, :, 5:], k[0, :, :S], v[0, :, :S], None, S, None, D ** -0.5)  # alone, every key
    assert torch.equal(last, causal[5:])
    # the same keys with 10 masked ones put between the first S - 6 and the rest, and keys after them
    order = torch.cat([torch.arange(S - 6), torch.arange(S, S + 10), torch.arange(S - 6, S)])
    k2, v2 = k[:, :, order], v[:, :, order]
    vis = torch.zeros(6, S + 10, dtype=torch.bool)
    vis[:, : S - 6] = True
    vis[:, S + 4:] = torch.ones(6, 6, dtype=torch.bool).tril()
    spread = ops.attend(q[0], k2[0], v2[0], vis, S - 6, None, D ** -0.5)
    assert torch.equal(spread, causal)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_activation_scales_are_slices_summed_in_order(groups):
    """A scale per row and per slice of K: each slice's exact int8 product, scaled, added in slice order."""
    from adaptivespec.fastpath.int8 import reference_products

    torch.manual_seed(groups)
    lin = torch.nn.Linear(1536, 96, bias=False).bfloat16()
    layer = Int8Linear(lin, groups=groups)
    x = (torch.randn(20, 1536) * 3).bfloat16()
    x[:, :10] *= 50  # an outlier slice: the other slices keep their resolution
    k = 1536 // groups
    q, amax = quantize_rows(x.float().view(20 * groups, k))
    q, amax = q.view(20, groups, k), amax.view(20, groups)
    want = None
    for g in range(groups):
        part = reference_products(q[:, g], layer.qweight[:, g * k:(g + 1) * k], layer.scale / 127.0).mul_(amax[:, g:g + 1])
        want = part if want is None else want.add_(part)
    full = layer(x)
    assert torch.equal(full, want.to(torch.bfloat16))
    assert torch.equal(layer(x[7:8]), full[7:8]) and torch.equal(layer(x[3:19]), full[3:19])
    one = Int8Linear(lin)(x).float()
    close = lin(x).float()
    assert (full.float() - close).norm() < (one - close).norm()  # finer scales, closer to the float layer


def test_the_largest_sums_are_exact():
    """Every product at +-127 x +-127: sums far beyond float32's 2^24 still match int64 arithmetic."""
    k, n = 1536, 64
    qweight = torch.full((n, k), 127, dtype=torch.int8)
    qweight[1::2] = -127
    kernel = Int8Weight(qweight, torch.ones(n))
    x = torch.full((4, k), 3.0, dtype=torch.bfloat16)
    x[1] = -3.0
    acc = torch.full((4, n), 127 * 127 * k, dtype=torch.int64)
    acc[1] *= -1
    acc[:, 1::2] *= -1
    want = (acc.to(torch.float32) * (1.0 / 127.0) * 3.0).to(torch.bfloat16)  # what the epilogue does: float(acc) * sw/127 * max|x|
    assert torch.equal(kernel(x), want)


def _saturating_check() -> str:
    """Sums whose u8 x s8 pairs overflow int16 (activations quantized to 1 or 255, weights +-127 of one
    sign: 2 x 255 x 127 = 64,770), at few and many rows, whole and in slices of K: this machine's kernel
    equals the exact reference bit for bit. Returns the kernel's name."""
    torch.manual_seed(7)
    k, n = 1536, 96
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    qweight[:16], qweight[16:32] = 127, -127
    x = torch.randn(40, k).sign() * 2.0  # every element at +-max|x|: q is 1 or 255
    x[5:10] = x[5:10].abs()  # rows of one sign: every pair of products at 255 x 127 with the +127 columns
    x[10:20] += torch.randn(10, k) * 0.3  # and some rows of ordinary values
    x = x.bfloat16()
    for groups in (1, 3):
        kernel = Int8Weight(qweight, torch.rand(n) + 0.5, torch.randn(n), groups=groups)
        q, amax = kernel.quantize(x)
        want = None
        for g in range(groups):
            s = slice(g * k // groups, (g + 1) * k // groups)
            part = reference_products(q[:, s], qweight[:, s], kernel.scale).mul_(amax[:, g:g + 1])
            want = part if want is None else want.add_(part)
        want = want.add_(kernel.bias).to(torch.bfloat16)
        for rows in (slice(0, 1), slice(4, 9), slice(0, 16), slice(0, 40)):  # ours, and oneDNN's beyond 16 on VNNI
            assert torch.equal(kernel(x[rows]), want[rows]), (kernel.kernel, groups, rows)
    return kernel.kernel


def test_sums_that_saturate_int16_pairs_are_exact_on_this_machines_kernel():
    assert _saturating_check() == kernel_name(native.ops())


def test_sums_that_saturate_int16_pairs_are_exact_under_the_avx2_cap():
    """The same check in a process capped at AVX2 (torch and oneDNN too): our AVX2 kernel where it builds,
    exact float32 slices where not; never oneDNN's AVX2 int8, whose pairs saturate."""
    script = f"import runpy; print(runpy.run_path({str(Path(__file__))!r})['_saturating_check']())"
    out = subprocess.run([sys.executable, "-c", script], env=hardware.capped_env("avx2"), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == ("avx2" if native.ops() is not None else "float")


@pytest.mark.skipif(hardware.missing("vnni") is not None, reason=str(hardware.missing("vnni")))
def test_onednn_int8_is_exact_with_vnni():
    """Where the CPU has VNNI oneDNN's ``qlinear`` (our kernel's partner beyond 16 rows) sums exactly."""
    if kernel_name(native.ops()) != "vnni":
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(3)
    kernel = Int8Weight(torch.randint(-127, 128, (64, 1536), dtype=torch.int8), torch.ones(64))
    q = torch.randint(0, 256, (20, 1536), dtype=torch.uint8)
    q[:4] = 255
    assert torch.equal(kernel.products(q), reference_products(q, kernel.qweight, kernel.scale))


def test_float_kernel_slices_k_where_float32_sums_would_round():
    """A 1536-deep row of 127 x 127 products sums to 24,774,144 > 2^24: one float32 matmul rounds it, the
    ``float`` kernel's slices of at most FLOAT_EXACT_K (each below 2^24, added in int32) do not."""
    assert FLOAT_EXACT_K * 127 * 127 < 2 ** 24
    qweight = torch.full((16, 1536), 127, dtype=torch.int8)
    qweight[:, ::7] = -127
    q = torch.full((3, 1536), 255, dtype=torch.uint8)
    q[1, 1::2] = 1
    w = qweight.float().t().contiguous()
    slices = [w[i:i + FLOAT_EXACT_K] for i in range(0, 1536, FLOAT_EXACT_K)]
    scale = torch.ones(16)
    assert torch.equal(float_products(q, slices, scale), reference_products(q, qweight, scale))


def test_keep_leaves_layers_in_float_and_whole_fused_groups():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(8, 8) for _ in range(4))

    model = torch.nn.Module()
    model.config = type("C", (), {"tie_word_embeddings": True})()
    model.attn = Attn()
    model.lm_head = torch.nn.Linear(8, 16, bias=False)
    done = quantize_linears(model, keep=["k_proj"])
    assert sorted(done) == ["attn.o_proj", "lm_head"]  # k_proj kept q and v with it
    assert type(model.attn.q_proj) is torch.nn.Linear and isinstance(model.attn.o_proj, Int8Linear)
    assert model.config.tie_word_embeddings is False and quantization_of(model) == "int8"


def test_config_key_and_cost_table_key():
    dtype = hardware.auto_dtype()  # the configs say runtime.dtype: auto
    cfg = load_config(ROOT / "configs" / "ar-int8.yaml")
    assert cfg.runtime.quantization == "int8" and cfg.runtime.precision == f"int8-{dtype}-groups-down_proj=4-lm_head=3"
    assert cfg.runtime.groups == {"down_proj": 4, "lm_head": 3}
    assert load_config(ROOT / "configs" / "ar.yaml").runtime.precision == dtype
    kept = load_config(ROOT / "configs" / "ar.yaml", overrides=["runtime.quantization=int8", "runtime.quantization_keep=[lm_head]"])
    assert kept.runtime.precision == f"int8-{dtype}-keep-lm_head"


# -- the int8 target on the real model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_int8():
    from adaptivespec.models import load_target

    return load_target("smollm2-135m-instruct", hardware.auto_dtype(), quantization="int8",  # the configs' dtype: auto
                       groups={"down_proj": 4, "lm_head": 3})


@pytest.mark.model
def test_fused_projections_compute_what_each_layer_computes_alone(smol_int8):
    """The fused forward's q|k|v and gate|up matmuls (one int8 weight each) give, bit for bit, the
    separate int8 layers' outputs side by side: the fused forward is the int8 model it was built from."""
    from adaptivespec.fastpath.forward import fast_forward

    model, _ = smol_int8
    ff = fast_forward(model)
    assert ff is not None and ff.quantization == "int8"
    attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    x = (torch.randn(5, model.config.hidden_size) * 4).to(model.dtype)
    fused = ff.layers[3]
    assert torch.equal(fused.qkv(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1))
    assert torch.equal(fused.gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))
    assert torch.equal(ff.logits(x), model.lm_head(x))


@needs_native
@pytest.mark.model
def test_fused_forward_rows_do_not_depend_on_the_forward_they_run_in(smol_int8):
    """The same positions' logits from one prefill, a row at a time, and a masked chunk: identical bits."""
    from adaptivespec.fastpath.forward import fast_forward
    from adaptivespec.fastpath.kvcache import buffered_cache
    from adaptivespec.models import encode_prompt

    model, tok = smol_int8
    ff = fast_forward(model)
    for text in ("Write a Python function that returns the factorial of n.", "Name three primary colors."):
        ids = torch.tensor([encode_prompt(tok, text)])
        n, tail = ids.shape[1], 8
        whole = ff(ids, buffered_cache(model.config, 256)).logits[0, n - tail:]
        cache = buffered_cache(model.config, 256)
        ff(ids[:, : n - tail], cache)
        one = torch.stack([ff(ids[:, i:i + 1], cache).logits[0, 0] for i in range(n - tail, n)])
        cache = buffered_cache(model.config, 512)
        ff(ids[:, : n - tail], cache)
        mask = torch.zeros(1, 1, tail, 512, dtype=torch.bfloat16)
        mask[0, 0, :, n - tail:n].masked_fill_(~torch.ones(tail, tail, dtype=torch.bool).tril(), torch.finfo(torch.bfloat16).min)
        chunk = ff(ids[:, n - tail:], cache, attention_mask=mask).logits[0]  # an additive mask over a wider cache
        assert torch.equal(whole, one) and torch.equal(chunk, one)


TEXTS = [
    "Write a Python function that returns the factorial of n.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Summarize in one sentence: The committee met on Tuesday to review the budget for next year and "
    "agreed to raise spending on roads while cutting administrative costs.",
    "Name three primary colors.",
]
N = 32


@pytest.fixture(scope="module")
def int8_greedy():
    """prompt text -> (prompt ids, the int8 target's greedy tokens: ``ar-int8.yaml`` alone)."""
    from adaptivespec.decode import Engine

    engine = Engine(load_config(ROOT / "configs" / "ar-int8.yaml"))
    return {text: (ids, engine.generate_ids(ids, max_new_tokens=N).token_ids)
            for text, ids in ((t, engine.encode(t)) for t in TEXTS)}


@needs_native
@pytest.mark.model
@pytest.mark.parametrize("name", ["hybrid-int8.yaml", "eagle3.yaml", "adaptivespec-dynamic.yaml"])
def test_strict_speculation_alone_is_the_int8_targets_greedy(name, int8_greedy):
    """In bfloat16 with int8 matmuls, not only float32: token for token."""
    from adaptivespec.decode import Engine

    engine = Engine(load_config(ROOT / "configs" / name, overrides=[
        "runtime.quantization=int8", "runtime.quantization_groups=[down_proj=4,lm_head=3]"]))
    assert engine.lossless
    forwards = tokens = 0
    for ids, ref in int8_greedy.values():
        got = engine.generate_ids(ids, max_new_tokens=N)
        assert got.token_ids == ref
        forwards, tokens = forwards + got.stats["target_forwards"], tokens + len(got.token_ids)
    assert tokens / forwards > 1.3  # drafts were accepted: the trees really ran through the int8 forward


@needs_native
@pytest.mark.model
@pytest.mark.parametrize("pinned", [True, False])
def test_every_request_of_an_int8_batch_is_the_int8_targets_greedy_alone(pinned, int8_greedy):
    """batched-hybrid-int8 with more requests than lanes, later ones joining mid-generation, every step
    drafting (pinned) or as the budget decides: each request's tokens are ``ar-int8``'s alone, and the
    same requests again (their prompts now in the prefix cache) give the same tokens."""
    from adaptivespec.batch import BatchEngine, CostTable, Request

    costs = CostTable(rows=(1, 512), verify_short=(20.0, 275.5), verify_long=(20.0, 275.5), contexts=(128, 1024),
                      per_request=0.1, draft_rows=(1, 128), draft=(0.5, 0.5), machine={"cpu": "synthetic"})
    be = BatchEngine(load_config(ROOT / "configs" / "batched-hybrid-int8.yaml"), slots=3, context_length=256,
                     costs=costs, log=lambda _: None)
    if pinned:
        be.budget.speculate = lambda *a, **k: setattr(be.budget, "mode", True) or True
    refs = list(int8_greedy.values())
    for _ in range(2):
        reqs = [be.submit(Request(prompt=list(ids), max_new_tokens=N)) for ids, _ in refs[:2]]
        for _ in range(3):
            be.step()
        reqs += [be.submit(Request(prompt=list(ids), max_new_tokens=N)) for ids, _ in refs[2:]]
        steps = 0
        while be.busy:
            be.step()
            steps += 1
            assert steps < 800
        assert [r.out for r in reqs] == [ref for _, ref in refs]
        if pinned:
            assert sum(len(r.out) for r in reqs) / sum(r.forwards for r in reqs) > 1.3
