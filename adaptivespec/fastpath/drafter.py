"""A lean inference path for the EAGLE-3 draft head on a CPU, bfloat16 or float32 (:mod:`adaptivespec.fastpath.forward` for the head).

:class:`~adaptivespec.drafter.Eagle3Drafter` keeps transformers-style modules (separate Q, K and V,
gate and up projections, ``LlamaRMSNorm``) so that its checkpoint layout and training stay those of
SpecForge / EAGLE. A draft step runs them for one to a few rows, where each op's fixed cost dominates.
:class:`FastEagle3` computes the same function from the same weights with fewer, fused ops:

- one Q|K|V projection and one gate|up projection (weights concatenated once; in bfloat16 prepacked,
  ``fc`` and ``lm_head`` too; in float32 torch's own ``F.linear``);
- RMSNorm as one op (transformers' bfloat16 rounding with torch's ops), rotary embedding of Q and K
  together, SwiGLU in place;
- with SGLang's CPU kernels (:func:`~adaptivespec.fastpath.prepack.sgl_ops`): their packed matmuls, RMSNorm,
  fused residual-add + RMSNorm and SwiGLU.

With torch's ops the outputs are those of the modules bit for bit; with SGLang's kernels they agree
to bfloat16 rounding. It applies where the target's fused forward does (:func:`supported`; the same
``$ADAPTIVESPEC_NO_FASTFORWARD`` / ``$ADAPTIVESPEC_NO_SGL_KERNEL`` / ``$ADAPTIVESPEC_NO_PREPACK``
switches; the last two act on bfloat16 only): float32 heads take it on any CPU, with torch's ops
(agreeing with the modules to float32 rounding). The runtime enables it once (:func:`fast_drafter`); the
head's inference entry points (``fuse``, ``step``, ``log_probs``) then use it when no gradient is
wanted and the head is in eval mode. The packed copies are rebuilt when the weights changed since
(an optimizer step, ``load_state_dict``, any in-place update: the parameters' version counters tell),
and dropped by ``train()`` so that training does not keep them in memory.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adaptivespec.fastpath.forward import (DISABLE_ENV, AttentionPlan, _fold_mask, _probe, attend, dtype_unsupported,
                                           pack, rms_norm, rope)
from adaptivespec.fastpath.native import attention_ops
from adaptivespec.fastpath.prepack import sgl_ops


def supported(drafter) -> str | None:
    """None when :class:`FastEagle3` can run ``drafter``; otherwise why not (a short reason)."""
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return f"${DISABLE_ENV}=1"
    reason = dtype_unsupported(drafter)
    if reason is not None:
        return reason
    if getattr(drafter.config, "hidden_act", "silu") != "silu":
        return "activation differs"
    return None


class FastEagle3:
    """The head's inference computations, fused (see the module's text). Weights are packed by
    :meth:`ready`, on first use and again whenever the head's parameters changed."""

    def __init__(self, drafter, sgl=None) -> None:
        cfg = drafter.config
        self.sgl = sgl
        self.kernel = attention_ops() if drafter.lm_head.weight.dtype == torch.bfloat16 else None
        self.backend = "sgl_kernel" if sgl is not None else "onednn"
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden = cfg.hidden_size
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.params: tuple[torch.Tensor, ...] = ()
        self.versions: tuple[int, ...] = ()

    # -- packing ---------------------------------------------------------------------------------
    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.params)

    def release(self) -> None:
        """Drop the packed copies (training is about to change the weights); :meth:`ready` repacks."""
        self.params, self.versions = (), ()
        for name in ("fc", "qkv", "o", "gate_up", "down", "lm_head", "norms"):
            self.__dict__.pop(name, None)

    def ready(self, drafter) -> "FastEagle3":
        """Pack ``drafter``'s current weights unless the packed copies still hold them; returns self."""
        if self.params and self._versions() == self.versions:
            return self
        sgl, layer = self.sgl, drafter.midlayer
        a, m = layer.self_attn, layer.mlp
        dtype = drafter.lm_head.weight.dtype
        self.fc = pack((drafter.fc,), dtype, sgl)
        self.qkv = pack((a.q_proj, a.k_proj, a.v_proj), dtype, sgl)
        self.o = pack((a.o_proj,), dtype, sgl)
        self.gate_up = pack((m.gate_proj, m.up_proj), dtype, sgl)
        self.down = pack((m.down_proj,), dtype, sgl)
        self.lm_head = pack((drafter.lm_head,), dtype, sgl)
        self.norms = {name: (mod.weight.detach(), mod.variance_epsilon) for name, mod in (
            ("emb", layer.input_layernorm), ("state", layer.hidden_norm), ("post", layer.post_attention_layernorm),
            ("out", drafter.norm))}
        self.params = tuple(drafter.parameters())
        self.versions = self._versions()
        return self

    # -- pieces ----------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return rms_norm(x, *self.norms[which], self.sgl)

    def _linear(self, lin, x: torch.Tensor) -> torch.Tensor:
        """``lin`` over the last dimension of ``x`` [..., in] (any leading shape)."""
        return lin(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    # -- the head's entry points ------------------------------------------------------------------
    def fuse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``fc`` over the concatenated target hidden states ``parts`` [..., H_t] each -> [..., H]."""
        return self._linear(self.fc, torch.cat(parts, dim=-1))

    def log_probs(self, out_state: torch.Tensor) -> torch.Tensor:
        """Output states [.., H] -> draft-vocabulary log-probabilities [.., Vd] (float32)."""
        x = out_state.reshape(-1, self.hidden)
        logits = self.lm_head(self._rms(x, "out").contiguous())
        return torch.log_softmax(logits.float(), dim=-1).view(*out_state.shape[:-1], -1)

    def project(self, drafter, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor):
        """The attention input of ``b`` new positions: q [b, H_q, D], k / v [b, H_kv, D], RoPE applied."""
        b = tokens.shape[0]
        H, Hkv, D, qs = self.heads, self.kv_heads, self.head_dim, self.q_size
        emb = F.embedding(tokens, drafter.embed_tokens.weight)
        x = torch.cat([self._rms(emb, "emb"), self._rms(state, "state")], dim=-1)  # [b, 2H]
        cos, sin = drafter.rotary(x, positions.unsqueeze(0))  # [1, b, D] each, in x's dtype
        qkv = self.qkv(x)  # [b, qs + 2 ks]
        qk = rope(qkv[:, : qs + self.kv_size].view(b, H + Hkv, D), cos[0].unsqueeze(1), sin[0].unsqueeze(1))
        return qk[:, :H], qk[:, H:], qkv[:, qs + self.kv_size:].view(b, Hkv, D)

    def finish(self, state: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output states [b, H] from the input states and the attention output ``attn`` [b, H_q * D]."""
        o = self.o(attn)
        if self.sgl is not None:
            h = state.clone(memory_format=torch.contiguous_format)  # the residual is the caller's: add into a copy
            self.sgl.fused_add_rmsnorm_cpu(o, h, *self.norms["post"])  # h += o; o = rmsnorm(h)
            gu = self.gate_up(o)
            act = self.sgl.silu_and_mul_cpu(gu)
        else:
            h = state + o
            gu = self.gate_up(self._rms(h, "post"))
            inter = gu.shape[-1] // 2
            act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        return h + self.down(act)

    def step(self, drafter, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`Eagle3Drafter.step <adaptivespec.drafter.Eagle3Drafter.step>`, fused: same arguments,
        same cache updates, output states [b, H]."""
        b = tokens.shape[0]
        H, Hkv = self.heads, self.kv_heads
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in self.project(drafter, tokens, state, positions))
        keys, values, mask = drafter.append_kv(k, v, mask, q.dtype, build_mask=self.kernel is None)
        if self.kernel is not None:  # the bf16 kernel: the prompt read unmasked, the draft levels under the mask
            past = keys.shape[-2] - b  # (no mask: causal over the new rows)
            plan = AttentionPlan.of(b, past, mask, H // Hkv, q.device, kernel=self.kernel)
            return self.finish(state, plan.attend_rows(q, keys, values, past, None))
        folded = _fold_mask(mask, b, H // Hkv, keys.shape[-2])  # long context, a level's few rows (fastpath.forward)
        attn = attend(q, keys, values, mask, folded)
        return self.finish(state, attn[0].transpose(0, 1).reshape(b, self.q_size))


def fast_drafter(drafter) -> FastEagle3 | None:
    """Enable the fused inference path on ``drafter`` (kept on it) and return it, or None where it
    does not apply (:func:`supported`), which also switches a previously enabled one off.

    Called once by the runtime, as :func:`~adaptivespec.fastpath.forward.fast_forward` for the target;
    the weights are packed on first use."""
    if drafter is None or not hasattr(drafter, "midlayer"):
        return None
    if supported(drafter) is not None:
        drafter.fast = None
        return None
    cfg = drafter.config
    fp32 = drafter.lm_head.weight.dtype == torch.float32  # torch's ops only (SGLang's CPU kernels are bf16 / fp16)
    sgl = None if fp32 else _probe(sgl_ops(), cfg.hidden_size, cfg.intermediate_size)
    key = "sgl_kernel" if sgl is not None else "onednn"
    if drafter.fast is None or drafter.fast.backend != key:
        drafter.fast = FastEagle3(drafter, sgl)
    return drafter.fast
