"""Packed forwards: several requests' rows through the target (or the draft head) in one pass.

A batch step gives every request its own rows: a prefill chunk, a verify tree, or the one row
of plain decoding. They run as one activation ``[R, H]`` through every matmul of the model (the
projections, the MLP and the LM head dominate a small model's step, and on a CPU a row costs
far less inside a bigger matmul than in a pass of its own); attention runs per request over its
own KV cache with its own mask (BASS-SPLIT: no padding of rows or keys to the widest request).

Ragged layout, rows of request ``j`` at ``[cu_rows[j], cu_rows[j + 1])``; worked example for a
tree of 4 rows, a plain row and a 3-row prefill chunk::

    parts      [tree(4), plain(1), chunk(3)]
    cu_rows    [0, 4, 5, 8]          # cumsum of rows, a leading 0
    positions  [P0+0, P0+1, P0+1, P0+2,  P1,  0, 1, 2]   # tree depths; the plain row; the chunk
    R          8 (rows beyond ROW_BUCKET are padded to a bucket: the padded rows run the matmuls only)

Beyond :data:`ROW_BUCKET` rows are padded to a multiple of it (:func:`padded_rows`; up to it they
run as they are: one request's plain step is one row) so that the matmul kernels meet a bounded
set of row counts (they keep per-shape state: see
:data:`adaptivespec.runtime.PREFILL_ROWS_MULTIPLE`); a padded row attends nothing, writes no
cache and is dropped from the outputs.

The target's layer pieces come from :class:`~adaptivespec.fastpath.forward.FastLlama` (bfloat16 or
float32 on a CPU, fused; float32 on torch's own ops, any CPU) or :class:`ModuleLayers` (any
Llama-family model's own modules, where the fused forward does not apply or is switched off).
"""

from __future__ import annotations

import contextlib
from typing import Collection, Sequence

import attrs
import numpy as np
import torch

import torch.nn.functional as F

from adaptivespec.fastpath.forward import AttentionPlan, _fold_mask, attend, fast_forward, rope, visible

ROW_BUCKET = 8
"""Packed forwards run their own row count up to this many, a multiple of it up to 64, of
:data:`ROW_BUCKET_LARGE` beyond."""
ROW_BUCKET_LARGE = 32


def padded_rows(rows):
    """``rows`` (an int, a float or an array of them) rounded up to the rows the packed forward runs:
    1 to 8 as they are, then 16, 24, ..., 64, 96, 128, ... (the row budget prices rows by it, so it
    fills the padding). Fewer than 8 rows are not padded: at one to a few rows the matmuls read the
    weights once whatever the rows, and 8 rows cost a third more than one (a 2-vCPU EPYC, bf16: 15.4
    against 11.8 ms), which every step of one or two requests paid."""
    r = np.maximum(np.ceil(np.asarray(rows, dtype=np.float64)), 1.0)
    step = np.where(r <= 64, ROW_BUCKET, ROW_BUCKET_LARGE)
    out = np.where(r <= ROW_BUCKET, r, np.ceil(r / step) * step)
    return out if out.ndim else int(out)


@attrs.define(eq=False, kw_only=True)
class Part:
    """One request's rows in a packed target forward."""

    cache: object
    """Its KV cache (transformers ``DynamicCache`` layout: ``cache.layers[i].update(k, v)``)."""
    rows: int
    mask: torch.Tensor | None = None
    """Additive (or bool) mask [1, 1, rows, past + rows]: a verify tree's; None: causal after the past."""
    slot: int | None = None
    """Its cache's slot in the :class:`KVSlab` the forward is given (None: not in the slab)."""


SLAB_MAX_ROWS = 32
"""Parts of at most this many rows in the slab attend in one call for all of them (verify trees,
plain rows, prompt chunks where :func:`kernels_attend`); longer ones attend alone."""


