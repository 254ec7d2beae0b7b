"""Sequences kept for the requests that follow (``batch.prefix_cache_mb``): a request whose prompt
starts with an earlier request's tokens reads only the rest of it.

A chat's next turn resends the whole conversation, every request of an application starts with the
same system prompt, an evaluation sends the same prompt again: llama-server keeps such prompts
(``--cache-ram``), SGLang in its radix cache, vLLM by hashed blocks. Here a request's prompt is
kept once it has been read, its whole sequence (prompt and answer) when it ends, and a request about
to read its prompt takes the kept sequence that shares the longest prefix with it.

What is kept per sequence: its tokens, the target's keys and values for them and, for a config with
a draft head, the head's input state per position (the fused hidden states of the target's layers it
reads). A request that starts from a kept prefix copies the keys and values into its lane's cache and
hands the head the rows it would have run itself, with those of the first chunk it reads: the head
follows them in that step or, in a plain step, they wait with the lane's pending rows until it next
drafts, as a prompt read whole would, so what it drafts is what it would have drafted after reading
the whole prompt (and the row budget, which learns from the steps without prompt chunks, does not
see them). At most ``len(prompt) - 1`` positions come from the cache: the prompt's last row runs,
its logits give the first token. A finished request keeps the positions it committed: the tokens
of its last step (it ended before committing them) are read again by a next turn.

Memory: one pool of ``batch.prefix_cache_mb``, taken when the engine is built and written when a
server starts (:meth:`PrefixCache.resident`: its memory at its high-water mark before the first
request), in blocks of :data:`BLOCK` positions; when a sequence does not fit, the least recently
used ones leave. Worked example with BLOCK 16: a kept 40-token sequence
holds blocks ``[7, 3, 9]``, its positions at pool slots ``7*16 .. 7*16+15, 3*16 .. 3*16+15,
9*16 .. 9*16+7``; a prompt sharing its first 30 tokens gets those 30 positions.
"""

from __future__ import annotations

import collections
import itertools
from typing import Sequence

import attrs
import numpy as np
import torch

BLOCK = 16
"""Positions per block of the pool."""
MIN_REUSE = 16
"""Fewer shared positions than this are read again (the copies would cost about what they save)."""


@attrs.define(eq=False)
class Kept:
    """One kept sequence."""

    tokens: np.ndarray
    """[n] its token ids."""
    blocks: list[int]
    """The pool's blocks holding its positions, in order (:meth:`PrefixCache._slots`)."""


