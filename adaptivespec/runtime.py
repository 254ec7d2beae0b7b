"""The torch runtime: target and drafter forwards for tree speculation (CPU, and CUDA as is).

It owns the target's KV cache (transformers ``DynamicCache``) and the drafter's, and offers the
four operations of a speculative step: :meth:`TorchRuntime.draft`, :meth:`TorchRuntime.verify_forward`,
(the verifier rule runs in between, outside the runtime) and :meth:`TorchRuntime.commit`.

State between steps (``P`` = tokens the target has processed)::

    target cache   positions [0, P)
    root           the last emitted token, at position P, not yet run through the target
    drafter cache  positions [0, P): drafter position i holds (embed(token[i+1]), state[i])
    root_state     drafter output at position P-1; root_logp its draft distribution of token P+1
"""

from __future__ import annotations

import logging

import torch

import adaptivespec
from adaptivespec.fastpath.attention import use_tree_sdpa
from adaptivespec.fastpath.bank import ShapeBank
from adaptivespec.fastpath.drafter import fast_drafter
from adaptivespec.fastpath.forward import fast_forward
from adaptivespec.fastpath.kvcache import buffered_cache, empty, reusable
from adaptivespec.fastpath.prepack import prepack_linears
from adaptivespec.models import cache_forward
from adaptivespec.sampling import pick_next, root_stats
from adaptivespec.tree import DraftLevels, draft_levels, draft_tree
from adaptivespec.types import DraftTree, TreeShape, VerifyResult


def compact_cache(cache, start: int, path: list[int], idx: torch.Tensor, tree_size: int) -> None:
    """Keep only the tree nodes ``path`` of the ``tree_size`` entries appended at ``start``.

    The accepted rows are copied into place ``[start, start + len(path))`` and the rest cropped:
    ~10x cheaper than an ``index_select`` over the whole cache. ``idx`` is ``path`` as a tensor.
    A chain accepted from the root (path == 0..k) needs no copy at all.
    """
    kept = len(path)
    if path != list(range(kept)):
        src = start + idx
        for layer in cache.layers:
            layer.keys[:, :, start : start + kept] = layer.keys[:, :, src]
            layer.values[:, :, start : start + kept] = layer.values[:, :, src]
    if tree_size > kept:
        cache.crop(-(tree_size - kept))


PREFILL_ROWS_MULTIPLE = 32
"""Prefill chunks run as a multiple of this many rows (the last real row repeated, the extra rows'
cache entries dropped; causal attention keeps them out of the real rows). The matmul kernels keep
per-shape state for every row count they meet: a server fed prompts of every length grew ~0.5 MiB
per new length (bf16, sgl_kernel; ~6 MiB with oneDNN's matmuls) without bound; this bounds the
prefill's row counts to ``prefill_chunk / 32`` shapes."""


_COST_TABLES: dict[tuple, object] = {}
"""Measured cost tables of this process (:meth:`TorchRuntime.cost_table`), by target, dtype, device,
threads and head: one per engine would read (or measure) the same table again."""
log = logging.getLogger("adaptivespec.costs")