class KVSlab:
    """Every lane's KV cache in one tensor per layer, ``[slots, H_kv, capacity, D]``: lane ``i``'s
    cache layers are views of slot ``i`` (:meth:`bind`), so its own operations (append, compaction,
    crop) work as before, and the short parts of a packed forward attend in **one** SDPA call over
    all slots (each row masked to its own slot's keys) instead of one call per request per layer
    (on a 2-vCPU EPYC: 8 requests x 30 layers of ~55 us calls were a third of a plain batched step)."""

    def __init__(self, config, slots: int, capacity: int, dtype: torch.dtype, device) -> None:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        self.slots, self.capacity = slots, capacity
        self.k = [torch.zeros(slots, heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(slots, heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        # the same memory as SGLang's token pools ``[tokens, H_kv, D]`` (strided views, no copy): token
        # ``t`` of slot ``s`` is ``s * H_kv * capacity + t``, its head ``h`` ``capacity * D`` further on
        n = slots * heads * capacity - (heads - 1) * capacity
        self.k_tokens = [t.as_strided((n, heads, head_dim), (head_dim, capacity * head_dim, 1)) for t in self.k]
        self.v_tokens = [t.as_strided((n, heads, head_dim), (head_dim, capacity * head_dim, 1)) for t in self.v]
        self.token_of = (torch.arange(slots, device=device)[:, None] * heads * capacity
                         + torch.arange(capacity, device=device)[None]).to(torch.int32)
        """``[slots, capacity]``: each slot's positions in the token views (SGLang's ``req_to_token``)."""

    def bind(self, slot: int, cache) -> None:
        """Make ``cache``'s layers (:class:`~adaptivespec.fastpath.kvcache.BufferedLayer`) views of ``slot``."""
        for layer, k, v in zip(cache.layers, self.k, self.v):
            layer._k, layer._v = k[slot : slot + 1], v[slot : slot + 1]
            layer.capacity, layer.length, layer.is_initialized = self.capacity, 0, True
            layer.device = k.device
            layer._view()

    def holds(self, slot: int, cache) -> bool:
        """Whether ``cache`` is still bound to ``slot`` (a generation that outgrew it reallocated)."""
        layer = cache.layers[0]
        return getattr(layer, "_k", None) is not None and layer._k.data_ptr() == self.k[0][slot].data_ptr()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def kernels_attend(sgl, dtype: torch.dtype) -> bool:
    """Whether the slab's members attend by SGLang's CPU kernels (:class:`SlabKernels`: each member
    over its own keys only, so a member with a long past costs the others nothing), not by one SDPA
    call over the widest member's keys. ``sgl``: the forward pieces' ``sgl`` (None without them)."""
    return sgl is not None and dtype in (torch.bfloat16, torch.float16) and hasattr(sgl, "decode_attention_cpu")


def placement(parts: Sequence[Part], starts: Sequence[int], pasts: Sequence[int], members: Sequence[int], device):
    """The ``members``' packed rows, their slots and the slot positions their new keys go to (each [rows])."""
    rows = [torch.arange(starts[j], starts[j] + parts[j].rows, device=device) for j in members]
    slots = [torch.full((parts[j].rows,), parts[j].slot, dtype=torch.long, device=device) for j in members]
    positions = [torch.arange(pasts[j], pasts[j] + parts[j].rows, device=device) for j in members]
    return torch.cat(rows), torch.cat(slots), torch.cat(positions)


class SlabStep:
    """One packed forward's shared attention over the slab for its short parts: the row maps and
    the mask, built once and used by every layer.

    Only the slots from the lowest to the highest in use attend (a view of the slab: the engine
    hands out the lowest free slot, so a few requests use a few slots).

    Worked example: slots 0..2, part A (slot 2, 1 row at past 5), part B (slot 0, a 3-node tree at
    past 4), packed rows [A0, B0, B1, B2]: ``r_max`` 3, keys ``S`` = max(5 + 1, 4 + 3) = 7;
    ``q_index[2] = [0, 0, 0]`` (A's row, then padding), ``q_index[0] = [1, 2, 3]``; slot 1 idle;
    A's row sees keys 0..5, B's rows keys 0..3 plus their tree mask over keys 4..6; padded and
    idle rows see key 0 alone (so no row is all masked)."""

    def __init__(self, slab: KVSlab, parts: Sequence[Part], starts: Sequence[int], pasts: Sequence[int],
                 heads: int, dtype: torch.dtype, device, sgl=None, kernel=None) -> None:
        self.slab = slab
        self.members = [j for j, p in enumerate(parts) if p.slot is not None and p.rows <= SLAB_MAX_ROWS]
        self.kernels = None
        self.kernel = None
        if not self.members:
            return
        if kernel is not None and dtype == torch.bfloat16:  # the bf16 kernel: every member over its own keys, one call
            self._kernel_plan(kernel, parts, starts, pasts, device)
            return
        if kernels_attend(sgl, dtype):
            self.kernels = SlabKernels(sgl, slab, parts, starts, pasts, self.members, heads, device)
            return
        r_max = max(parts[j].rows for j in self.members)
        S = max(pasts[j] + parts[j].rows for j in self.members)
        lo = min(parts[j].slot for j in self.members)  # the slots from lo to hi attend (views, no copy)
        hi = max(parts[j].slot for j in self.members) + 1
        n = hi - lo
        self.lo, self.hi = lo, hi
        neg = torch.finfo(dtype).min
        mask = torch.full((n, 1, r_max, S), neg, dtype=dtype, device=device)
        mask[:, :, :, 0] = 0
        q_index = torch.zeros(n, r_max, dtype=torch.long, device=device)
        flat = []
        for j in self.members:
            p, s0, past = parts[j], starts[j], pasts[j]
            r, slot = p.rows, p.slot - lo
            q_index[slot, :] = s0
            q_index[slot, :r] = torch.arange(s0, s0 + r, device=device)
            block = mask[slot, 0, :r]
            block[:, :past] = 0
            if p.mask is not None:  # a tree's (or any given) mask over its own rows
                own = p.mask[0, 0, :, past : past + r]
                block[:, past : past + r] = own if own.dtype != torch.bool else torch.where(own, 0.0, neg).to(dtype)
            else:  # causal over the new rows
                block[:, past : past + r] = torch.full((r, r), neg, dtype=dtype, device=device).triu(1)
            flat.append(slot * r_max + torch.arange(r, device=device))
        self.mask, self.q_index, self.S, self.r_max = mask, q_index, S, r_max
        groups = heads // slab.k[0].shape[1]
        self.folded = mask.expand(n, groups, r_max, S).reshape(n, 1, groups * r_max, S)  # rows as q is folded
        # packed rows attended here, their slot, where their keys go in the slot
        self.rows, self.slots, self.positions = placement(parts, starts, pasts, self.members, device)
        self.flat = torch.cat(flat)  # their place in the [slots * r_max] output

    def _kernel_plan(self, kernel, parts: Sequence[Part], starts: Sequence[int], pasts: Sequence[int], device) -> None:
        """Each member's rows, slot, past and tree mask (``attend_slab``'s table), and the slab rows
        its new keys go to."""
        meta, masks, offset = [], [], 0
        for j in self.members:
            p, s0, past = parts[j], starts[j], pasts[j]
            r = p.rows
            if p.mask is not None:  # a tree's mask over its own rows (every member row sees its whole past)
                masks.append(visible(p.mask[0, 0, :, past : past + r]).reshape(-1))
                meta.append((s0, r, p.slot, past, offset))
                offset += r * r
            else:  # causal over the new rows
                meta.append((s0, r, p.slot, past, -1))
        self.kernel = kernel
        self.meta = torch.tensor(meta, dtype=torch.long)
        self.tree_masks = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        self.rows, self.slots, self.positions = placement(parts, starts, pasts, self.members, device)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: torch.Tensor,
               scale: float | None) -> None:
        """Layer ``i``: write the members' keys and values into the slab, attend, and put their
        outputs into ``attn`` [R, H_q * D]. ``q`` / ``k`` / ``v``: [R, heads, D]."""
        if self.kernels is not None:
            return self.kernels.attend(i, q, k, v, attn, scale)
        K, V = self.slab.k[i], self.slab.v[i]
        K[self.slots, :, self.positions] = k[self.rows]
        V[self.slots, :, self.positions] = v[self.rows]
        if self.kernel is not None:
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            self.kernel.attend_slab(q, K, V, self.meta, self.tree_masks, scale, attn)
            return
        K, V = K[self.lo : self.hi], V[self.lo : self.hi]
        n, H, D = self.hi - self.lo, q.shape[1], q.shape[2]
        Hkv, r = K.shape[1], self.r_max
        g = H // Hkv
        # a KV head's g query heads folded into g * r_max rows (torch's CPU SDPA with enable_gqa copies
        # the keys per query head: 5.6x slower for 8 slots x 1 row at 300 keys on a 2-vCPU EPYC)
        qp = q[self.q_index].transpose(1, 2).reshape(n, Hkv, g * r, D)  # [slots, Hkv, g * r_max, D]
        out = F.scaled_dot_product_attention(qp, K[:, :, : self.S], V[:, :, : self.S], attn_mask=self.folded,
                                             scale=scale)
        out = out.view(n, H, r, D).transpose(1, 2).reshape(n * r, H * D)  # [slots * r_max, H * D]
        attn[self.rows] = out[self.flat]


class SlabKernels:
    """:class:`SlabStep`'s attention by SGLang's CPU attention kernels (``sgl_kernel``, bfloat16 or
    float16), each member over its own keys only (no padding to the longest member, no idle slots):
    one-row members (plain decoding, a tree cut to its root) in one ``decode_attention_cpu`` call
    (which also writes their keys and values into the slab), the others (trees, short chunks) in one
    ``extend_attention_cpu`` call with a tree mask, every member's rows padded to the widest
    member's ``M`` (the kernel wants uniform lengths with a mask; a padded row sees itself alone and
    no real row sees it). On a 2-vCPU EPYC, 8 one-row members over 700 keys: 151 us per layer
    against 478 us for the folded SDPA call.

    Worked example: members A (slot 2, 1 row, past 5), B (slot 0, a 3-node tree, past 4), C (slot 1,
    2-row chunk, past 9), packed rows [A0, B0, B1, B2, C0, C1]: decode rows ``[0]`` at token
    ``token_of[2, 5]``, seq len 6; extend rows ``[1, 2, 3, 4, 5, 4]`` (M = 3, C padded with its
    first row), seq lens ``[4 + 3, 9 + 3]``, masks B's tree and C's causal 2 x 2 plus the pad's
    diagonal."""

    SPLITS = 8
    """Key splits of the decode kernel (its ``attn_logits`` scratch)."""

    def __init__(self, sgl, slab: KVSlab, parts, starts, pasts, members, heads: int, device) -> None:
        self.sgl, self.slab = sgl, slab
        ones = [j for j in members if parts[j].rows == 1]
        many = [j for j in members if parts[j].rows > 1]
        D = slab.k[0].shape[-1]
        self.heads, self.D = heads, D
        long = dict(dtype=torch.long, device=device)
        self.one_rows = torch.tensor([starts[j] for j in ones], **long)
        self.one_slots = torch.tensor([parts[j].slot for j in ones], **long)
        self.one_seq = torch.tensor([pasts[j] + 1 for j in ones], **long)
        self.one_loc = self.slab.token_of[self.one_slots, torch.tensor([pasts[j] for j in ones], **long)].long()
        self.logits = torch.empty(len(ones), heads, self.SPLITS, D + 1, dtype=torch.float32, device=device)
        self.many = bool(many)
        if not many:
            return
        M = max(parts[j].rows for j in many)
        n = len(many)
        index = torch.empty(n, M, **long)
        vis = torch.eye(M, dtype=torch.bool, device=device).repeat(n, 1, 1)  # a padded row sees itself
        flat = []
        for b, j in enumerate(many):
            p, s0, past = parts[j], starts[j], pasts[j]
            r = p.rows
            index[b] = s0
            index[b, :r] = torch.arange(s0, s0 + r, device=device)
            if p.mask is not None:
                vis[b, :r, :r] = visible(p.mask[0, 0, :, past: past + r])
            else:
                vis[b, :r, :r] = torch.ones(r, r, dtype=torch.bool, device=device).tril()
            flat.append(b * M + torch.arange(r, device=device))
        self.M, self.index, self.mask = M, index.flatten(), vis.flatten()
        self.rows, self.slots, self.positions = placement(parts, starts, pasts, many, device)
        self.flat = torch.cat(flat)
        self.m_slots = torch.tensor([parts[j].slot for j in many], **long)
        self.m_seq = torch.tensor([pasts[j] + M for j in many], **long)
        self.m_ext = torch.full((n,), M, dtype=torch.int32, device=device)
        self.m_start = torch.arange(0, n * M, M, dtype=torch.int32, device=device)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: torch.Tensor,
               scale: float | None) -> None:
        slab, sgl = self.slab, self.sgl
        scale = self.D ** -0.5 if scale is None else scale
        K, V = slab.k_tokens[i], slab.v_tokens[i]
        if self.one_rows.numel():
            r = self.one_rows
            out = q.new_empty(r.shape[0], self.heads, self.D)
            sgl.decode_attention_cpu(q[r], K, V, out, k[r], v[r], self.one_loc, self.logits, slab.token_of,
                                     self.one_slots, self.one_seq, scale, 0.0, False, 0, None, None)
            attn[r] = out.view(r.shape[0], -1)
        if self.many:
            slab.k[i][self.slots, :, self.positions] = k[self.rows]  # the kernel reads new keys from its inputs
            slab.v[i][self.slots, :, self.positions] = v[self.rows]  # and the past from the slab: keep both
            x = self.index
            out = q.new_empty(x.shape[0], self.heads, self.D)
            sgl.extend_attention_cpu(q[x], k[x], v[x], out, K, V, slab.token_of, self.m_slots, self.m_seq,
                                     self.m_ext, self.m_start, self.M, scale, 0.0, False, 0, None, None, self.mask)
            attn[self.rows] = out[self.flat].view(self.rows.shape[0], -1)


class ModuleLayers:
    """:class:`~adaptivespec.fastpath.forward.FastLlama`'s layer pieces computed by a Llama-family
    model's own modules (any dtype; q/k/v biases and q/k norms where the model has them)."""

    def __init__(self, model) -> None:
        cfg = model.config
        inner = model.model
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.q_size = self.heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.layers = list(inner.layers)
        self.inner = inner

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def rotary_rows(self, h: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.inner.rotary_emb(h, positions.unsqueeze(0))
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def project(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a, n, D = layer.self_attn, h.shape[0], self.head_dim
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(n, self.heads, D)
        k = a.k_proj(x).view(n, self.kv_heads, D)
        v = a.v_proj(x).view(n, self.kv_heads, D)
        if getattr(a, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = a.q_norm(q), a.k_norm(k)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def finish(self, layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + layer.self_attn.o_proj(attn)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner.norm(h)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(rows)

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        return h


def layer_pieces(model):
    """The pieces a packed forward of ``model`` runs: fused where :func:`fast_forward` applies, the
    model's modules otherwise (kept on the model, built once)."""
    fast = fast_forward(model)
    if fast is not None:
        return fast
    pieces = model.__dict__.get("_adaptivespec_module_layers")
    if pieces is None:
        pieces = ModuleLayers(model)
        object.__setattr__(model, "_adaptivespec_module_layers", pieces)
    return pieces


@torch.inference_mode()
def packed_forward(pieces, ids: torch.Tensor, positions: torch.Tensor, parts: Sequence[Part],
                   logit_rows: torch.Tensor, hidden: bool | Collection[int] = False, slab: KVSlab | None = None):
    """One target forward over every part's rows (``ids`` / ``positions`` [R], the parts' rows in
    order, then padding). Each part's new keys and values are appended to its cache. With ``slab``
    the short parts in it attend together (:class:`SlabStep`), the others one by one.

    Returns (logits [len(logit_rows), V] of the rows ``logit_rows``, hidden states or None): with
    ``hidden``, transformers' ``hidden_states`` layout over all R rows (embeddings, each layer's
    output, the last one normed), each ``[1, R, H]``; ``hidden`` a collection of indices into that
    layout: those kept, None in the other places (an EAGLE-3 head reads three).
    """
    R = ids.shape[0]
    h = pieces.embed_rows(ids)  # [R, H]
    cos, sin = pieces.rotary_rows(h, positions)  # [R, 1, D]
    groups = pieces.heads // pieces.kv_heads
    starts, pasts, start = [], [], 0
    for p in parts:
        starts.append(start)
        pasts.append(p.cache.get_seq_length())
        start += p.rows
    native = getattr(pieces, "native", None)  # the int8 target: every part by the layout-invariant kernel
    kernel = getattr(pieces, "kernel", None)  # the bf16 attention kernel, where it builds
    shared = (SlabStep(slab, parts, starts, pasts, pieces.heads, h.dtype, ids.device, getattr(pieces, "sgl", None),
                       kernel) if slab is not None and native is None else None)
    alone = [j for j in range(len(parts)) if shared is None or j not in shared.members]
    plans = {j: AttentionPlan.of(parts[j].rows, pasts[j], parts[j].mask, groups, ids.device, native, kernel)
             for j in alone}
    wanted = None if hidden is True or hidden is False else frozenset(hidden)
    if wanted is not None and not wanted:
        hidden = False

    def kept(index: int, state: torch.Tensor):
        return pieces.keep(state) if wanted is None or index in wanted else None

    states = [kept(0, h)] if hidden else None
    attn = h.new_zeros(R, pieces.q_size)  # padded rows keep 0
    for i, L in enumerate(pieces.layers):
        q, k, v = pieces.project(L, h, cos, sin)  # [R, heads, D]
        if shared is not None and shared.members:
            shared.attend(i, q, k, v, attn, pieces.scale)
        for j in alone:
            p, s, past = parts[j], starts[j], pasts[j]
            e = s + p.rows
            qp, kp, vp = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, rows, D]
            keys, values = p.cache.layers[i].update(kp, vp)
            attn[s:e] = plans[j].attend_rows(qp, keys, values, past, pieces.scale)  # [rows, H * D]
        h = pieces.finish(L, h, attn)
        if states is not None and i + 1 < len(pieces.layers):
            states.append(kept(i + 1, h))
    if shared is not None:  # the slab's members were written past their caches' ends: move the ends
        for j in shared.members:
            for layer in parts[j].cache.layers:
                layer.length += parts[j].rows
                layer._view()
    h = pieces.final_norm(h)
    if states is not None:
        states.append(h)
    logits = pieces.logits(h[logit_rows]) if logit_rows.numel() else h.new_zeros(0, 0)
    return logits, (tuple(t.unsqueeze(0) if t is not None else None for t in states) if states is not None else None)


# -- the draft head ----------------------------------------------------------------------------------
@attrs.define(eq=False, kw_only=True)
class DraftKV:
    """One request's draft-head KV cache (the head's own ``_k`` / ``_v`` / ``length`` while bound)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    length: int = 0


@contextlib.contextmanager
def bound(drafter, kv: DraftKV):
    """Run ``drafter``'s single-request operations (``step``, ``reset_cache``, ``append_kv``) on
    ``kv``: the head's cache attributes are swapped in for the block and written back after it."""
    saved = drafter._k, drafter._v, drafter.length
    drafter._k, drafter._v, drafter.length = kv.k, kv.v, kv.length
    try:
        yield drafter
    finally:
        kv.k, kv.v, kv.length = drafter._k, drafter._v, drafter.length
        drafter._k, drafter._v, drafter.length = saved


@attrs.define(eq=False, kw_only=True)
class DraftPart:
    """One request's rows in a packed draft-head step."""

    kv: DraftKV
    rows: int
    mask: torch.Tensor | None = None
    """As :meth:`Eagle3Drafter.step <adaptivespec.drafter.Eagle3Drafter.step>`'s: [1, 1, rows, length + rows], or None (causal)."""


@torch.inference_mode()
def packed_draft_step(drafter, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                      parts: Sequence[DraftPart]) -> torch.Tensor:
    """:meth:`Eagle3Drafter.step <adaptivespec.drafter.Eagle3Drafter.step>` for several requests at
    once: ``tokens`` [R], ``states`` [R, H], ``positions`` [R] hold the parts' rows in order; each
    part's keys and values go to its own cache. Returns output states [R, H]."""
    R = tokens.shape[0]
    pad = padded_rows(R) - R  # bounded row counts for the matmul kernels; the padded rows attend nothing
    if pad:
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])
        states = torch.cat([states, states.new_zeros(pad, states.shape[1])])
        positions = torch.cat([positions, positions.new_zeros(pad)])
    fast = drafter._fused()
    if fast is not None:
        q, k, v = fast.project(drafter, tokens, states, positions)  # [R, heads, D]
        heads, q_size = fast.heads, fast.q_size
    else:
        x = drafter.midlayer.pre(drafter.embed_tokens(tokens), states).unsqueeze(0)  # [1, R, 2H]
        cos, sin = drafter.rotary(x, positions.unsqueeze(0))
        q, k, v = (t[0].transpose(0, 1) for t in drafter.midlayer.self_attn.qkv(x, cos, sin))  # [R, heads, D]
        heads = drafter.config.num_attention_heads
        q_size = heads * drafter.config.head_dim
    attn = states.new_zeros(states.shape[0], q_size)
    start = 0
    for p in parts:
        s, e = start, start + p.rows
        qp, kp, vp = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, rows, D]
        kernel = fast.kernel if fast is not None else None
        with bound(drafter, p.kv) as d:
            keys, values, mask = d.append_kv(kp, vp, p.mask, qp.dtype, build_mask=kernel is None)
        if kernel is not None:  # as FastEagle3.step: the bf16 kernel, prompt unmasked, levels under the mask
            past = keys.shape[-2] - (e - s)
            plan = AttentionPlan.of(e - s, past, mask, heads // kp.shape[1], qp.device, kernel=kernel)  # None: causal
            attn[s:e] = plan.attend_rows(qp, keys, values, past, None)
        else:
            folded = _fold_mask(mask, e - s, heads // kp.shape[1], keys.shape[-2])  # as FastEagle3.step
            out = attend(qp, keys, values, mask, folded)
            attn[s:e] = out[0].transpose(0, 1).reshape(e - s, q_size)
        start = e
    if fast is not None:
        return fast.finish(states, attn)[:R]
    return drafter.midlayer.post(states.unsqueeze(0), attn.unsqueeze(0)).squeeze(0)[:R]