class PrefixCache:
    """Sequences' keys and values (and draft-head input states) kept in one pool, least recently used out."""

    def __init__(self, config, megabytes: float, dtype: torch.dtype, device, head_size: int | None = None) -> None:
        """``config``: the target's model config; ``head_size``: the width of the draft head's input
        state (None: no head)."""
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        item = torch.empty(0, dtype=dtype).element_size()
        per_position = (2 * layers * kv_heads * head_dim + (head_size or 0)) * item
        self.blocks = int(megabytes * 2**20) // (per_position * BLOCK)
        positions = self.blocks * BLOCK
        # taken, not written: its pages become resident as sequences are kept, or all at once (resident)
        self.k = torch.empty(layers, kv_heads, positions, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.states = torch.empty(positions, head_size, dtype=dtype, device=device) if head_size else None
        self.free = list(range(self.blocks))
        self.kept: collections.OrderedDict[int, Kept] = collections.OrderedDict()  # oldest use first
        self._ids = itertools.count()
        self.device = device

    def resident(self) -> None:
        """Write the free blocks once (zeros), so that the pool's memory is resident from now on (a
        server's start-up: its memory at its high-water mark before the first request)."""
        if self.free:
            slots = self._slots(self.free, len(self.free) * BLOCK)
            self.k.index_fill_(2, slots, 0)
            self.v.index_fill_(2, slots, 0)
            if self.states is not None:
                self.states.index_fill_(0, slots, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.states) if t is not None)

    @property
    def positions(self) -> int:
        """Positions kept now."""
        return sum(len(k.tokens) for k in self.kept.values())

    def match(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The kept sequence sharing the longest prefix with ``tokens`` (its key, None: none) and
        how many positions it shares."""
        t = np.asarray(tokens, dtype=np.int64)
        best, shared = None, 0
        for key, kept in self.kept.items():
            m = min(len(kept.tokens), len(t))
            if m <= shared:
                continue
            differ = np.flatnonzero(kept.tokens[:m] != t[:m])
            n = int(differ[0]) if differ.size else m
            if n > shared:
                best, shared = key, n
        return best, shared

    def load(self, prompt: Sequence[int], cache) -> tuple[int, torch.Tensor | None]:
        """Fill the empty ``cache`` (a lane's target cache) with the longest kept prefix of
        ``prompt``, at most ``len(prompt) - 1`` positions. Returns the positions filled (0: none)
        and their draft-head input states [n, head_size] (None without a head)."""
        key, shared = self.match(prompt)
        n = min(shared, len(prompt) - 1)
        if key is None or n < MIN_REUSE:
            return 0, None
        self.kept.move_to_end(key)
        slots = self._slots(self.kept[key].blocks, n)
        for i, layer in enumerate(cache.layers):
            layer.update(self.k[i].index_select(1, slots).unsqueeze(0), self.v[i].index_select(1, slots).unsqueeze(0))
        return n, (self.states.index_select(0, slots) if self.states is not None else None)

    def take(self, r) -> int:
        """What is kept of request ``r``'s prompt, taken into its lane (the scheduler asks for every
        request that holds a lane and has read none of its prompt, at every step until its first
        chunk runs): the keys and values into the lane's cache, the head's rows for them
        (``lane.kept_rows``) to go with its first chunk's, so the head follows them, or leaves them
        pending, as it would have followed the prompt read whole. Returns the tokens taken."""
        lane = r.lane
        n, states = self.load(r.prompt, lane.engine.runtime.cache)
        if n and states is not None:
            device = states.device
            lane.kept_rows = (torch.tensor(r.prompt[1:n + 1], dtype=torch.long, device=device), states,
                              torch.arange(n, device=device))
        return n

    def store(self, tokens: Sequence[int], cache, states: torch.Tensor | None = None) -> bool:
        """Keep ``tokens`` with their keys and values (the first ``len(tokens)`` positions of
        ``cache``) and draft-head input states (``states[:len(tokens)]``). Where a kept sequence
        already holds ``tokens``, nothing is copied; where ``tokens`` extends one (the prompt kept
        when it was read, now with its answer; a chat's previous turn), that one's blocks are taken
        over and only the new positions copied. Returns whether anything was copied."""
        n = len(tokens)
        need = -(-n // BLOCK)
        if n < MIN_REUSE or need > self.blocks or (self.states is not None and states is None):
            return False
        t = np.asarray(tokens, dtype=np.int64)
        base: Kept | None = None  # no kept sequence is a prefix of another: at most one is of tokens
        for key, kept in self.kept.items():
            m = min(len(kept.tokens), n)
            if np.array_equal(kept.tokens[:m], t[:m]):
                if len(kept.tokens) >= n:
                    self.kept.move_to_end(key)
                    return False
                base = self.kept.pop(key)
                break
        blocks, start = (list(base.blocks), len(base.tokens)) if base is not None else ([], 0)
        while len(self.free) < need - len(blocks):
            self._drop(next(iter(self.kept)))
        blocks += [self.free.pop() for _ in range(need - len(blocks))]
        slots = self._slots(blocks, n)
        new = slots[start:]
        for i, layer in enumerate(cache.layers):
            self.k[i].index_copy_(1, new, layer.keys[0, :, start:n])
            self.v[i].index_copy_(1, new, layer.values[0, :, start:n])
        if self.states is not None:
            self.states.index_copy_(0, new, states[start:n])
        self.kept[next(self._ids)] = Kept(tokens=t, blocks=blocks)
        return True

    def _slots(self, blocks: list[int], n: int) -> torch.Tensor:
        """[n] the pool slots of the first ``n`` positions held by ``blocks``, in order."""
        return (torch.tensor(blocks, device=self.device)[:, None] * BLOCK
                + torch.arange(BLOCK, device=self.device)).flatten()[:n]

    def _drop(self, key: int) -> None:
        self.free.extend(self.kept.pop(key).blocks)

    def clear(self) -> None:
        for key in list(self.kept):
            self._drop(key)
