"""EAGLE-3's training-time test (TTT): the drafter unrolled over K draft steps, and its loss.

Notation for one sequence ``t[0..T-1]`` (prompt then response): ``g[i] = fc([h_a[i]; h_b[i];
h_c[i]])`` fuses three target layers at position i, ``z[p]`` are the target's logits at p
(predicting ``t[p+1]``), restricted to the draft vocabulary ``D``.

* Step 0 (verified pairs, causal): drafter position i reads ``(embed(t[i+1]), g[i])`` and its
  output ``o_0[i]`` predicts ``t[i+2]``.
* Step j = 1..K-1 (drafting, teacher-forced): chain i is fed at position ``i+j`` with
  ``(embed(t[i+j+1]), o_{j-1}[i])``; it attends to the step-0 keys ``k_0[0..i]`` and to its own
  keys ``k_1[i] .. k_j[i]`` (the diagonal); ``o_j[i]`` predicts ``t[i+j+2]``. This is exactly a
  depth-j node drafted from the root at target position i+1 at inference time.

Loss (soft cross-entropy against the target, as SpecForge)::

    L = sum_j decay**j * mean_{i in M_j} [ - sum_{d in D} p(d | z[i+j+1]) log q_j(d | i) ]
    p = softmax(z restricted to D),   q_j = softmax(lm_head(norm(o_j)))

``M_j``: chains whose predicted index ``i+j+2`` is a response token inside the sequence whose
token is in ``D``. Top-1 agreement ``acc_j = mean [argmax q_j == argmax p]`` over ``M_j``.
The target's hidden states are recomputed each batch (no grad, the target's dtype); only the
draft-vocabulary rows of its lm_head are evaluated.

Top-k soft labels (``topk`` / ``--label-topk``, always with ``--feature-cache``): ``p`` is
replaced by its ``k`` largest entries renormalised to sum to 1, and the loss is computed without
a dense ``[rows, Vd]`` label tensor (``topk_cross_entropy``). Top-1 agreement is then "the
target's top-1 token has the drafter's largest logit" (the same as argmax equality up to ties).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from adaptivespec.training.data import Batch


@attrs.frozen
class Features:
    states: torch.Tensor  # [B, T, 3 * H_t] concatenated aux hidden states (target dtype)
    probs: torch.Tensor  # [M, Vd] float32 target distributions at the rows with a loss ([M, k] with ``index``)
    row: torch.Tensor  # [B, T + K + 2] int64: row of ``probs`` for predicted index q, -1 = no loss
    index: torch.Tensor | None = None  # [M, k] int64 draft ids of ``probs`` (top-k labels, largest first)

    def to(self, device) -> "Features":
        """The features on ``device`` (the feature cache reads them on the host)."""
        move = (lambda x: None if x is None else x.to(device, non_blocking=True))
        return Features(move(self.states), move(self.probs), move(self.row), move(self.index))


@attrs.frozen
class StepStats:
    loss: torch.Tensor  # weighted total (graph attached)
    step_loss: list[float]
    correct: list[int]
    count: list[int]
    by_record: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per step j: rows and top-1 hits per batch row [B]


@torch.no_grad()
def target_features(target, aux_layers: list[int], batch: Batch, vocab_ids: torch.Tensor, t2d: torch.Tensor, k_steps: int,
                    topk: int | None = None) -> Features:
    """One no-grad target forward: fused-layer inputs and draft-vocabulary target distributions.

    ``topk``: keep only each distribution's ``topk`` largest entries, renormalised (sparse labels).
    """
    out = target.model(input_ids=batch.ids, output_hidden_states=True)
    hs = out.hidden_states
    states = torch.cat([hs[i + 1] for i in aux_layers], dim=-1)
    bi, qi, row = label_rows(loss_mask(batch, t2d), k_steps)
    w = target.get_output_embeddings().weight
    w = w[vocab_ids.to(w.device)]  # [Vd, H_t]
    logits = out.last_hidden_state[bi, qi - 1] @ w.T  # z[q-1] restricted to D
    if topk is not None:
        logp, index = torch.log_softmax(logits.float(), dim=-1).topk(min(topk, logits.shape[-1]), dim=-1)
        return Features(states, torch.softmax(logp, dim=-1), row, index)
    probs = torch.softmax(logits.float(), dim=-1)
    return Features(states, probs, row)


def label_rows(valid: torch.Tensor, k_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bi, qi, row) for a [B, T] mask of predicted indices with a loss (see ``Features.row``)."""
    b, t = valid.shape
    bi, qi = valid.nonzero(as_tuple=True)
    row = torch.full((b, t + k_steps + 2), -1, dtype=torch.long, device=valid.device)
    row[bi, qi] = torch.arange(bi.shape[0], device=valid.device)
    return bi, qi, row


