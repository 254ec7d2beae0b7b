"""A lean forward for Llama-layout targets on a CPU, bfloat16 or float32: the torch runtime's plain step, fused.

Llama-layout: Llama, Mistral, Qwen2 and Qwen3 (:data:`ARCHITECTURES`; full-attention layers only).

transformers' ``LlamaForCausalLM.forward`` runs ~15 small torch ops and as many Python module
calls per layer (mask creation, output records, kwargs plumbing, three projections for Q, K and V,
two for gate and up). At SmolLM2-135M's size a one-token step is ~30 ms, of which the linear
layers' matmuls are ~70 %; the rest is per-op and per-call overhead, paid 30 times. :class:`FastLlama`
computes the same function directly from the model's weights:

- one Q|K|V projection and one gate|up projection per layer (weights concatenated once; prepacked in
  bfloat16), i.e. 4 matmuls per layer instead of 7;
- RMSNorm as one fused op (``torch.nn.functional.rms_norm``, with the same bfloat16 rounding as
  transformers' ``LlamaRMSNorm``), rotary embedding of Q and K together, SwiGLU in place;
- grouped-query attention through ``scaled_dot_product_attention(enable_gqa=True)`` straight on the
  in-place cache's views (:mod:`adaptivespec.fastpath.kvcache`).

bfloat16 matmuls use oneDNN with prepacked weights (:mod:`adaptivespec.fastpath.prepack`) or, when SGLang's CPU
kernel package ``sgl_kernel`` imports (optional; ``scripts/install_sglang_cpu.sh``), its AMX
``weight_packed_linear``, RMSNorm and SwiGLU kernels, which carry much less fixed cost per call
than oneDNN's at one row. ``$ADAPTIVESPEC_NO_FASTFORWARD=1`` keeps transformers' forward,
``$ADAPTIVESPEC_NO_SGL_KERNEL=1`` keeps torch's ops; ``$ADAPTIVESPEC_NO_PREPACK=1`` turns the whole
bfloat16 fast path off.

float32 (what ``runtime.dtype: auto`` picks on CPUs without fast bf16, e.g. AVX2-only ones) runs the
same fused forward on torch's own ops only: MKL's sgemm on the concatenated weights, packed once
for one row (:class:`Float32Weight`), one-op RMSNorm, SDPA; nothing that needs AVX-512 or bf16 instructions, no
SGLang kernels. It agrees with transformers' forward to float32 rounding (~1e-5 on the logits), which
stays the reference (``$ADAPTIVESPEC_NO_FASTFORWARD=1`` runs it; tests compare greedy output with it).

The output has transformers' meaning: ``logits`` ``[1, k, V]`` (the last ``logits_to_keep`` rows, all
when 0) and, on request, ``hidden_states`` (embeddings, each layer's output, the last one normed).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from adaptivespec.fastpath import native
from adaptivespec.fastpath.int8 import Int8Linear, Int8Weight, quantization_of
from adaptivespec.fastpath.prepack import NO_SGL_ENV, PackedWeight, can_prepack, sgl_ops  # noqa: F401
from adaptivespec.models import attention_unsupported

DISABLE_ENV = "ADAPTIVESPEC_NO_FASTFORWARD"
_ATTR = "_adaptivespec_fastforward"


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` s of the Llama layout :class:`FastLlama` runs: Llama (llama3 RoPE scaling through the
model's own rotary module, tied or untied embeddings, grouped KV heads), Mistral (full attention),
Qwen2 (biases on Q, K and V: packed with the weights) and Qwen3 (RMSNorm of every query and key head
before RoPE; ``head_dim`` set apart from hidden / heads)."""


def supported(model) -> str | None:
    """None when :class:`FastLlama` can run ``model``; otherwise why not (a short reason)."""
    cfg = getattr(model, "config", None)
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return f"${DISABLE_ENV}=1"
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return f"not a Llama-layout model ({', '.join(ARCHITECTURES)})"
    reason = dtype_unsupported(model)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "unexpected module layout"
    qk_norm = [hasattr(layer.self_attn, "q_norm") for layer in inner.layers]
    if any(qk_norm) != (cfg.model_type == "qwen3") or len(set(qk_norm)) > 1:
        return "query / key norms where the architecture has none (or the reverse)"
    reason = attention_unsupported(cfg)
    if reason is not None:
        return reason
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "activation or tensor-parallel layout differs"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "adaptivespec_sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r}"
    return None


