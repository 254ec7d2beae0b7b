"""Tree attention without copying the cache: transformers' SDPA with grouped-query attention kept grouped.

With an explicit 4-D mask (every tree verification) and more than one query row, transformers'
``sdpa`` attention expands the key/value heads to the query heads (``repeat_kv``) before calling
``scaled_dot_product_attention``: a copy of each layer's whole cache per forward, for SmolLM2's
3 KV heads x 3. ``torch``'s SDPA takes the grouped heads directly (``enable_gqa=True``) with a
mask as well; the values are the same. :func:`use_tree_sdpa` switches a loaded model to that
path; prefill (causal, no mask) and single-row steps still go through transformers' own function.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "adaptivespec_sdpa"


def tree_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """``sdpa_attention_forward``, except that masked multi-row attention keeps the KV heads grouped.

    query ``[B, H, q, D]``, key/value ``[B, Hkv, kv, D]``, attention_mask ``[B, 1, q, kv]`` or None.
    """
    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or query.shape[2] == 1 or not grouped or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], dropout_p=dropout, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, tree_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_tree_sdpa(model) -> None:
    """Route ``model``'s attention through :func:`tree_sdpa_forward` when it uses plain ``sdpa``."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