def loss_mask(batch: Batch, t2d: torch.Tensor) -> torch.Tensor:
    """[B, T] predicted indices q with a loss: response tokens (q >= 1) inside the draft vocabulary."""
    ids = batch.ids
    q = torch.arange(ids.shape[1], device=ids.device)
    return (q >= batch.prompt_lens[:, None]) & (q < batch.lengths[:, None]) & (q >= 1) & t2d[ids]


class _TopkCE(torch.autograd.Function):
    """Row losses ``lse(z) * sum(p) - sum_k p_k z[idx_k]`` and whether ``z[idx_0]`` is the row max."""

    @staticmethod
    def forward(ctx, logits, p, index):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        m = z.amax(-1, keepdim=True)
        e = (z - m).exp_()
        se = e.sum(-1, keepdim=True)
        lse = (m + se.log()).squeeze(-1)
        picked = z.gather(-1, index)
        loss = lse * p.sum(-1) - (p * picked).sum(-1)
        correct = picked[:, 0] >= m.squeeze(-1)
        ctx.save_for_backward(e, se, p, index)
        ctx.in_dtype = logits.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad, _):
        e, se, p, index = ctx.saved_tensors
        g = e * ((grad * p.sum(-1))[:, None] / se)  # softmax(z) * sum(p) * grad
        g.scatter_add_(-1, index, -(grad[:, None] * p).to(g.dtype))
        return g.to(ctx.in_dtype), None, None


