"""The fused bfloat16 forward of Llama-layout targets (:mod:`adaptivespec.fastpath.forward`).

With torch's own ops (oneDNN matmuls) it must reproduce transformers' forward bit for bit: prefill,
one-token steps, tree verification with a mask, hidden states; with SGLang's CPU kernels (only where
``sgl_kernel`` imports) it must agree to bfloat16 rounding. float32: tests/test_fast_float32.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaptivespec.fastpath import forward as fastforward
from adaptivespec.fastpath.forward import FastLlama, fast_forward, sgl_ops, supported
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.fastpath.native import ATTENTION_ENV
from adaptivespec.fastpath.prepack import can_prepack

from test_fastpath import tree_mask


def tiny(dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, **kw)
    model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    return model


def needs_prepack(model):
    if not can_prepack(model):
        pytest.skip("oneDNN is not available in this torch build (or the bf16 fast path is off)")


@torch.inference_mode()
def trace(forward, model):
    """Logits and hidden states of a prefill, a one-token step, a tree step and an unmasked 3-row step."""
    torch.manual_seed(1)
    ids = torch.randint(0, 320, (1, 17))
    cache = buffered_cache(model.config, capacity=64)
    out = [forward(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)]
    out.append(forward(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True, logits_to_keep=1))
    mask, pos = tree_mask(18, 5, model.dtype)
    out.append(forward(input_ids=torch.randint(0, 320, (1, 5)), attention_mask=mask, position_ids=pos, cache=cache,
                       use_cache=True, output_hidden_states=True))
    cache.crop(-5)
    out.append(forward(input_ids=torch.randint(0, 320, (1, 3)), cache=cache, use_cache=True))
    assert cache.get_seq_length() == 21
    return out


def test_onednn_fused_forward_is_bit_identical_to_transformers(monkeypatch):
    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=None)
    ref, got = trace(model, model), trace(ff, model)
    for r, g in zip(ref, got):
        assert g.logits.shape == r.logits.shape and g.logits.dtype == r.logits.dtype
        torch.testing.assert_close(g.logits, r.logits, rtol=0, atol=0)
        if r.hidden_states is not None:
            assert len(g.hidden_states) == len(r.hidden_states) == model.config.num_hidden_layers + 1
            for a, b in zip(g.hidden_states, r.hidden_states):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unmasked_rows_after_a_prefill_return_hidden_states(monkeypatch):
    """Several rows continuing a cached sequence without a given mask (the forward builds the
    causal one) and with hidden states requested: the same states and logits as transformers."""
    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=None)

    @torch.inference_mode()
    def run(forward):
        torch.manual_seed(2)
        cache = buffered_cache(model.config, capacity=64)
        forward(input_ids=torch.randint(0, 320, (1, 9)), cache=cache, use_cache=True)
        return forward(input_ids=torch.randint(0, 320, (1, 4)), cache=cache, use_cache=True, output_hidden_states=True)

    ref, got = run(model), run(ff)
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
    assert len(got.hidden_states) == len(ref.hidden_states) == model.config.num_hidden_layers + 1
    for a, b in zip(got.hidden_states, ref.hidden_states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sgl_kernel_fused_forward_agrees_to_bfloat16_rounding():
    sgl = sgl_ops()
    if sgl is None:
        pytest.skip("sgl_kernel (SGLang's CPU kernels) is not installed here")
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=sgl)
    assert ff.backend == "sgl_kernel"
    for r, g in zip(trace(model, model), trace(ff, model)):
        torch.testing.assert_close(g.logits.float(), r.logits.float(), rtol=0.05, atol=0.05)
        assert (g.logits.argmax(-1) == r.logits.argmax(-1)).float().mean() >= 0.9
        if r.hidden_states is not None:  # the fused add-norm works in place: recorded states must not move
            for a, b in zip(g.hidden_states, r.hidden_states):
                torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_fast_forward_applies_only_to_llama_on_cpu_and_can_be_switched_off(monkeypatch):
    assert supported(tiny(torch.float16)) is not None  # float16: neither the bf16 nor the float32 path
    assert fast_forward(tiny(torch.float32)) is not None  # float32: torch's ops (tests/test_fast_float32.py)
    model = tiny()
    needs_prepack(model)
    ff = fast_forward(model)
    assert ff is not None and fast_forward(model) is ff  # built once per model
    assert ff not in list(model.modules()) and not any("fastforward" in k for k in model.state_dict())
    monkeypatch.setenv(fastforward.DISABLE_ENV, "1")
    assert fast_forward(model) is None
    monkeypatch.delenv(fastforward.DISABLE_ENV)
    monkeypatch.setenv("ADAPTIVESPEC_NO_PREPACK", "1")
    assert fast_forward(model) is None
    assert fast_forward(tiny(torch.float32)) is not None  # float32 packs nothing: the switch is bf16's
    monkeypatch.delenv("ADAPTIVESPEC_NO_PREPACK")
    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    assert fast_forward(model).backend == "onednn"
    model.config.model_type = "gpt2"  # (Qwen2, Qwen3 and Mistral run it too: tests/test_architectures.py)
    assert fast_forward(model) is None and "Llama-layout" in supported(model)


def test_torch_runtime_decodes_the_same_tokens_with_and_without_the_fused_forward(monkeypatch):
    from adaptivespec.runtime import TorchRuntime

    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    model = tiny()
    needs_prepack(model)
    prompt = list(range(3, 20))

    def decode(rt):
        out = [rt.prefill(prompt, 16)]
        out += [rt.ar_step() for _ in range(12)]
        return out

    fast = TorchRuntime(model)
    assert fast.fast is not None and fast.forward is fast.fast
    monkeypatch.setenv(fastforward.DISABLE_ENV, "1")
    plain = TorchRuntime(model)
    assert plain.fast is None and plain.forward is model
    assert decode(fast) == decode(plain)


@pytest.mark.needs("onednn_bf16")  # oneDNN's bf16 weight reorder raises on an AVX2 CPU
@torch.inference_mode()
def test_packed_weight_matches_linear_on_either_kernel_and_falls_back_for_shapes_sgl_refuses():
    from adaptivespec.fastpath.prepack import PackedWeight

    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not available in this torch build")
    torch.manual_seed(0)
    for out_features, in_features, rows, bias in [(64, 128, 1, False), (96, 64, 5, True), (300, 96, 2, True)]:
        w = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.1
        b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        for sgl in {None, sgl_ops()}:
            pw = PackedWeight(w, b, sgl)
            if out_features == 300:
                assert pw.sgl is None  # sgl_kernel's blocks refuse 300 output features: oneDNN instead
            y = pw(x)
            assert y.shape == (rows, out_features) and y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), ref, rtol=0.02, atol=0.05)


def test_folded_tree_attention_is_bit_identical_to_transformers(monkeypatch):
    """Query heads folded into rows (long-context tree attention) compute the same outputs."""
    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    monkeypatch.setattr(fastforward, "FOLD_MIN_KEYS", 1)  # fold at this test's short context
    folds = []
    fold = fastforward._fold_mask
    monkeypatch.setattr(fastforward, "_fold_mask", lambda *a: folds.append(fold(*a)) or folds[-1])
    model = tiny()
    needs_prepack(model)
    ref, got = trace(model, model), trace(FastLlama(model, sgl=None), model)
    # the tree step and the 3-row step over the cache; not the prefill (causal) or the one-row step
    assert [f is not None for f in folds] == [False, False, True, True]
    for r, g in zip(ref, got):
        assert torch.equal(g.logits, r.logits)


@torch.inference_mode()
def test_fold_mask_gives_grouped_attention_over_a_long_cache():
    torch.manual_seed(0)
    heads, kv_heads, n, keys = 9, 3, 6, 1500
    q = torch.randn(1, heads, n, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, kv_heads, keys, 64, dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, n, keys, dtype=torch.bfloat16)
    mask[..., keys - n:] = torch.full((n, n), float("-inf")).triu(1)
    folded = fastforward._fold_mask(mask, n, heads // kv_heads, keys)
    assert folded.shape == (1, 1, 3 * n, keys)
    got = torch.nn.functional.scaled_dot_product_attention(q.reshape(1, kv_heads, 3 * n, 64), k, v, attn_mask=folded)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(got.view(1, heads, n, 64), ref)
    # where it does not pay, or does not apply, no fold
    assert fastforward._fold_mask(mask, n, 3, fastforward.FOLD_MIN_KEYS - 1) is None
    assert fastforward._fold_mask(mask, 25, 3, keys) is None  # 75 folded rows: no longer pays
    assert fastforward._fold_mask(None, n, 3, keys) is None and fastforward._fold_mask(mask, n, 1, keys) is None


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_chunk_after_a_prefix_attends_as_one_masked_call(dtype, tol):
    """attend_after_prefix (the prefix with heads folded into rows, the chunk causal, merged by
    log-sum-exp) against one masked SDPA call over every key, in float32 for the reference."""
    if fastforward._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash-attention kernel")
    torch.manual_seed(3)
    past, n = 1100, 70
    q = torch.randn(1, 9, n, 64)
    k, v = torch.randn(1, 3, past + n, 64), torch.randn(1, 3, past + n, 64)
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = fastforward.attend_after_prefix(q.to(dtype), k.to(dtype), v.to(dtype), past)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


def test_a_chunked_prefill_through_the_fused_forward_follows_transformers(monkeypatch):
    """A prompt prefilled in chunks (the later ones through attend_after_prefix, its thresholds
    lowered to this tiny model): transformers' chunked logits and hidden states to bfloat16 rounding."""
    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    if fastforward._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash-attention kernel")
    monkeypatch.setattr(fastforward, "FOLD_MIN_KEYS", 16)
    monkeypatch.setattr(fastforward, "SPLIT_MIN_ROWS", 8)
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=None)
    calls = []
    real = fastforward.attend_after_prefix
    monkeypatch.setattr(fastforward, "attend_after_prefix", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    @torch.inference_mode()
    def run(forward):
        torch.manual_seed(4)
        ids = torch.randint(0, 320, (1, 60))
        cache = buffered_cache(model.config, capacity=64)
        return [forward(input_ids=ids[:, s:s + 20], cache=cache, use_cache=True, output_hidden_states=True)
                for s in range(0, 60, 20)]

    ref, got = run(model), run(ff)
    assert calls == [20] * 3 + [40] * 3  # the second and third chunks, in each of the 3 layers
    for r, g in zip(ref, got):
        torch.testing.assert_close(g.logits.float(), r.logits.float(), rtol=0, atol=0.05)
        assert (g.logits.argmax(-1) == r.logits.argmax(-1)).float().mean() >= 0.95