class TorchRuntime:
    """Plain-PyTorch execution of prefill, tree drafting, tree verification and cache commit."""

    name = "torch"
    sampler = None
    """The engine's :class:`~adaptivespec.sampling.Sampler` at temperature > 0: prefill's first token
    and :meth:`ar_step` are drawn with it (None: greedy argmax)."""
    logits_processor = None
    """A callable that changes the next token's logits ([V]) in place before prefill and
    :meth:`ar_step` pick from them; the engine sets the grammar's mask here for structured output
    (None: the logits as computed). Verify trees are masked by the engine, not here."""
    keep_logits = False
    """Keep the row :meth:`pick` picked from, before processing, in :attr:`last_rows` (the engine
    sets it for a generation that returns log-probabilities)."""
    last_rows = None
    """[1, V] the logits row of the last :meth:`pick`, as the target gave them (with :attr:`keep_logits`)."""

    def __init__(self, target, drafter=None, config=None) -> None:
        self.target = target
        self.drafter = drafter
        use_tree_sdpa(target)  # tree verification without expanding the KV heads (a copy of the cache)
        # bfloat16 Llama on a CPU: the target's forward fused (QKV and gate|up in one matmul each, fused
        # norms, weights packed once); None elsewhere, and then the model itself runs
        self.fast = fast_forward(target)
        self.forward = self.fast if self.fast is not None else cache_forward(target)
        # the drafter's inference path fused likewise (Q|K|V and gate|up in one matmul each, fused norms)
        self.fast_drafter = fast_drafter(drafter)
        # bfloat16 on a CPU: weights laid out once for the matmul kernel, not per call (each model only
        # where its own modules run: the fused paths keep their own packed copies)
        for module in (target if self.fast is None else None, drafter if self.fast_drafter is None else None):
            if module is not None:
                prepack_linears(module)
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.neg = torch.finfo(self.dtype).min
        self.cache = None
        self.P = 0
        self.root: torch.Tensor | None = None  # 0-dim int64
        self.root_state: torch.Tensor | None = None  # [H]
        self.root_logp: torch.Tensor | None = None  # [Vd]
        self.bank: ShapeBank | None = None
        runtime = getattr(config, "runtime", None)
        self.prefill_chunk = getattr(runtime, "prefill_chunk", 0) or 0
        """Prompt tokens per prefill forward (0: the whole prompt at once)."""
        self._names = (getattr(getattr(config, "model", None), "target", None), getattr(runtime, "precision", None))

    def cost_table(self):
        """This machine's measured step costs for the target (and head) at the runtime's dtype, or
        None where none can be measured (no config, a target the packed forward cannot run; said
        once): the batch engine's :class:`~adaptivespec.fastpath.costs.CostTable`, read from its
        cache or measured (~30 s) and cached (:func:`~adaptivespec.fastpath.costs.load_or_measure`)."""
        target_name, dtype_name = self._names
        if target_name is None or dtype_name is None:
            return None
        key = (target_name, dtype_name, str(self.device), torch.get_num_threads(), self.drafter is not None)
        if key not in _COST_TABLES:
            from adaptivespec.fastpath.costs import load_or_measure  # the packed forwards: only when asked

            try:
                _COST_TABLES[key] = load_or_measure(self.target, self.drafter, target_name, dtype_name, self.dtype,
                                                    self.device, log=lambda m: log.warning("adaptivespec: %s", m))
            except Exception as exc:  # noqa: BLE001 - any failure to measure leaves the policy on its profile
                log.warning("adaptivespec: no measured cost table for %s (%s: %s)", target_name, type(exc).__name__, exc)
                _COST_TABLES[key] = None
        return _COST_TABLES[key]

    def prepare(self, shapes, capacity: int = 1024, extra_rows: int = 0) -> ShapeBank:
        """Build the shape bank: one executor per shape the policy may choose, before decoding.

        ``extra_rows``: verify slots beyond a shape's ``ndt`` (nodes added by candidate sources)."""
        self.bank = ShapeBank(shapes, capacity=capacity, dtype=self.dtype, device=self.device, extra_rows=extra_rows)
        return self.bank

    # -- prefill --------------------------------------------------------------------------------
    def reserve(self, positions: int) -> None:
        """Room for ``positions`` context positions (prompt, generated tokens and one verify tree)
        in every buffer a generation writes: the target's KV cache, the drafter's, the shape bank's
        masks. Allocated (and zeroed, so resident) here, then reused by every generation that fits;
        a longer one grows them at its prefill. A server calls this at start-up with its context
        length, so its memory reaches its high-water mark before the first request."""
        positions = self.reserved_positions(positions)
        if self.bank is not None:
            self.bank.reserve(positions)
        if not reusable(self.cache, positions):
            self.cache = None  # the old buffers go before the new ones are taken
            self.cache = buffered_cache(self.target.config, positions, dtype=self.dtype, device=self.device)
        if self.drafter is not None:
            self.drafter.reset_cache(capacity=positions)

    def reserved_positions(self, positions: int) -> int:
        """The cache rows :meth:`reserve` takes for ``positions`` context positions: one verify tree more."""
        rows = max(s.ndt for s in self.bank.shapes) + self.bank.extra_rows if self.bank is not None else 0
        return positions + rows + 1

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_new_tokens: int = 0) -> int:
        """Run the prompt; returns the first generated token (the target's greedy choice, or a
        draw from its sampling distribution when a sampler is set).

        The caches and the shape bank's buffers are sized here, once, for the whole generation
        (:meth:`reserve`; reused when they already fit). The prompt runs in chunks of
        ``runtime.prefill_chunk`` tokens, the drafter following each chunk (its position ``i`` reads
        token ``i + 1``: the next chunk's first token, or the first generated one at the end).
        """
        n = len(prompt_ids)
        self.reserve(n + (max_new_tokens or 1024))
        self.cache = empty(self.cache)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)  # [n]
        d = self.drafter  # emptied by reserve
        chunk = self.prefill_chunk or n
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            rows = end - start
            pad = -rows % PREFILL_ROWS_MULTIPLE  # rows run after the chunk's last one, then dropped
            part = ids[start:end] if not pad else torch.cat([ids[start:end], ids[end - 1 : end].expand(pad)])
            out = self.forward(input_ids=part.unsqueeze(0), cache=self.cache, use_cache=True,
                               output_hidden_states=d is not None, logits_to_keep=pad + 1)
            if pad:
                self.cache.crop(-pad)
            if end == n:
                self.root = self.pick(out.logits[0, 0], n)  # the chunk's last real row: position n's token
            if d is not None:
                state = d.fuse(out.hidden_states)  # [1, rows + pad, H]: causal, the real rows' as unpadded
                tokens = ids[start + 1 : end + 1] if end < n else torch.cat([ids[start + 1 :], self.root.reshape(1)])
                if pad:
                    tokens = torch.cat([tokens, tokens[-1:].expand(pad)])
                positions = torch.arange(start, end + pad, device=self.device)
                last = d.step(tokens, state[0], positions, None)[rows - 1]
                d.length -= pad
        self.P = n
        if d is not None:
            self._set_root(last)
        return int(self.root)

    def pick(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """The token of sequence position ``position`` from the logits [V] of the row before it
        (processed first, when set): greedy, or the sampler's keyed choice there."""
        if self.keep_logits:
            self.last_rows = (logits.clone() if self.logits_processor is not None else logits).unsqueeze(0)
        if self.logits_processor is not None:
            self.logits_processor(logits)
        return pick_next(self.sampler, logits, position)


    def _set_root(self, state: torch.Tensor) -> None:
        self.root_state = state
        self.root_logp = self.drafter.log_probs(state)

    # -- autoregressive ---------------------------------------------------------------------------
    @torch.inference_mode()
    def ar_step(self) -> int:
        """One plain decoding step: run the root, return the next token (greedy, or drawn with the sampler)."""
        out = self.forward(input_ids=self.root.reshape(1, 1), cache=self.cache, use_cache=True, logits_to_keep=1)
        self.P += 1
        self.root = self.pick(out.logits[0, -1], self.P)
        return int(self.root)

    # -- speculative step -----------------------------------------------------------------------
    def draft_root_stats(self) -> tuple[float, float, float]:
        """Draft top-1 probability, entropy (nats) and top-4 probability of the first token below
        the root (:func:`~adaptivespec.sampling.root_stats`: one host sync)."""
        top1, entropy, top4 = root_stats(self.root_logp)
        return top1, entropy, top4

    @torch.inference_mode()
    def draft(self, shape: TreeShape, rules) -> DraftTree:
        """Draft a tree of ``shape`` below the root; ``rules`` is the tree policy.

        Uses the shape's executor: the drafter's level masks and slot ancestry are written into
        its preallocated buffers (the tree block only) and the block is cleared after use
        (:class:`LevelMasks`).
        """
        d = self.drafter
        masks = LevelMasks(self, shape)

        def expand(tokens, states, parent_slots, depth):
            positions, mask = masks.inputs(tokens.shape[0], parent_slots, depth)
            out = d.step(tokens, states, positions, mask)
            masks.clear()
            return d.log_probs(out), out

        return draft_tree(shape, self.root, self.root_logp, self.root_state, expand, d.to_target, rules)

    def draft_levels(self, shape: TreeShape, rules) -> DraftLevels:
        """:meth:`draft`'s tree as a generator of levels (:func:`~adaptivespec.tree.draft_levels`),
        for a driver that runs the drafter itself (the batch engine)."""
        return draft_levels(shape, self.root, self.root_logp, self.root_state, self.drafter.to_target, rules)

    def verify_inputs(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's verify rows: positions [n] and the additive mask [1, 1, n, P + n] (written into
        the shape's buffer: :meth:`verify_done` clears it after the forward)."""
        n = tree.size
        mask = self.bank.get(tree.shape).verify_mask[:, :, :n, : self.P + n]  # [1, 1, n, P + n]
        mask[0, 0, :, self.P :].masked_fill_(~tree.ancestors, self.neg)
        return self.P + tree.depth, mask

    def verify_done(self, tree: DraftTree) -> None:
        self.bank.get(tree.shape).verify_mask[0, 0, : tree.size, self.P : self.P + tree.size].zero_()

    @torch.inference_mode()
    def verify_forward(self, tree: DraftTree):
        """One target forward over the tree. Returns (logits [n, V], hidden_states tuple)."""
        positions, mask = self.verify_inputs(tree)
        out = self.forward(
            input_ids=tree.tokens.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.drafter is not None,  # only the drafter's extension reads them
        )
        self.verify_done(tree)
        return out.logits[0], out.hidden_states

    @torch.inference_mode()
    def commit(self, tree: DraftTree, result: VerifyResult, hidden_states) -> None:
        """Keep only the accepted path in both caches and extend the drafter with it."""
        extension = self.commit_target(tree, result, hidden_states)
        if extension is not None:
            self._set_root(self.drafter.step(*extension, None)[-1])
        self.advance(result)

    def commit_target(self, tree: DraftTree, result: VerifyResult, hidden_states, fused: torch.Tensor | None = None,
                      head_kv=None):
        """The target's half of :meth:`commit`: its cache keeps the accepted path; the drafter's drops
        the draft slots. Returns the drafter's extension ``(tokens [kept], states [kept, H],
        positions [kept])``: the accepted pairs (token[i+1], state[i]) to run through it (None
        without a drafter). ``fused``: the tree rows' drafter input states [n, H] when the caller
        already has them (else fused from ``hidden_states`` here). ``head_kv``: the drafter's cache
        when it is not the drafter's own (a batch lane's :class:`~adaptivespec.fastpath.batched.DraftKV`).
        Then :meth:`advance`."""
        path = result.path
        kept = len(path)
        idx = torch.tensor(path, dtype=torch.long, device=self.device)
        compact_cache(self.cache, self.P, path, idx, tree.size)  # (a plain row: in place, nothing moves)
        if self.drafter is None:  # candidate sources alone: no drafter to extend
            return None
        (head_kv or self.drafter).length = self.P  # the head's rows from P on are this step's
        state = fused[idx] if fused is not None else self.drafter.fuse(hidden_states, idx)[0]  # [kept, H]
        tokens = torch.tensor(result.tokens, dtype=torch.long, device=self.device)  # accepted + bonus
        return tokens, state, self.P + torch.arange(kept, device=self.device)

    def advance(self, result: VerifyResult) -> None:
        """The accepted path is in the caches: the context grows by it and the bonus token is the root."""
        self.P += len(result.path)
        self.root = torch.tensor(result.tokens[-1], dtype=torch.long, device=self.device)


class LevelMasks:
    """The drafter-side bookkeeping of one tree being drafted with ``shape``'s executor: which
    drafter-cache slot each expanded node took, and each level's attention mask (the committed
    context plus the node's ancestors among the slots), written into the executor's buffers."""

    def __init__(self, rt: TorchRuntime, shape: TreeShape) -> None:
        self.rt, self.ex = rt, rt.bank.get(shape)
        self.base = rt.drafter.length  # == P: committed drafter positions
        self.used = 0  # drafter slots taken by expanded nodes of this tree
        self._block = None

    def inputs(self, b: int, parent_slots: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [b] and mask [1, 1, b, base + used + b] of a level of ``b`` nodes whose parents
        took ``parent_slots`` (-1: the root); they take the next ``b`` slots."""
        ex, used, base = self.ex, self.used, self.base
        end = used + b
        anc = ex.slot_anc  # anc[i, j]: slot j is slot i or one of its ancestors
        if used:
            anc[used:end, :used] = anc[parent_slots.clamp(min=0), :used] & (parent_slots >= 0).unsqueeze(1)
        own = anc[used:end, used:end]
        own.zero_()
        own.fill_diagonal_(True)
        mask = ex.draft_mask[:, :, :b, : base + end]  # [1, 1, b, base + end], 0 outside the block
        self._block = mask[0, 0, :, base:]
        self._block.masked_fill_(~anc[used:end, :end], self.rt.neg)
        self.used = end
        return torch.full((b,), base + depth - 1, dtype=torch.long, device=self.rt.device), mask

    def clear(self) -> None:
        """The level ran: its mask block back to 0."""
        self._block.zero_()


@adaptivespec.hookimpl
def adaptivespec_register_runtimes(registry):
    registry.register(TorchRuntime, name="torch")