def topk_cross_entropy(logits: torch.Tensor, p: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of ``logits`` [n, V] against sparse labels ``p`` [n, k] at ``index`` [n, k].

    Returns (row losses [n] float32, top-1 agreement [n] bool). Equals the dense
    ``-(P * log_softmax(logits)).sum(-1)`` with ``P`` scattered from (p, index), without ``P``.
    """
    return _TopkCE.apply(logits, p, index)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _diag_attend(q, k0, v0, dk: list, dv: list, bias: torch.Tensor) -> torch.Tensor:
    """Attention of chains over step-0 keys (``bias``: causal, additive) plus their own keys.

    q [B, h, C, d]; k0 / v0 [B, h, T, d]; dk / dv: j tensors [B, h, C, d]. Returns [B, C, h*d].
    """
    scale = q.shape[-1] ** -0.5
    s0 = (q @ k0.transpose(-1, -2)).float() * scale + bias  # [B, h, C, T]
    sd = torch.stack([(q * k).sum(-1) for k in dk], dim=-1).float() * scale  # [B, h, C, j]
    p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1).to(v0.dtype)
    t = k0.shape[2]
    out = p[..., :t] @ v0 + (p[..., t:].unsqueeze(-1) * torch.stack(dv, dim=-2)).sum(-2)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _step_loss(drafter, state: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor, index: torch.Tensor | None = None):
    """(mean loss, hits [n] bool, n) over the chains of ``state`` with a label (``rows >= 0``)."""
    sel = rows >= 0
    n = int(sel.sum())
    if n == 0:
        return state.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=state.device), 0
    if index is not None:
        r = rows[sel]
        losses, correct = topk_cross_entropy(drafter.lm_head(drafter.norm(state[sel])), probs[r], index[r])
        return losses.mean(), correct, n
    logp = torch.log_softmax(drafter.lm_head(drafter.norm(state[sel])).float(), dim=-1)
    p = probs[rows[sel]]
    loss = -(p * logp).sum(-1).mean()
    return loss, logp.argmax(-1) == p.argmax(-1), n


def unroll(drafter, ids: torch.Tensor, g: torch.Tensor, k_steps: int, first_chain: int = 0):
    """Yield ``(j, offset, o_j)``: drafter outputs of step j for chains ``offset..T-1`` ([B, C, H]).

    ``ids`` [B, T] tokens, ``g`` [B, T, H] fused target states. Step 0 covers every chain;
    steps >= 1 only chains >= ``first_chain``. Tokens past the end are the last id (masked).
    """
    b, t = ids.shape
    attn_mod = drafter.midlayer.self_attn
    groups = attn_mod.heads // attn_mod.kv_heads
    ids_ext = torch.cat([ids, ids[:, -1:].expand(b, k_steps + 1)], dim=1)
    dtype = drafter.fc.weight.dtype

    def embed(lo: int, hi: int) -> torch.Tensor:
        return drafter.embed_tokens(ids_ext[:, lo:hi]).to(dtype)

    # step 0: causal over the verified pairs
    x = drafter.midlayer.pre(embed(1, t + 1), g)
    dev = ids.device
    cos, sin = drafter.rotary(x, torch.arange(t, device=dev)[None])
    q, k0, v0 = attn_mod.qkv(x, cos, sin)
    a = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=groups > 1)
    state = drafter.midlayer.post(g, a.transpose(1, 2).reshape(b, t, -1))
    yield 0, 0, state
    s = first_chain
    state = state[:, s:]
    k0, v0 = _expand(k0, groups), _expand(v0, groups)
    chain, key = torch.arange(s, t, device=dev)[:, None], torch.arange(t, device=dev)[None, :]
    bias = torch.zeros(t - s, t, device=dev).masked_fill(key > chain, float("-inf"))
    dk, dv = [], []
    for j in range(1, k_steps):
        x = drafter.midlayer.pre(embed(s + j + 1, t + j + 1), state)
        cos, sin = drafter.rotary(x, torch.arange(s + j, t + j, device=dev)[None])
        q, k, v = attn_mod.qkv(x, cos, sin)
        dk.append(_expand(k, groups))
        dv.append(_expand(v, groups))
        state = drafter.midlayer.post(state, _diag_attend(q, k0, v0, dk, dv, bias))
        yield j, s, state


def ttt_loss(drafter, batch: Batch, feats: Features, k_steps: int, decay: float = 0.8, by_record: bool = False) -> StepStats:
    """The K-step TTT unroll of ``drafter`` on ``batch`` and its weighted loss (see module doc).

    ``by_record``: also count labelled rows and top-1 hits per batch row at every step (validation per kind).
    """
    b, t = batch.ids.shape
    g = drafter.fc(feats.states.to(drafter.fc.weight.dtype))  # [B, T, H]
    # at step j the first labelled chain of a record with prompt length P is P - j - 2, so steps >= 1
    # unroll from the batch's shortest prompt - K - 1: no chain with a label at any step is left out
    s = max(0, int(batch.prompt_lens.min()) - k_steps - 1)
    total, losses, corrects, counts, per = 0.0, [], [], [], []
    for j, off, state in unroll(drafter, batch.ids, g, k_steps, s):
        rows = feats.row[:, off + j + 2 : t + j + 2]
        loss, hits, count = _step_loss(drafter, state, rows, feats.probs, feats.index)
        total = total + decay**j * loss
        losses.append(float(loss.detach()))
        corrects.append(int(hits.sum()))
        counts.append(count)
        if by_record:
            bi = (rows >= 0).nonzero()[:, 0]
            per.append((torch.bincount(bi, minlength=b), torch.bincount(bi, weights=hits.double(), minlength=b).long()))
    return StepStats(total, losses, corrects, counts, per if by_record else None)