def dtype_unsupported(module) -> str | None:
    """None where ``module``'s weights can run fused on this machine: float32 on any CPU (torch's own
    float32 matmuls, SDPA and norms: AVX2 suffices; an int8 target's int8 layers through
    :class:`~adaptivespec.fastpath.int8.Int8Weight`, exact on every ISA), bfloat16 on a CPU where they
    can be prepacked (:func:`~adaptivespec.fastpath.prepack.can_prepack`); otherwise why not."""
    p = next(module.parameters(), None)
    if p is not None and p.device.type == "cpu" and p.dtype == torch.float32:
        return None
    if can_prepack(module):
        return None
    return "neither float32 on a CPU nor bfloat16 on a CPU with oneDNN (or $ADAPTIVESPEC_NO_PREPACK=1)"


FOLD_MAX_ROWS = 72
"""Fold grouped query heads into rows (:func:`_fold_mask`) when heads-per-KV-head x rows is at most this ..."""
FOLD_MIN_KEYS = 1024
"""... and the cache holds at least this many keys (below it the fold does not pay)."""


def _fold_mask(mask: torch.Tensor | None, n: int, groups: int, keys: int) -> torch.Tensor | None:
    """The mask of a masked multi-row forward with its query heads folded into rows, or None where
    the fold does not apply.

    torch's CPU flash attention runs one task per (query head, block of rows) and reads a KV head's
    whole cache in each: with grouped heads (SmolLM2: 9 query heads on 3 KV heads) and a few rows, a
    tree's verify forward reads each KV head's cache 3 times, and at long context that read is its
    cost. Folding the ``groups`` query heads of a KV head into one block of ``groups * n`` rows
    reads it once. Per row the arithmetic is the same (the outputs are identical). On a 2-core AMX
    Xeon it pays from ~1k keys on for trees of up to 24 rows with SmolLM2's 3 heads per KV head
    (4096 keys: 4 rows 0.58 -> 0.33 ms per layer, 16 rows 0.79 -> 0.62, 24 rows 0.94 -> 0.81) and
    stops paying at 32 (``scripts/attention_bench.py``; docs/speed.md)."""
    if mask is None or groups == 1 or n == 1 or groups * n > FOLD_MAX_ROWS or keys < FOLD_MIN_KEYS:
        return None
    return fold_rows(mask, n, groups, keys)


def fold_rows(mask: torch.Tensor, n: int, groups: int, keys: int) -> torch.Tensor:
    """``mask`` [1, 1, n, >= keys] repeated for ``groups`` query heads folded into rows: [1, 1, groups * n, keys]."""
    return mask[:, :, :, :keys].expand(1, groups, n, keys).reshape(1, 1, groups * n, keys)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
SPLIT_MIN_ROWS = 64
"""A causal chunk of at least this many rows after at least :data:`FOLD_MIN_KEYS` cached keys (a
chunked prefill's later chunks) runs :func:`attend_after_prefix` instead of one masked call."""


