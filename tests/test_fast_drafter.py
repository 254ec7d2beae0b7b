"""The fused bfloat16 inference path of the EAGLE-3 head (:mod:`adaptivespec.fastpath.drafter`).

On the shipped head, over a prefill, two tree levels with masks and a commit-like extension: with
torch's own ops it must reproduce the modules' outputs (states, log-probabilities, cache) bit for bit;
with SGLang's CPU kernels (only where ``sgl_kernel`` imports) agree to bfloat16 rounding. float32
heads (``runtime.dtype: auto`` on a CPU without fast bf16) take it with torch's ops, to float32 rounding;
it must never serve weights older than the head's (training, loads).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adaptivespec.fastpath import drafter as fastdrafter
from adaptivespec.drafter import Eagle3Drafter
from adaptivespec.fastpath.drafter import fast_drafter
from adaptivespec.fastpath.native import ATTENTION_ENV
from adaptivespec.fastpath.prepack import NO_SGL_ENV, can_prepack, sgl_ops

pytestmark = pytest.mark.model  # loads the embedded target


class EmbeddingOnly(nn.Module):
    """What a head needs of its target: the config and the token embedding (here in bfloat16)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.config = target.config
        self.embed = nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().bfloat16())

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed


@pytest.fixture(scope="module")
def target16(smol32):
    return EmbeddingOnly(smol32[0])


def head(target, dtype=torch.bfloat16) -> Eagle3Drafter:
    d = Eagle3Drafter.from_pretrained("embedded", target, dtype)
    if dtype == torch.bfloat16 and not can_prepack(d):
        pytest.skip("oneDNN is not available in this torch build (or the bf16 fast path is off)")
    return d


def tree_level(parent_slots: list[int], past: int, base: int, neg: float, dtype=torch.bfloat16) -> torch.Tensor:
    """Additive mask [1, 1, b, past + b] of a tree level whose nodes hang below drafter slots
    ``parent_slots`` (-1: the root) of the ``past - base`` drafted since ``base`` (two levels deep
    at most); each node sees the context, itself and its parent."""
    b, used = len(parent_slots), past - base
    allowed = torch.zeros(b, used + b, dtype=torch.bool)
    allowed[range(b), range(used, used + b)] = True
    for i, p in enumerate(parent_slots):
        allowed[i, p] = p >= 0
    mask = torch.zeros(1, 1, b, past + b, dtype=dtype)
    mask[0, 0, :, base:].masked_fill_(~allowed, neg)
    return mask


@torch.inference_mode()
def trace(d: Eagle3Drafter) -> list[torch.Tensor]:
    """Every output of a decoding step's drafter work: prefill, two tree levels, commit of 3 tokens."""
    g = torch.Generator().manual_seed(0)
    P, H, V = 40, d.target_hidden, d.config.vocab_size
    dt = d.lm_head.weight.dtype
    neg = torch.finfo(dt).min
    hidden = tuple(torch.randn(1, P, H, generator=g).to(dt) for _ in range(31))
    d.reset_cache(16)  # grows on the way
    state = d.fuse(hidden)[0]
    outs = d.step(torch.randint(0, V, (P,), generator=g), state, torch.arange(P), None)
    root = outs[-1]
    got = [state, outs, d.log_probs(root)]
    level1 = d.step(torch.randint(0, V, (4,), generator=g), root.expand(4, -1), torch.full((4,), P),
                    tree_level([-1] * 4, P, P, neg, dt))
    got += [level1, d.log_probs(level1)]
    level2 = d.step(torch.randint(0, V, (4,), generator=g), level1[[0, 0, 1, 2]], torch.full((4,), P + 1),
                    tree_level([0, 0, 1, 2], P + 4, P, neg, dt))
    got += [level2, d.log_probs(level2)]
    d.length = P  # commit: drop the draft slots, run the accepted pairs
    verified = tuple(torch.randn(1, 8, H, generator=g).to(dt) for _ in range(31))
    accepted = d.fuse(verified, torch.tensor([0, 1, 5]))[0]
    ext = d.step(torch.randint(0, V, (3,), generator=g), accepted, P + torch.arange(3), None)
    got += [accepted, ext, d.log_probs(ext[-1])]
    assert d.length == P + 3
    return got + [d._k[:, :, : d.length].clone(), d._v[:, :, : d.length].clone()]


