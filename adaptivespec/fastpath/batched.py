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
    R          8, padded to 8 (ROW_BUCKET): the padded rows run the matmuls only

Rows are padded to a multiple of :data:`ROW_BUCKET` (:func:`padded_rows`) so that the matmul
kernels meet a bounded set of row counts (they keep per-shape state: see
:data:`adaptivespec.runtime.PREFILL_ROWS_MULTIPLE`); a padded row attends nothing, writes no
cache and is dropped from the outputs.

The target's layer pieces come from :class:`~adaptivespec.fastpath.forward.FastLlama` (bfloat16 on a
CPU, fused) or :class:`ModuleLayers` (any Llama-family model's own modules, float32 included, so
the batch engine's float32 output can be checked token for token against greedy decoding).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import attrs
import torch

from adaptivespec.fastpath.forward import AttentionPlan, _fold_mask, attend, fast_forward, rope

ROW_BUCKET = 8
"""Packed forwards run a multiple of this many rows up to 64, of :data:`ROW_BUCKET_LARGE` beyond."""
ROW_BUCKET_LARGE = 32


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to the bucket the packed forward runs (8, 16, ..., 64, 96, 128, ...)."""
    step = ROW_BUCKET if rows <= 64 else ROW_BUCKET_LARGE
    return -(-rows // step) * step


@attrs.define(eq=False, kw_only=True)
class Part:
    """One request's rows in a packed target forward."""

    cache: object
    """Its KV cache (transformers ``DynamicCache`` layout: ``cache.layers[i].update(k, v)``)."""
    rows: int
    mask: torch.Tensor | None = None
    """Additive (or bool) mask [1, 1, rows, past + rows]: a verify tree's; None: causal after the past."""


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
                   logit_rows: torch.Tensor, hidden: bool = False):
    """One target forward over every part's rows (``ids`` / ``positions`` [R], the parts' rows in
    order, then padding). Each part's new keys and values are appended to its cache.

    Returns (logits [len(logit_rows), V] of the rows ``logit_rows``, hidden states or None): with
    ``hidden``, transformers' ``hidden_states`` layout over all R rows (embeddings, each layer's
    output, the last one normed), each ``[1, R, H]``.
    """
    R = ids.shape[0]
    h = pieces.embed_rows(ids)  # [R, H]
    cos, sin = pieces.rotary_rows(h, positions)  # [R, 1, D]
    groups = pieces.heads // pieces.kv_heads
    bounds, plans, start = [], [], 0
    for p in parts:
        past = p.cache.get_seq_length()
        bounds.append((start, start + p.rows, past))
        plans.append(AttentionPlan.of(p.rows, past, p.mask, groups, ids.device))
        start += p.rows
    states = [pieces.keep(h)] if hidden else None
    attn = h.new_zeros(R, pieces.q_size)  # padded rows keep 0
    for i, L in enumerate(pieces.layers):
        q, k, v = pieces.project(L, h, cos, sin)  # [R, heads, D]
        for p, (s, e, past), plan in zip(parts, bounds, plans):
            qp, kp, vp = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, rows, D]
            keys, values = p.cache.layers[i].update(kp, vp)
            out = plan.attend(qp, keys, values, past, pieces.scale)  # [1, H, rows, D]
            attn[s:e] = out[0].transpose(0, 1).reshape(e - s, pieces.q_size)
        h = pieces.finish(L, h, attn)
        if states is not None and i + 1 < len(pieces.layers):
            states.append(pieces.keep(h))
    h = pieces.final_norm(h)
    if states is not None:
        states.append(h)
    logits = pieces.logits(h[logit_rows]) if logit_rows.numel() else h.new_zeros(0, 0)
    return logits, (tuple(t.unsqueeze(0) for t in states) if states is not None else None)


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
        with bound(drafter, p.kv) as d:
            keys, values, mask = d.append_kv(kp, vp, p.mask, qp.dtype)
        folded = _fold_mask(mask, e - s, heads // kp.shape[1], keys.shape[-2])  # as FastEagle3.step
        out = attend(qp, keys, values, mask, folded)
        attn[s:e] = out[0].transpose(0, 1).reshape(e - s, q_size)
        start = e
    if fast is not None:
        return fast.finish(states, attn)[:R]
    return drafter.midlayer.post(states.unsqueeze(0), attn.unsqueeze(0)).squeeze(0)[:R]
