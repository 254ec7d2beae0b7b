"""The bfloat16 attention kernel (``fastpath/csrc/bf16_attention.cpp``) and the fused forward's use of it.

Against float32 SDPA on the same bfloat16 inputs, every case the forward sends it: a tree after a
committed prefix (its part of the mask), a causal chunk after cached keys, a fresh causal prompt, one
row seeing every key; grouped and ungrouped heads, head sizes 32 / 64 / 128, caches that are views
of a larger buffer, partial key blocks. It runs only where the CPU has AVX512-BF16 (the tests say
so and skip elsewhere); without it the forward keeps torch's SDPA (tests/test_fastforward.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaptivespec.fastpath import native
from adaptivespec.fastpath.forward import AttentionPlan, FastLlama

from test_fastforward import needs_prepack, tiny, trace

KERNEL = native.attention_ops()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no bf16 attention kernel here: {native.attention_why_not()}")


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool: node i sees itself and its ancestors (node 0 the root, parents before children)."""
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(torch.randint(0, i, (), generator=gen))
        vis[i] |= vis[p]
    return vis


def reference(q, keys, values, allowed, scale):
    """float32 SDPA of q [n, H, D] over keys / values [Hkv, S, D] under allowed [n, S] (None: all)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), keys[None].float(), values[None].float(),
                                         attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def inputs(n, S, heads, kv_heads, D, gen, spare=40):
    """q as the fused forward holds it (a view of a [n, heads + kv_heads, D] block) and the cache's
    keys / values as views of a larger buffer."""
    qk = torch.randn(n, heads + kv_heads, D, generator=gen).bfloat16() * 2
    kbuf = torch.randn(kv_heads, S + spare, D, generator=gen).bfloat16()
    vbuf = torch.randn(kv_heads, S + spare, D, generator=gen).bfloat16()
    return qk[:, :heads], kbuf[:, :S], vbuf[:, :S]


@pytest.mark.parametrize("heads,kv_heads,D", [(9, 3, 64), (4, 2, 32), (8, 8, 128), (2, 1, 64)])
@pytest.mark.parametrize("past,n", [(0, 4), (5, 1), (37, 3), (100, 16), (1000, 40)])
def test_a_tree_after_the_prefix_matches_sdpa(heads, kv_heads, D, past, n):
    gen = torch.Generator().manual_seed(past * 7 + n)
    q, k, v = inputs(n, past + n, heads, kv_heads, D, gen)
    vis = random_tree(n, gen)
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), vis], 1)
    got = KERNEL.attend_bf16(q, k, v, past, vis, False, D ** -0.5)
    assert got.shape == (n, heads * D) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v, allowed, D ** -0.5), rtol=0, atol=0.02)


@pytest.mark.parametrize("past,n", [(0, 1), (0, 70), (17, 5), (300, 33), (1024, 64)])
def test_a_causal_chunk_matches_sdpa(past, n):
    gen = torch.Generator().manual_seed(past + n)
    q, k, v = inputs(n, past + n, 9, 3, 64, gen)
    allowed = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    got = KERNEL.attend_bf16(q, k, v, past, None, True, 0.125)
    torch.testing.assert_close(got.float(), reference(q, k, v, allowed, 0.125), rtol=0, atol=0.02)


@pytest.mark.parametrize("S", [1, 16, 17, 500, 4100])
def test_one_row_over_every_key_matches_sdpa(S):
    gen = torch.Generator().manual_seed(S)
    q, k, v = inputs(1, S, 9, 3, 64, gen)
    got = KERNEL.attend_bf16(q, k, v, S, None, False, 0.125)
    torch.testing.assert_close(got.float(), reference(q, k, v, None, 0.125), rtol=0, atol=0.02)


def test_a_row_is_computed_from_its_own_keys_only():
    """A row's output does not change with the rows beside it: the same row alone, in a tree of 8,
    and with large-valued keys the row cannot see (masked keys contribute exactly nothing)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs(8, 208, 9, 3, 64, gen)
    vis = random_tree(8, gen)
    all_rows = KERNEL.attend_bf16(q, k, v, 200, vis, False, 0.125)
    k2, v2 = k.clone(), v.clone()
    hidden = ~vis[3]  # tree keys row 3 does not see: made huge
    k2[:, 200:][:, hidden] = 50
    v2[:, 200:][:, hidden] = 1000
    again = KERNEL.attend_bf16(q, k2, v2, 200, vis, False, 0.125)
    assert torch.equal(all_rows[3], again[3])