def test_onednn_fused_drafter_is_bit_identical_to_the_modules(target16, monkeypatch):
    monkeypatch.setenv(NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    d = head(target16)
    assert d.fast is None  # only a runtime (or fast_drafter) enables it
    ref = trace(d)
    fast = fast_drafter(d)
    assert fast is d.fast and fast.backend == "onednn"
    got = trace(d)
    assert fast.params  # packed: the fused path ran
    assert len(got) == len(ref)
    for r, g in zip(ref[:-2], got[:-2]):  # states and log-probabilities
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.equal(g, r)
    for r, g in zip(ref[-2:], got[-2:]):  # the cache: bit for bit but for the 40-row prefill's keys / values,
        # where oneDNN blocks the Q|K|V matmul's reduction unlike the separate K and V ones (one ulp, a few elements)
        torch.testing.assert_close(g, r, rtol=2**-7, atol=0)
        assert (g != r).sum() <= 4 and torch.equal(g[:, :, 40:], r[:, :, 40:])


def test_sgl_kernel_fused_drafter_agrees_to_bfloat16_rounding(target16):
    sgl = sgl_ops()
    if sgl is None:
        pytest.skip("sgl_kernel (SGLang's CPU kernels) is not installed here")
    d = head(target16)
    ref = trace(d)
    assert fast_drafter(d).backend == "sgl_kernel"
    got = trace(d)
    assert len(got) == len(ref)
    for r, g in zip(ref, got):  # measured: at most 0.8 % (relative norm of the difference)
        assert g.shape == r.shape and g.dtype == r.dtype
        assert (g.float() - r.float()).norm() <= 0.02 * r.float().norm()
    for i in (2, 4, 6, 9):  # the draft distributions' top tokens
        assert torch.equal(got[i].argmax(-1), ref[i].argmax(-1))


def test_the_bf16_attention_kernel_in_the_fused_drafter_agrees_to_bfloat16_rounding(target16, monkeypatch):
    """With the bf16 attention kernel (AVX512-BF16 CPUs) the head's prompt pass, draft levels and
    extension attend through it: the modules' states and draft distributions to bfloat16 rounding."""
    from adaptivespec.fastpath.native import attention_ops, attention_why_not

    if attention_ops() is None:
        pytest.skip(f"no bf16 attention kernel here: {attention_why_not()}")
    monkeypatch.setenv(NO_SGL_ENV, "1")
    d = head(target16)
    ref = trace(d)
    fast = fast_drafter(d)
    assert fast.kernel is attention_ops()
    got = trace(d)
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert (g.float() - r.float()).norm() <= 0.02 * r.float().norm()
    for i in (2, 4, 6, 9):  # the draft distributions' top tokens
        assert torch.equal(got[i].argmax(-1), ref[i].argmax(-1))


def test_a_float32_head_runs_fused_on_torch_ops_to_float32_rounding(smol32, monkeypatch):
    """float32 (the dtype on an AVX2 CPU): the fused path, no SGLang or bf16 kernel, the modules' states,
    distributions and cache to float32 rounding, the same top tokens."""
    d32 = Eagle3Drafter.from_pretrained("embedded", smol32[0], torch.float32)
    ref = trace(d32)
    fast = fast_drafter(d32)
    assert fast is not None and fast is d32.fast
    got = trace(d32)
    assert fast.params and len(got) == len(ref)  # packed on first use: the fused path ran
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype == torch.float32
        assert (g - r).norm() <= 1e-4 * r.norm()
    for i in (2, 4, 6, 9):  # the draft distributions' top tokens
        assert torch.equal(got[i].argmax(-1), ref[i].argmax(-1))
    monkeypatch.setenv(fastdrafter.DISABLE_ENV, "1")
    assert fast_drafter(d32) is None and d32.fast is None


def test_the_switch_keeps_the_modules(target16, monkeypatch):
    d = head(target16)
    assert fast_drafter(d) is not None
    monkeypatch.setenv(fastdrafter.DISABLE_ENV, "1")
    assert fast_drafter(d) is None and d.fast is None  # switched off again
    monkeypatch.delenv(fastdrafter.DISABLE_ENV)
    assert fast_drafter(d) is not None
    d.float()
    assert d.fast is None  # a dtype change drops it


def test_fused_drafter_never_serves_stale_weights(target16, monkeypatch):
    monkeypatch.setenv(NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    d = head(target16)
    fast = fast_drafter(d)
    x = torch.randn(3, d.config.hidden_size).bfloat16()

    def both():
        """log-probs through the fused path and through the modules, from the weights as they are now."""
        with torch.inference_mode():
            got = d.log_probs(x)
            d.fast = None
            ref = d.log_probs(x)
            d.fast = fast
        return got, ref

    got, before = both()
    assert fast.params and torch.equal(got, before)
    d.train()  # training: no packed copies kept, autograd sees the modules
    assert not fast.params
    opt = torch.optim.SGD(d.parameters(), lr=1.0)
    d.log_probs(x)[:, :8].sum().backward()
    opt.step()
    d.eval()
    got, ref = both()
    assert torch.equal(got, ref) and not torch.equal(got, before)
    with torch.no_grad():  # in place, in eval mode: the version counters tell
        d.lm_head.weight.mul_(0.5)
    got, ref2 = both()
    assert torch.equal(got, ref2) and not torch.equal(got, ref)
    d.load_state_dict({k: v * 2 for k, v in d.state_dict().items() if k == "lm_head.weight"}, strict=False, assign=True)
    got, ref3 = both()
    assert torch.equal(got, ref3) and not torch.equal(got, ref2)


def test_folded_tree_levels_give_the_same_outputs(target16, monkeypatch):
    """The tree levels' attention with query heads folded into rows (long contexts) changes nothing."""
    from adaptivespec.fastpath import forward as fastforward

    monkeypatch.setenv(NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    d = head(target16)
    fast_drafter(d)
    monkeypatch.setattr(fastforward, "FOLD_MIN_KEYS", 10**9)
    ref = trace(d)
    monkeypatch.setattr(fastforward, "FOLD_MIN_KEYS", 1)  # fold at this test's 40-position context
    folds = []
    fold = fastdrafter._fold_mask
    monkeypatch.setattr(fastdrafter, "_fold_mask", lambda *a: folds.append(fold(*a)) or folds[-1])
    got = trace(d)
    assert [f is not None for f in folds] == [False, True, True, True]  # the levels and the 3-token commit
    for r, g in zip(ref, got):
        assert torch.equal(g, r)