def attend_after_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int,
                        scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``n`` new rows at positions ``past..past+n-1`` (q [1, H, n, D]) over the
    cache (keys / values [1, Hkv, past + n, D]) as two flash-attention calls merged by their
    log-sum-exp: the cached prefix, which every row sees whole (heads folded into rows, no mask),
    and the chunk itself, causal. One masked call over all keys computes the masked-out upper
    triangle too: on a 2-core AMX Xeon a 2,048-row chunk after 2,048 keys took 35.8 ms per layer
    masked, 25.1 split (512 rows after 7,680 keys: 18.9 against 14.5). Agrees with it to bfloat16
    rounding. CPU tensors only, where torch has the CPU flash kernel (``_FLASH_CPU``)."""
    _, H, n, D = q.shape
    Hkv = keys.shape[1]
    g = H // Hkv
    o1, l1 = _FLASH_CPU(q.reshape(1, Hkv, g * n, D), keys[:, :, :past], values[:, :, :past], scale=scale)[:2]
    kc, vc = keys[:, :, past:], values[:, :, past:]
    if g > 1:
        kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
    o2, l2 = _FLASH_CPU(q, kc, vc, is_causal=True, scale=scale)[:2]
    l1 = l1.reshape(1, H, n)
    lse = torch.logaddexp(l1, l2)
    out = o1.reshape(1, H, n, D).float() * torch.exp(l1 - lse).unsqueeze(-1)
    return out.addcmul_(o2.float(), torch.exp(l2 - lse).unsqueeze(-1)).to(q.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           folded: torch.Tensor | None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention of ``q`` [1, H, n, D] over ``keys`` / ``values`` [1, Hkv, S, D] -> [1, H, n, D]:
    with the heads folded into rows where ``folded`` (:func:`_fold_mask`) is given or for one unmasked
    row (torch's CPU SDPA with ``enable_gqa`` was 4.5x slower there: 168 vs 37 us at 300 keys, 533 vs
    99 at 1,000, bf16, 2-vCPU AMD EPYC; ``scripts/attention_bench.py``), else SDPA with the KV heads
    kept grouped and ``mask`` cut to the keys."""
    _, H, n, D = q.shape
    Hkv = keys.shape[1]
    if n == 1 and mask is None and H != Hkv:  # one row that sees every key: its KV head's query heads as rows
        return F.scaled_dot_product_attention(q.reshape(1, Hkv, H // Hkv, D), keys, values, scale=scale).view(1, H, n, D)
    if folded is not None:  # [1, Hkv, groups * n, D]: a KV head's query heads as one block of rows
        return F.scaled_dot_product_attention(q.reshape(1, Hkv, H // Hkv * n, D), keys, values, attn_mask=folded,
                                              scale=scale).view(1, H, n, D)
    m = None if mask is None else mask[:, :, :, : keys.shape[-2]]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=m, is_causal=causal, scale=scale,
                                          enable_gqa=Hkv != H)


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Where ``mask`` lets a row see a key, as bools: a boolean mask as it is, an additive one where 0."""
    return mask if mask.dtype == torch.bool else mask == 0


class AttentionPlan:
    """How ``n`` new rows after ``past`` cached keys attend, decided once per forward (the same for
    every layer). With the bfloat16 kernel (``kernel``: :func:`adaptivespec.fastpath.native.attention_ops`)
    every case runs through it: rows under a mask (a tree: ``shared`` keys every row sees, the committed
    prefix, and ``visible``, the mask's part after them), a causal chunk (``causal``) or one row. Without it: with ``mask`` (a tree's,
    [1, 1, n, >= past + n]; heads folded into rows where that pays, :func:`_fold_mask`), causally over
    a fresh cache, split around the cached prefix (:func:`attend_after_prefix`: a later chunk of a
    chunked prefill), or under a causal mask after the past. One row needs no mask."""

    __slots__ = ("mask", "folded", "causal", "split", "native", "limit", "kernel", "visible", "shared")

    def __init__(self, mask, folded, causal: bool, split: bool, native=None, limit=None, kernel=None,
                 visible=None, shared: int = 0) -> None:
        self.mask, self.folded, self.causal, self.split = mask, folded, causal, split
        self.native, self.limit = native, limit
        self.kernel, self.visible, self.shared = kernel, visible, shared

    @classmethod
    def of(cls, n: int, past: int, attention_mask: torch.Tensor | None, groups: int, device,
           native=None, kernel=None) -> "AttentionPlan":
        """``native``: attend by the layout-invariant kernel (:func:`attend_invariant`) instead;
        ``kernel``: the bfloat16 attention kernel, where it applies."""
        if native is not None:
            if attention_mask is not None:  # a tree's additive mask (0: visible) or a boolean one
                return cls(visible(attention_mask[0, 0]), None, False, False, native)
            limit = torch.arange(past, past + n, device=device) if n > 1 else None  # causal: row i sees keys <= past + i
            return cls(None, None, False, False, native, limit)
        if kernel is not None:
            if attention_mask is None:
                return cls(None, None, n > 1, False, kernel=kernel)
            vis = visible(attention_mask[0, 0, :, : past + n])
            hidden = (~vis.all(0)).nonzero()  # keys some row does not see: the first ends the shared prefix
            shared = int(hidden[0]) if hidden.numel() else past + n
            return cls(None, None, False, False, kernel=kernel, visible=vis[:, shared:], shared=shared)
        mask, causal, split = None, False, False
        if attention_mask is not None:
            mask = attention_mask
        elif n > 1:
            if past == 0:
                causal = True
            elif n >= SPLIT_MIN_ROWS and past >= FOLD_MIN_KEYS and _FLASH_CPU is not None and torch.device(device).type == "cpu":
                split = True  # a later chunk of a chunked prefill: attend_after_prefix
            else:  # rows past..past+n-1 see everything before them
                mask = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)[None, None]
        return cls(mask, _fold_mask(mask, n, groups, past + n), causal, split)

    def attend_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int,
                    scale: float | None) -> torch.Tensor:
        """q [1, H, n, D] over the cache's keys / values [1, Hkv, past + n, D] -> [n, H * D]."""
        if self.native is not None:
            return attend_invariant(self.native, q, keys, values, self.mask, self.limit, past, scale)
        _, H, n, D = q.shape
        if self.kernel is not None:  # the keys every row sees, then the tree's part or the causal edge
            scale = D ** -0.5 if scale is None else scale
            seen = self.shared if self.visible is not None else past if self.causal else keys.shape[-2]
            return self.kernel.attend_bf16(q[0].transpose(0, 1), keys[0], values[0], seen, self.visible, self.causal,
                                           scale)
        return self.attend(q, keys, values, past, scale)[0].transpose(0, 1).reshape(n, H * D)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int,
               scale: float | None) -> torch.Tensor:
        """q [1, H, n, D] over the cache's keys / values [1, Hkv, past + n, D] -> [1, H, n, D]."""
        if self.split:
            return attend_after_prefix(q, keys, values, past, scale)
        return attend(q, keys, values, self.mask, self.folded, self.causal, scale)


def attend_invariant(native, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                     limit: torch.Tensor | None, past: int, scale: float | None) -> torch.Tensor:
    """Attention of q [1, H, n, D] over keys / values [1, Hkv, S, D] -> [n, H * D] by the int8 target's
    C++ kernel (:mod:`adaptivespec.fastpath.native`): each (row, head) sums over its visible keys in
    ascending order in one pass (online softmax), so its result does not depend on the other rows,
    on masked keys among or after its own, or on how the forward was cut (one row, a tree, a prefill
    chunk, a batch). Row i sees the first ``past`` keys and, beyond them, ``visible[i]`` [n, >= S]
    (a tree) or keys up to ``limit[i]`` (causal), or every key."""
    D = q.shape[-1]
    return native.attend(q[0], keys[0], values[0], visible, past, limit, D ** -0.5 if scale is None else scale)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, sgl=None) -> torch.Tensor:
    """RMSNorm of ``x`` [rows, H]: SGLang's kernel with ``sgl``, else transformers' ``LlamaRMSNorm``
    (normalise in float32, round to the model's dtype, then scale; in float32 one op, scale included)."""
    if sgl is not None:
        return sgl.rmsnorm_cpu(x.contiguous(), w, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of ``qk`` [n, heads, D] with cos / sin [n, 1, D]."""
    half = qk.shape[-1] // 2
    rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rot * sin


_MKL_PACK = getattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None) if torch.backends.mkl.is_available() else None


class Float32Weight:
    """A float32 weight ``[out, in]`` (and bias) for the matmuls of a float32 forward on any CPU: call it on ``x [rows, in]``.

    Where the CPU has AVX2 + FMA and our kernel builds (:func:`adaptivespec.fastpath.native.f32_linear_ops`),
    every call runs it on a copy of the weight packed once (``csrc/f32_linear.cpp``): the weight is read
    once for all of a call's rows and each output is summed in one fixed order, so a row's bits do not
    depend on the rows beside it. On a 2-vCPU AMD EPYC capped to AVX2, SmolLM2-135M's layers and head
    (streamed from memory, as in a forward) took 16 ms for one row against MKL's 34, 19 ms for 4 rows
    against 64, 37 ms for 16 against 87 (docs/speed.md, *float32*). Elsewhere (no AVX2, no compiler,
    ``$ADAPTIVESPEC_NO_LINEAR_KERNEL=1``) one row runs MKL's packed sgemm (``torch.ops.mkl._mkl_linear``
    on a copy packed for one row) and other row counts ``F.linear``; oneDNN's packed float32 matmul was
    much slower here."""

    __slots__ = ("weight", "bias", "out_features", "packed", "ours")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self.ours = native.f32_linear_ops()
        if self.ours is not None:
            self.packed = self.ours.pack_f32(self.weight)
        else:
            self.packed = _MKL_PACK(self.weight, 1) if _MKL_PACK is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours is not None:
            if x.dim() == 2:
                return self.ours.linear_f32(x, self.packed, self.out_features, self.bias)
            y = self.ours.linear_f32(x.reshape(-1, x.shape[-1]), self.packed, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:  # one row: the packed copy (MKL runs F.linear's matmul for any other count)
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, 1)
        return F.linear(x, self.weight, self.bias)


def pack(mods, dtype, sgl, invariant: bool = False) -> PackedWeight | Int8Weight | Float32Weight:
    """One packed matmul for the linear layers ``mods`` side by side (their weights, and biases where
    any has one, concatenated along the outputs). Int8 layers (:class:`~adaptivespec.fastpath.int8.Int8Linear`,
    all or none of ``mods``) give one :class:`~adaptivespec.fastpath.int8.Int8Weight`: their int8 rows
    and per-channel scales side by side compute what each computes alone. ``invariant``: a row's bits may
    not depend on the rows beside it (:class:`~adaptivespec.fastpath.prepack.PackedWeight`)."""
    bias = None
    if any(getattr(m, "bias", None) is not None for m in mods):
        bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=dtype)
                          for m in mods])
    if any(isinstance(m, Int8Linear) for m in mods):
        if not all(isinstance(m, Int8Linear) for m in mods):
            raise ValueError("fused projections mix int8 and float layers: keep all of q/k/v (or gate/up) or none")
        return Int8Weight(torch.cat([m.qweight for m in mods]), torch.cat([m.scale for m in mods]), bias,
                          mods[0].inv_smooth, mods[0].groups)  # one input: one set of smoothing factors and slices
    weight = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
    if dtype == torch.float32:
        return Float32Weight(weight, bias)
    return PackedWeight(weight, bias, sgl, invariant)


def _backend(sgl, dtype: torch.dtype) -> str:
    """What runs the matmuls: ``sgl_kernel``, ``onednn`` (bf16 prepacked) or ``torch`` (float32's ``F.linear``)."""
    return "sgl_kernel" if sgl is not None else "torch" if dtype == torch.float32 else "onednn"


class _Layer:
    __slots__ = ("qkv", "o", "gate_up", "down", "w_in", "w_post", "eps_in", "eps_post", "qk_norm", "q_norm", "k_norm",
                 "eps_qk")


class FastLlama:
    """The target's forward, fused (see the module's text). Built once per model by :func:`fast_forward`."""

    def __init__(self, model, sgl=None) -> None:
        cfg = model.config
        inner = model.model
        self.model = model
        self.sgl = sgl
        self.dtype = next(model.parameters()).dtype
        self.backend = _backend(sgl, self.dtype)
        self.quantization = quantization_of(model)
        self.native = None  # the int8 target's layout-invariant attention (where its kernels build)
        self.kernel = None  # the bfloat16 attention kernel (where it builds and the CPU has AVX512-BF16)
        if self.quantization == "int8":
            self.native = native.ops()
        elif next(model.parameters()).dtype == torch.bfloat16 and model.device.type == "cpu":
            self.kernel = native.attention_ops()
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self.scale = self.head_dim ** -0.5
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dtype = self.dtype
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.norm_w = inner.norm.weight.detach()
        self.norm_eps = inner.norm.variance_epsilon
        # with the attention kernel the bf16 forward is batch-invariant: no linear may round a row by its neighbours
        invariant = self.kernel is not None
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            L = _Layer()
            L.qkv = pack((a.q_proj, a.k_proj, a.v_proj), dtype, sgl, invariant)
            L.o = pack((a.o_proj,), dtype, sgl, invariant)
            L.gate_up = pack((m.gate_proj, m.up_proj), dtype, sgl, invariant)
            L.down = pack((m.down_proj,), dtype, sgl, invariant)
            L.w_in, L.eps_in = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
            L.w_post, L.eps_post = (layer.post_attention_layernorm.weight.detach(),
                                    layer.post_attention_layernorm.variance_epsilon)
            L.qk_norm = L.q_norm = L.k_norm = None
            if hasattr(a, "q_norm"):  # Qwen3: one RMSNorm over head_dim for every query head, one for every key head
                L.q_norm, L.k_norm = a.q_norm.weight.detach(), a.k_norm.weight.detach()
                L.eps_qk = a.q_norm.variance_epsilon
                if a.k_norm.variance_epsilon != L.eps_qk:
                    raise ValueError("q_norm and k_norm with different epsilons")
                # [H + Hkv, D]: the rows of the Q|K block normed in one op (torch's path)
                L.qk_norm = torch.cat([L.q_norm.expand(self.heads, -1), L.k_norm.expand(self.kv_heads, -1)])
            self.layers.append(L)
        self.lm_head = pack((model.lm_head,), dtype, sgl, invariant)

    def _rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.native is not None:  # the int8 target: one call, a row's sums in one fixed order
            return self.native.rms_norm(x, w, eps)
        return rms_norm(x, w, eps, self.sgl)

    # -- the pieces of a layer (shared with the batched forward, :mod:`adaptivespec.fastpath.batched`) --
    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> input embeddings [n, H]."""
        return F.embedding(ids, self.embed)

    def rotary_rows(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [n, 1, D] of the rows at ``positions`` [n] (in ``h``'s dtype)."""
        cos, sin = self.rotary(h, positions.unsqueeze(0))  # [1, n, D] each
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def project(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer ``L``'s attention input: residual stream ``h`` [n, H] -> q [n, H_q, D], k / v [n, H_kv, D],
        RoPE applied (row i at the position cos / sin row i was made for)."""
        n = h.shape[0]
        H, Hkv, D, qs, ks = self.heads, self.kv_heads, self.head_dim, self.q_size, self.kv_size
        qkv = L.qkv(self._rms(h, L.w_in, L.eps_in))  # [n, qs + 2 ks]
        qk = qkv[:, : qs + ks].view(n, H + Hkv, D)
        if L.qk_norm is not None:  # Qwen3: every query and key head RMS-normed over D, before RoPE
            qk = self._head_norm(L, qk)
        qk = rope(qk, cos, sin)
        return qk[:, :H], qk[:, H:], qkv[:, qs + ks:].view(n, Hkv, D)

    def _head_norm(self, L: _Layer, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's ``q_norm`` / ``k_norm`` of the Q|K block ``qk`` [n, H + Hkv, D]: with torch's ops one
        RMSNorm over D (transformers' rounding) scaled by the stacked weights; with SGLang's kernel one
        call per part (it takes rows of one weight)."""
        if self.sgl is None:
            return L.qk_norm * F.rms_norm(qk.float(), (qk.shape[-1],), None, L.eps_qk).to(qk.dtype)
        n, H, D = qk.shape[0], self.heads, self.head_dim
        q = self.sgl.rmsnorm_cpu(qk[:, :H].reshape(n * H, D), L.q_norm, L.eps_qk).view(n, H, D)
        k = self.sgl.rmsnorm_cpu(qk[:, H:].reshape(-1, D), L.k_norm, L.eps_qk).view(n, -1, D)
        return torch.cat([q, k], dim=1)

    def finish(self, L: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``L`` after attention (``attn`` [n, H_q * D]): output projection, residual,
        MLP, residual. Returns the new residual stream [n, H] (with SGLang's kernels ``h`` is updated in place)."""
        o = L.o(attn)
        sgl = self.sgl
        if sgl is not None:
            sgl.fused_add_rmsnorm_cpu(o, h, L.w_post, L.eps_post)  # h += o; o = rmsnorm(h)
            act = sgl.silu_and_mul_cpu(L.gate_up(o))
        else:
            h = h + o
            gu = L.gate_up(self._rms(h, L.w_post, L.eps_post))  # [n, 2 I]
            inter = gu.shape[-1] // 2
            act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        return h + L.down(act)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms(h, self.norm_w, self.norm_eps)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final-normed rows [m, H] -> logits [m, V]."""
        return self.lm_head(rows.contiguous())

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` as a hidden state to return (a copy where SGLang's kernels add into ``h`` in place)."""
        return h.clone() if self.sgl is not None else h

    # -- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, output_hidden_states: bool = False,
                 logits_to_keep: int = 0, **_ignored) -> SimpleNamespace:
        if input_ids.shape[0] != 1:
            raise ValueError("FastLlama runs batch 1 only")
        ids = input_ids[0]
        n = ids.shape[0]
        past = cache.get_seq_length()
        positions = torch.arange(past, past + n, device=ids.device) if position_ids is None else position_ids[0]
        h = self.embed_rows(ids)  # [n, H]
        cos, sin = self.rotary_rows(h, positions)  # [n, 1, D]
        hidden = [self.keep(h)] if output_hidden_states else None
        plan = AttentionPlan.of(n, past, attention_mask, self.heads // self.kv_heads, ids.device, self.native,
                                self.kernel)
        layers = cache.layers
        for i, L in enumerate(self.layers):
            q, k, v = self.project(L, h, cos, sin)  # [n, heads, D]
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, D]
            keys, values = layers[i].update(k, v)
            h = self.finish(L, h, plan.attend_rows(q, keys, values, past, self.scale))  # attention [n, H * D]
            if hidden is not None and i + 1 < len(self.layers):
                hidden.append(self.keep(h))
        h = self.final_norm(h)
        if hidden is not None:
            hidden.append(h)
        rows = h if not logits_to_keep else h[-logits_to_keep:]
        logits = self.logits(rows).unsqueeze(0)
        hs = tuple(t.unsqueeze(0) for t in hidden) if hidden is not None else None
        return SimpleNamespace(logits=logits, hidden_states=hs)


def _probe(sgl, hidden: int, inter: int):
    """``sgl`` if its norm and SwiGLU kernels take this model's sizes, else None (torch's ops then)."""
    if sgl is None:
        return None
    try:
        x = torch.zeros(1, hidden, dtype=torch.bfloat16)
        w = torch.ones(hidden, dtype=torch.bfloat16)
        sgl.rmsnorm_cpu(x, w, 1e-6)
        sgl.fused_add_rmsnorm_cpu(x, x.clone(), w, 1e-6)
        sgl.silu_and_mul_cpu(torch.zeros(1, 2 * inter, dtype=torch.bfloat16))
    except RuntimeError:
        return None
    return sgl


def fast_forward(model):
    """The fused forward for ``model`` (built once and kept on it), or None where it does not apply
    (:func:`supported`): callers then run the model itself."""
    if model is None or supported(model) is not None:
        return None
    # the int8 target runs torch's norms and SiLU whatever is installed: one function on every install;
    # float32 runs torch's ops only (SGLang's CPU kernels are bf16 / fp16)
    dtype = next(model.parameters()).dtype
    sgl = None if quantization_of(model) == "int8" or dtype == torch.float32 else _probe(
        sgl_ops(), model.config.hidden_size, model.config.intermediate_size)
    cached = getattr(model, _ATTR, None)
    if cached is not None and cached.backend == _backend(sgl, dtype) and cached.dtype == dtype:
        return cached
    ff = FastLlama(model, sgl)
    object.__setattr__(model, _ATTR, ff)  # not a submodule: keep it out of state_dict and .modules()
    return ff
