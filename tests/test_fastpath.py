"""The CPU fast path of the torch runtime: in-place KV cache, grouped tree attention, prepacked linears.

Each must leave the target's outputs unchanged: checked against transformers' own path on a small
random Llama with grouped-query attention (the embedded model's layout: more query than KV heads).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from adaptivespec.fastpath.attention import NAME, use_tree_sdpa
from adaptivespec.fastpath.kvcache import BufferedLayer, buffered_cache
from adaptivespec.fastpath.prepack import PackedLinear, can_prepack, prepack_linears
from adaptivespec.runtime import compact_cache


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)
    model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    return model


def tree_mask(past: int, n: int, dtype) -> torch.Tensor:
    """[1, 1, n, past + n]: every node sees the context and the nodes of a 2-branch tree above it."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~allowed, torch.finfo(dtype).min)
    depth = torch.tensor([int(allowed[i].sum()) - 1 for i in range(n)])
    return mask, (past + depth).unsqueeze(0)


@torch.inference_mode()
def test_buffered_cache_gives_dynamic_cache_logits_through_steps_crops_and_growth():
    model = tiny()
    ids = torch.randint(0, 300, (1, 20))
    a, b = DynamicCache(config=model.config), buffered_cache(model.config, capacity=8)  # grows twice
    assert all(isinstance(layer, BufferedLayer) for layer in b.layers)
    for cache in (a, b):
        model(input_ids=ids, cache=cache, use_cache=True)
    x = torch.randint(0, 300, (1, 5))
    mask, pos = tree_mask(20, 5, torch.float32)
    la = model(input_ids=x, attention_mask=mask, position_ids=pos, cache=a, use_cache=True).logits
    lb = model(input_ids=x, attention_mask=mask, position_ids=pos, cache=b, use_cache=True).logits
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    path = [0, 2, 4]  # keep a non-chain path: compaction writes through the views
    for cache in (a, b):
        compact_cache(cache, 20, path, torch.tensor(path), 5)
    assert b.get_seq_length() == a.get_seq_length() == 23
    for la_, lb_ in zip(a.layers, b.layers):
        torch.testing.assert_close(la_.keys, lb_.keys, rtol=0, atol=0)
    nxt = torch.randint(0, 300, (1, 1))
    torch.testing.assert_close(model(input_ids=nxt, cache=a, use_cache=True).logits,
                               model(input_ids=nxt, cache=b, use_cache=True).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected a negative number"):
        b.layers[0].crop(3)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_tree_attention_matches_transformers_sdpa(dtype):
    model = tiny(dtype)
    ids = torch.randint(0, 300, (1, 30))
    x = torch.randint(0, 300, (1, 7))
    mask, pos = tree_mask(30, 7, dtype)

    def run():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        tree = model(input_ids=x, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits
        return tree, model(input_ids=x[:, :1], cache=cache, use_cache=True).logits

    ref = run()
    use_tree_sdpa(model)
    assert model.config._attn_implementation == NAME
    for r, g in zip(ref, run()):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5 if dtype == torch.float32 else 0)


@torch.inference_mode()
def test_prepacked_linears_match_and_only_touch_bfloat16_cpu_models(monkeypatch):
    model = tiny(torch.float32)
    assert prepack_linears(model) == 0  # float32 is left as it is
    model = tiny(torch.bfloat16)
    if not can_prepack(model):
        pytest.skip("oneDNN is not available in this torch build")
    ids = torch.randint(0, 300, (1, 12))
    ref = model(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == 0  # already packed
    out = model(input_ids=ids).logits
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    lin = torch.nn.Linear(16, 8, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(lin)(x).float(), lin(x).float(), rtol=0.02, atol=0.02)
    monkeypatch.setenv("ADAPTIVESPEC_NO_PREPACK", "1")
    assert not can_prepack(tiny(torch.bfloat16))