@pytest.mark.parametrize("past", [0, 7, 16, 29, 250, 1021])
def test_a_tree_row_has_the_bits_of_the_same_row_decoded_alone(past):
    """Batch-invariance, bit for bit: a tree node's row over the prefix and its ancestors (scattered among
    siblings' slots, several trees' worth of rows and threads beside it) equals the same query alone over
    the same keys laid out contiguously (the tokens accepted, one row's step), and equals it again as a
    row of a causal prefill chunk. What keeps a seed's sampled tokens the same whatever is decoded beside it."""
    gen = torch.Generator().manual_seed(past + 1)
    n, heads, kv_heads, D = 24, 9, 3, 64
    q, k, v = inputs(n, past + n, heads, kv_heads, D, gen)
    vis = random_tree(n, gen)
    tree = KERNEL.attend_bf16(q, k, v, past, vis, False, 0.125)
    for i in (0, 5, n - 1):
        path = vis[i].nonzero().flatten()  # ancestors then the node, in slot order
        kk = torch.cat([k[:, :past], k[:, past + path]], 1)
        vv = torch.cat([v[:, :past], v[:, past + path]], 1)
        alone = KERNEL.attend_bf16(q[i:i + 1], kk, vv, kk.shape[1] - 1, None, True, 0.125)
        assert torch.equal(tree[i], alone[0]), f"row {i}"
        rows = torch.cat([q[:1].expand(len(path) - 1, -1, -1), q[i:i + 1]])  # a chunk ending in the row
        chunk = KERNEL.attend_bf16(rows, kk, vv, past, None, True, 0.125)
        assert torch.equal(tree[i], chunk[-1]), f"row {i} in a chunk"


def test_a_slab_member_has_the_bits_it_has_alone():
    """attend_slab: each request's rows equal the same request's call alone (trees and causal chunks mixed)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, D, cap = 9, 3, 64, 300
    K = torch.randn(3, kv_heads, cap, D, generator=gen).bfloat16()
    V = torch.randn(3, kv_heads, cap, D, generator=gen).bfloat16()
    plan = [(0, 9, 0, 120, True), (9, 1, 1, 7, False), (10, 30, 2, 200, False)]  # first row, rows, slot, past, tree
    q = torch.randn(40, heads, D, generator=gen).bfloat16()
    masks, meta, off = [], [], 0
    for r0, n, slot, past, is_tree in plan:
        m = random_tree(n, gen) if is_tree else None
        meta.append([r0, n, slot, past, off if is_tree else -1])
        if is_tree:
            masks.append(m.flatten())
            off += n * n
    out = torch.zeros(40, heads * D, dtype=torch.bfloat16)
    flat = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    KERNEL.attend_slab(q, K, V, torch.tensor(meta), flat, 0.125, out)
    for (r0, n, slot, past, is_tree), m in zip(plan, [masks[0].view(9, 9), None, None]):
        alone = KERNEL.attend_bf16(q[r0:r0 + n], K[slot, :, :past + n], V[slot, :, :past + n], past,
                                   m if is_tree else None, not is_tree, 0.125)
        assert torch.equal(out[r0:r0 + n], alone)


def test_the_plan_sends_trees_chunks_rows_and_any_mask_to_the_kernel():
    n, past = 4, 50
    vis = random_tree(n, torch.Generator().manual_seed(0))
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), vis], 1)
    additive = torch.zeros(1, 1, n, past + n, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))
    tree = AttentionPlan.of(n, past, additive, 3, "cpu", kernel=KERNEL)
    # every row sees the prefix and the root: the kernel reads those unmasked, the mask after them
    assert tree.kernel is KERNEL and tree.shared == past + 1 and torch.equal(tree.visible, vis[:, 1:])
    assert AttentionPlan.of(64, 3000, None, 3, "cpu", kernel=KERNEL).causal
    one = AttentionPlan.of(1, 3000, None, 3, "cpu", kernel=KERNEL)
    assert one.kernel is KERNEL and not one.causal and one.visible is None
    allowed[1, 7] = False  # a row that does not see all of the prefix (a head's draft level): masked from key 7 on
    other = additive.clone().masked_fill_(~allowed, float("-inf"))
    plan = AttentionPlan.of(n, past, other, 3, "cpu", kernel=KERNEL)
    assert plan.shared == 7 and torch.equal(plan.visible, allowed[:, 7:])
    gen = torch.Generator().manual_seed(5)
    q, k, v = inputs(n, past + n, 9, 3, 64, gen)
    got = plan.attend_rows(q.transpose(0, 1)[None], k[None], v[None], past, None)
    torch.testing.assert_close(got.float(), reference(q, k, v, allowed, 0.125), rtol=0, atol=0.02)


def test_the_fused_forward_with_the_kernel_follows_transformers_to_bfloat16_rounding(monkeypatch):
    """Prefill, a one-token step, a tree with hidden states and an unmasked 3-row step through the
    kernel: transformers' logits and hidden states to bfloat16 rounding."""
    monkeypatch.setenv(native.ATTENTION_ENV, "0")
    model = tiny()
    needs_prepack(model)
    ff = FastLlama(model, sgl=None)
    assert ff.kernel is KERNEL
    calls = []
    real = KERNEL

    class Spy:
        def attend_bf16(self, *a):
            calls.append(a[3])
            return real.attend_bf16(*a)

    ff.kernel = Spy()
    ref, got = trace(model, model), trace(ff, model)
    assert len(calls) == 4 * model.config.num_hidden_layers  # every forward's every layer
    for r, g in zip(ref, got):
        torch.testing.assert_close(g.logits.float(), r.logits.float(), rtol=0.05, atol=0.05)
        if r.hidden_states is not None:
            for a, b in zip(g.hidden_states, r.hidden_states):
                torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_the_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(native.ATTENTION_ENV, "1")
    assert native.attention_ops() is None and "ADAPTIVESPEC_NO_ATTENTION_KERNEL" in native.attention_why_not()
    model = tiny()
    needs_prepack(model)
    assert FastLlama(model, sgl=None).kernel is None
