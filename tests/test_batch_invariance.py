"""The bfloat16 forward is batch-invariant where the CPU has AVX512-BF16: a token's logits have the same
bits whether its row runs alone, in a prefill chunk, in a tree among siblings or beside other requests.

The pieces: the fixed-order linear (``fastpath/csrc/bf16_linear.cpp``) against float32 and against
itself at every row count; the probe that sends a shape to it when oneDNN rounds a row by its
neighbours; the fused forward with every linear on it (the probe forced) and with the probe's own
choice. The attention kernel's own invariance: tests/test_attention_kernel.py. Seeds through the
engines on the real model in bfloat16: tests/test_one_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from adaptivespec.fastpath import native, prepack
from adaptivespec.fastpath.forward import FastLlama
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.tree import ancestor_matrix

from test_fastforward import needs_prepack, tiny

LINEAR = native.linear_ops()
ATTENTION = native.attention_ops()
pytestmark = pytest.mark.skipif(LINEAR is None or ATTENTION is None,
                                reason=f"no bf16 kernels here: {native.attention_why_not()}")


@pytest.mark.parametrize("n,k", [(576, 1536), (960, 576), (70, 33), (16, 2)])
def test_the_fixed_order_linear_matches_float32_and_gives_each_row_one_result(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(70, k, generator=gen).bfloat16()
    packed = LINEAR.pack_linear(w)
    got = LINEAR.linear_bf16(x, packed, n, bias)
    ref = x.float() @ w.float().T + bias
    assert got.dtype == torch.bfloat16 and got.shape == (70, n)
    torch.testing.assert_close(got.float(), ref, rtol=0.01, atol=0.01)
    alone = torch.cat([LINEAR.linear_bf16(x[i:i + 1], packed, n, bias) for i in range(70)])
    for m in (2, 3, 5, 7, 13, 24, 70):
        assert torch.equal(LINEAR.linear_bf16(x[:m], packed, n, bias), alone[:m]), f"{m} rows"
    strided = torch.zeros(70, k + 6, dtype=torch.bfloat16)[:, 2:k + 2]  # a view: rows apart by more than k
    strided.copy_(x)
    assert torch.equal(LINEAR.linear_bf16(strided, packed, n, bias), alone)


def test_a_shape_oneDNN_rounds_by_row_count_goes_to_the_fixed_kernel(monkeypatch):
    w = torch.randn(48, 64).bfloat16()
    monkeypatch.setattr(prepack, "rows_invariant", lambda matmul, backend, k: False)
    fixed = prepack.PackedWeight(w, None, None, invariant=True)
    assert fixed.fixed is not None
    monkeypatch.setattr(prepack, "rows_invariant", lambda matmul, backend, k: True)
    assert prepack.PackedWeight(w, None, None, invariant=True).fixed is None
    assert prepack.PackedWeight(w, None, None).fixed is None  # not asked: oneDNN as before
    x = torch.randn(9, 64).bfloat16()
    torch.testing.assert_close(fixed(x).float(), x.float() @ w.float().T, rtol=0.01, atol=0.02)


def test_the_probe_finds_a_matmul_invariant_or_not_by_comparing_rows():
    w = torch.randn(96, 64).bfloat16()
    onednn = prepack.PackedWeight(w)
    verdict = prepack.rows_invariant(onednn, "onednn", 64)
    assert isinstance(verdict, bool)
    assert prepack._VERDICTS[("onednn", 96, 64, torch.get_num_threads())] is verdict  # once per shape, threads

    class RowCount:  # a matmul that rounds by the number of rows: found out
        out_features = 96

        def __call__(self, x):
            return onednn(x) + (x.shape[0] > 11) * 0.5

    assert prepack.rows_invariant(RowCount(), "test-rowcount", 64) is False
    assert prepack.rows_invariant(prepack.PackedWeight(w.T.contiguous().T.contiguous()), "test-onednn", 64) is verdict


@torch.inference_mode()
def _logits_three_ways(ff, model, past: int = 12):
    """A 24-token sequence's logits: one prefill; chunks of 10 and 7 then one token at a time; and a
    prefill of ``past`` then a tree in which the sequence's next 5 tokens are a chain among siblings (past
    12: the chain's fourth token sits in the next 16-key block in the tree's slots, not in the sequence's)."""
    torch.manual_seed(3)
    ids = torch.randint(0, 320, (1, 24))
    whole = ff(input_ids=ids, cache=buffered_cache(model.config, capacity=64), use_cache=True).logits[0]
    cache = buffered_cache(model.config, capacity=64)
    parts = [ff(input_ids=ids[:, :10], cache=cache, use_cache=True).logits[0],
             ff(input_ids=ids[:, 10:17], cache=cache, use_cache=True).logits[0]]
    parts += [ff(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0] for i in range(17, 24)]
    steps = torch.cat(parts)
    cache = buffered_cache(model.config, capacity=64)
    ff(input_ids=ids[:, :past], cache=cache, use_cache=True)
    # nodes: the chain 0, 1, 3, 5, 7 (the sequence's next 5 tokens) with a sibling beside each of its first three
    # children (2, 4, 6) and a grandchild of a sibling (8), in level order as drafted trees are
    parents = [-1, 0, 0, 1, 1, 3, 3, 5, 2]
    chain = [0, 1, 3, 5, 7]
    tokens = torch.randint(0, 320, (len(parents),))
    tokens[chain] = ids[0, past:past + 5]
    n = len(parents)
    allowed = ancestor_matrix(torch.tensor(parents), n)
    mask = torch.zeros(1, 1, n, past + n, dtype=torch.bfloat16)
    mask[0, 0, :, past:].masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
    depth = allowed.sum(1) - 1
    tree = ff(input_ids=tokens[None], attention_mask=mask, position_ids=(past + depth)[None], cache=cache,
              use_cache=True).logits[0]
    return whole[past:past + 5], whole, steps, tree[chain]


def test_the_forward_gives_a_token_the_same_logits_however_it_is_batched(monkeypatch):
    model = tiny()
    needs_prepack(model)
    monkeypatch.setattr(prepack, "rows_invariant", lambda matmul, backend, k: False)  # every linear: the fixed kernel
    ff = FastLlama(model, sgl=None)
    assert ff.kernel is not None and ff.layers[0].down.fixed is not None
    chain, whole, steps, tree = _logits_three_ways(ff, model)
    assert torch.equal(whole, steps)
    assert torch.equal(chain, tree)


def test_with_the_probes_own_choice_the_forward_is_batch_invariant_too():
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=None)
    chain, whole, steps, tree = _logits_three_ways(ff, model)
    assert torch.equal(whole, steps)
    assert torch.equal(chain, tree)
