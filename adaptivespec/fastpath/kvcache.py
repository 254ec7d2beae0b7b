"""A KV cache that appends in place: transformers' ``DynamicCache`` with preallocated layers.

``DynamicLayer.update`` grows the cache with ``torch.cat``, which copies every layer's whole cache
at every step: O(context) bytes per token, the cost that makes long prompts slow (at 4k tokens of
context, 30 layers x K and V x 1.5 MB in bfloat16). :class:`BufferedLayer` writes the new rows into
a buffer reserved up front (grown by doubling if a generation outruns it) and hands attention a
view of the filled prefix, so a step costs O(new rows) in the cache. ``crop`` only moves the end,
and the in-place compaction of :func:`adaptivespec.runtime.compact_cache` writes through the views.

Attention reads the same values in the same order as with ``DynamicCache``: logits are identical.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class BufferedLayer(DynamicLayer):
    """One layer's keys and values ``[batch, kv_heads, length, head_dim]``, views of a larger buffer."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self._k: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.allocate(b, h, d, value_states.shape[-1], key_states.dtype, key_states.device, zero=False)

    def allocate(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device,
                 *, zero: bool = True) -> None:
        """Allocate the buffers now (``zero``: written once, so their pages are resident from here on)."""
        new = torch.zeros if zero else torch.empty
        self.device = torch.device(device)
        self._k = new(batch, heads, self.capacity, key_dim, dtype=dtype, device=device)
        self._v = new(batch, heads, self.capacity, value_dim, dtype=dtype, device=device)
        self.length = 0
        self.is_initialized = True
        self._view()

    # ``keys`` / ``values``: views of the filled prefix, made when read (the batch engine moves the
    # ends of 8 requests x 30 layers every step and reads none of them: 1.3 ms a step on a 2-vCPU EPYC
    # went into views made eagerly); what transformers' own code assigns is kept while no buffer is
    @property
    def keys(self):
        k = getattr(self, "_k", None)
        return k[:, :, : self.length] if k is not None else self.__dict__.get("_keys")

    @keys.setter
    def keys(self, value) -> None:
        self.__dict__["_keys"] = value

    @property
    def values(self):
        v = getattr(self, "_v", None)
        return v[:, :, : self.length] if v is not None else self.__dict__.get("_values")

    @values.setter
    def values(self, value) -> None:
        self.__dict__["_values"] = value

    def _view(self) -> None:
        """Nothing to do: the views are made when read (kept for callers that moved ``length``)."""

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        k = self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[-1])
        v = self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[-1])
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v, self.capacity = k, v, cap

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (a negative count, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: expected a negative number of rows to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._view()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._view()


def buffered_cache(config, capacity: int, *, dtype: torch.dtype | None = None, device=None) -> DynamicCache:
    """A ``DynamicCache`` for ``config``'s model whose layers are :class:`BufferedLayer` s of ``capacity`` rows.

    With ``dtype`` the buffers are allocated (zeroed) here rather than at the first forward."""
    cache = DynamicCache(config=config)
    # full-attention layers, and sliding-window ones: the engine loads only windows at least as wide as
    # max_position_embeddings (adaptivespec.models.attention_unsupported), full attention for every
    # context; other kinds (recurrent, hybrid) keep their own logic
    cache.layers = [BufferedLayer(capacity) if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    if dtype is not None:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for layer in cache.layers:
            if isinstance(layer, BufferedLayer):
                layer.allocate(1, heads, head_dim, head_dim, dtype, device)
    return cache


def reusable(cache: DynamicCache | None, positions: int) -> bool:
    """``cache`` holds only :class:`BufferedLayer` s, each with room for ``positions`` rows: a new
    generation can reuse it (:func:`empty` it) instead of allocating one."""
    return cache is not None and all(isinstance(layer, BufferedLayer) and layer.capacity >= positions
                                     for layer in cache.layers)


def empty(cache: DynamicCache) -> DynamicCache:
    """``cache`` with every layer's length set back to 0 (its buffers kept)."""
    for layer in cache.layers:
        layer.reset()
    return cache
