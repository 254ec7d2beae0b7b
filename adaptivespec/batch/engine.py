"""The batch engine: many requests, one packed target forward per step.

Each lane is an :class:`~adaptivespec.decode.Engine` of the config (its runtime's KV cache, its
policy, verifier, candidate sources and sampler), so every strategy works per request exactly as
it does alone; the models are loaded once and shared. :meth:`BatchEngine.step` runs one step in
four phases (see :mod:`adaptivespec.batch`); with a strict verifier every request's tokens are
those it would get decoded alone (float32: token for token, tested).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import gc
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import attrs
import numpy as np
import torch

from adaptivespec.batch.budget import EXPLORE_GROUP, Choice, RowBudget, load_or_measure
from adaptivespec.batch.prefix import PrefixCache
from adaptivespec.batch.request import Lane, Request, Status
from adaptivespec.batch.scheduler import Chunk, Scheduler, StepPlan
from adaptivespec.decode import Engine, GenerationResult
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.fastpath.batched import (DraftPart, KVSlab, Part, bound, kernels_attend, layer_pieces,
                                           packed_draft_step, packed_forward, padded_rows)
from adaptivespec.fastpath.kvcache import buffered_cache, empty
from adaptivespec.fusion import HEAD
from adaptivespec.plugins import get_plugin_host
from adaptivespec.proposal import Proposal
from adaptivespec.runtime import LevelMasks, TorchRuntime
from adaptivespec.tree import subtree
from adaptivespec.tree_sampling import greedy_ids
from adaptivespec.types import DraftTree, StepRecord, TreeShape, VerifyResult

PREFILL_STEP = 8
PREFILL_ROWS_UNMEASURED = 128
DEFAULT_CONTEXT = 2048
"""Context positions per lane reserved when the caller names none (a longer request gets caches of
its own, outside the slab: correct, slower)."""
ROOT_SHAPE = TreeShape(1, 1, 2)
"""The shape recorded on a plain row (the root alone: never looked up in a shape bank)."""


class DepthCap:
    """A tree policy's level rules with drafting stopped below ``cap`` levels: the beam is empty
    from depth ``cap`` on, so the head runs ``cap - 1`` passes (everything else is the policy's)."""

    def __init__(self, rules, cap: int) -> None:
        self.rules, self.cap = rules, cap

    def select_level(self, scores, depth, shape, pool_size):
        pool_sel, beam = self.rules.select_level(scores, depth, shape, pool_size)
        return pool_sel, (beam[:0] if depth >= self.cap else beam)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rules, name)


@attrs.define(eq=False)
class Item:
    """One decoding request's step in flight (the engine's scratch, dropped after the commit)."""

    request: Request
    signals: Any = None
    shape: TreeShape | None = None
    drafts: bool = False
    proposal: Proposal | None = None
    tree: DraftTree | None = None
    """What is verified (the proposal's tree, cut by the row budget; the root alone when plain)."""
    keep: torch.Tensor | None = None
    """Node indices of the proposal's tree that were kept (None: all)."""
    estimates: tuple | None = None
    rows: tuple[int, int] = (0, 0)
    """Its span of the packed forward's rows."""
    logit: int = 0
    """Where its rows start among the logits read."""
    emitted: int = 0
    """Tokens it emitted this step."""
    context: int = 0
    """Its cached positions when the step began."""
    record: StepRecord | None = None
    """Its step's record, once committed."""


@attrs.define(eq=False)
class StepOutput:
    """What one step did: what the server's worker, its /metrics, the row budget and the tests read
    (:attr:`BatchEngine.last`)."""

    requests: int = 0
    decoders: int = 0
    prefill_rows: int = 0
    rows: int = 0
    draft_rows: int = 0
    budget_rows: int | None = None
    """Draft rows the row budget chose (None: no budget)."""
    seconds: float = 0.0
    draft_ms: float = 0.0
    """Proposing: sources, policies, the head's levels."""
    budget_ms: float = 0.0
    verify_ms: float = 0.0
    """The packed target forward."""
    commit_ms: float = 0.0
    """Verifiers, caches, the head's extension."""
    records: tuple[StepRecord, ...] = ()
    """Each decoding request's record of the step (what its ``on_step`` and the observers got)."""
    verify_rows: int = 0
    """Rows verified for the decoding requests: their trees' nodes and plain roots."""
    undrafted: str | None = None
    """``"load"`` when the row budget ran the whole step plain; None otherwise."""
    finished: tuple[Request, ...] = ()
    """Requests that ended in the step (stop, length, cancelled)."""


StepStats = StepOutput  # (its name before it carried the step's records)


class BatchEngine:
    """Up to ``slots`` requests decoded together (continuous batching); more wait in FIFO order."""

    def __init__(self, config, slots: int = 8, *, host=None, context_length: int | None = None, costs=None,
                 measure: bool = False, log: Callable[[str], None] = print) -> None:
        """``costs``: a :class:`~adaptivespec.batch.budget.CostTable` to use; else, where the row budget
        or cost-sized prompt chunks need one (or with ``measure``), the one cached for this machine,
        measured first if there is none (``measure``, or ``batch.row_budget: goodput``)."""
        if slots < 1:
            raise AdaptiveSpecError(f"slots: expected a positive number of requests decoded together, got {slots}")
        host = host or get_plugin_host()
        self.config = config
        self.lanes = [Lane(Engine(config, host, structured=True), i) for i in range(slots)]
        self._explore_next = 0  # the lane whose turn it is to draft in an exploring step (_explorers)
        first = self.lanes[0].engine
        if not isinstance(first.runtime, TorchRuntime):
            raise AdaptiveSpecError(f"runtime.name: batching runs on the torch runtime, got {config.runtime.name!r}")
        self.tokenizer, self.target = first.tokenizer, first.target
        self.drafter = first.runtime.drafter
        self.device = first.runtime.device
        self.pieces = layer_pieces(self.target)
        self._kernels = kernels_attend(getattr(self.pieces, "sgl", None), first.runtime.dtype)
        self.speculative = first.proposer.active
        # the target's hidden states the draft head reads (its three layers), kept by each forward
        self._head_states = [i + 1 for i in self.drafter.aux_layers] if self.drafter is not None else False
        bc = config.batch
        self.budget: RowBudget | None = None
        goodput = bc.row_budget == "goodput" and self.speculative
        if costs is None and (goodput or measure):
            costs = load_or_measure(self.target, self.drafter, config.model.target, config.runtime.precision,
                                    first.runtime.dtype, self.device, log=log)
        if goodput:
            self.budget = RowBudget(costs, bc.max_rows)
        self.costs = costs
        self.scheduler = Scheduler(slots, prefill_rows=bc.prefill_rows or self._chunk_rows,
                                   prefill_chunk=config.runtime.prefill_chunk, max_rows=bc.max_rows)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free: list[Lane] = list(self.lanes)
        self.last = StepOutput()
        self._lock = threading.Lock()
        self.slab: KVSlab | None = None
        self._plain = False  # the step in flight drafts nothing (the row budget's choice)
        self._switch_ms = 0.0  # of the step in flight: the heads catching up on rows plain steps left
        self.prefix: PrefixCache | None = None
        self._flush = False  # flush_prefix was asked: the pool is emptied before the next step
        if bc.prefix_cache_mb:
            self.prefix = PrefixCache(self.target.config, bc.prefix_cache_mb, first.runtime.dtype, self.device,
                                      self.drafter.config.hidden_size if self.drafter is not None else None)
        self.reserve(context_length or DEFAULT_CONTEXT, pool=False)
        # the models', tokenizer's and caches' objects (~450k for the embedded pair) leave the cyclic
        # collector's view: a full collection over them took 0.2 s, inside whichever step it fell on
        gc.freeze()
        atexit.register(gc.unfreeze)  # and come back for the interpreter's own teardown (nanobind counts leaks)

    def _chunk_rows(self, base_rows: int, past: int = 0, prompts: int = 1) -> int:
        """Prompt rows for a step that runs ``base_rows`` rows without them (``batch.prefill_rows: 0``),
        the first prompt's first ``past`` tokens already read, ``prompts`` requests reading their
        prompts: the most, in multiples of 8 (at least 8), that keep the step within
        ``1 + (batch.prefill_stall - 1) * prompts`` times its cost by the cost table (the chunk's rows
        priced at their context); 128 without a table.

        One prompt arriving while the others decode stalls them by at most ``prefill_stall``; every
        further request still reading its prompt may stall the step by as much again (it is a user
        too, producing nothing until its prompt is read: on a 2-vCPU EPYC with 8 users a fixed
        1.8x left half the lanes reading prompts 8 rows a step and cost 30% of the throughput)."""
        costs = self.costs
        if costs is None:
            return PREFILL_ROWS_UNMEASURED
        limit = (1 + (self.config.batch.prefill_stall - 1) * max(prompts, 1)) * float(costs.verify(base_rows))

        # every candidate at once (one step's 64 table look-ups had been 1.3% of a served step at 16
        # users); the chunk's rows attend over `past` keys, the roots over few
        rows = np.arange(2 * PREFILL_STEP, self.config.batch.max_rows + 1, PREFILL_STEP)
        fits = costs.verify(base_rows + rows, past * rows / (base_rows + rows)) <= limit
        more = len(rows) if fits.all() else int(np.argmin(fits))  # candidates that fit before the first that does not
        return PREFILL_STEP * (1 + more)

    # -- what a server reads of the engine (the same names as :class:`~adaptivespec.decode.Engine`'s) --
    @property
    def verifier(self):
        return self.lanes[0].engine.verifier

    @property
    def lossless(self) -> bool:
        return self.lanes[0].engine.lossless

    @property
    def eos(self) -> int | None:
        return self.lanes[0].engine.eos

    def encode(self, text: str, raw: bool = False) -> list[int]:
        return self.lanes[0].engine.encode(text, raw)

    @staticmethod
    def _context_done(items: Sequence[Item]) -> float:
        return sum(it.context for it in items) / len(items)

    @staticmethod
    def _context(items: Sequence[Item]) -> float:
        return sum(it.request.lane.engine.runtime.P for it in items) / len(items)

    def _slot(self, lane: Lane) -> int | None:
        """``lane``'s slot in the slab, or None when its cache left it (a request longer than reserved)."""
        slab = self.slab
        return lane.index if slab is not None and slab.holds(lane.index, lane.engine.runtime.cache) else None

    def _bound(self, lane: Lane):
        """The draft head on ``lane``'s cache for single-request operations (nothing without a head)."""
        return bound(self.drafter, lane.kv) if self.drafter is not None else contextlib.nullcontext()

    # -- requests in and out ----------------------------------------------------------------------
    def reserve(self, positions: int, *, pool: bool = True) -> None:
        """Every lane's caches sized for ``positions`` context positions now (a server's start-up):
        the target's in one :class:`~adaptivespec.fastpath.batched.KVSlab` (slot ``i``: lane ``i``),
        the draft head's per lane; with ``pool`` the prefix cache's pool made resident too (the
        engine's own first call leaves its pages to be written as sequences are kept)."""
        rt0 = self.lanes[0].engine.runtime
        cap = rt0.reserved_positions(positions)
        self.slab = None  # the old slab goes before the new one is taken
        for lane in self.lanes:
            lane.engine.runtime.cache = None
        self.slab = KVSlab(self.target.config, len(self.lanes), cap, rt0.dtype, self.device)
        for lane in self.lanes:
            rt = lane.engine.runtime
            rt.cache = buffered_cache(self.target.config, cap)
            self.slab.bind(lane.index, rt.cache)
            with self._bound(lane):
                lane.engine.reserve(positions)
            # the head's input state of every position of the lane's sequence, for the prefix cache
            heads = self.prefix.states if self.prefix is not None else None
            lane.states = heads.new_zeros(cap, heads.shape[1]) if heads is not None else None
        if pool and self.prefix is not None:
            self.prefix.resident()

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (any thread); it joins a free lane at a coming step."""
        with self._lock:
            self.waiting.append(request)
        return request

    def flush_prefix(self) -> None:
        """Forget every kept prefix before the next step (any thread; SGLang's ``/flush_cache``)."""
        with self._lock:
            self._flush = self.prefix is not None

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def generate_many(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                      seeds: Iterable[int | None] | None = None, **request_kw) -> list[GenerationResult]:
        """Generate for every prompt (token ids), all submitted at once; results in prompt order."""
        limit = max_new_tokens or self.config.generation.max_new_tokens
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        reqs = [self.submit(Request(prompt=list(p), max_new_tokens=limit, seed=s, **request_kw))
                for p, s in zip(prompts, seeds)]
        while any(not r.done for r in reqs):
            self.step()
        return [self.result(r) for r in reqs]

    def result(self, r: Request) -> GenerationResult:
        if r.result is not None:
            return r.result
        text = self.tokenizer.decode(r.out, skip_special_tokens=True)
        return GenerationResult(token_ids=list(r.out), text=text, stats=r.stats(), records=r.records)

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One step for every running request; returns the requests that finished in it."""
        with self._lock:
            if self._flush:
                self.prefix.clear()
                self._flush = False
            plan = self.scheduler.plan(self.running, list(self.waiting))
            for r in plan.joins:
                self.waiting.remove(r)
            for r in plan.leaves:
                if r in self.waiting:
                    self.waiting.remove(r)
        ended = [self._finish(r, "cancelled") for r in plan.leaves]
        for r in plan.joins:
            self._join(r)
        if self.prefix is not None and self._reuse():  # prompts partly kept: their chunks start later
            plan = self.scheduler.plan(self.running, ())  # (one cancelled meanwhile leaves at the next step)
        if plan.idle:
            return ended
        t0 = time.perf_counter()
        # 1. propose: each decoder's sources and policy; every head tree drafted together
        items = self._propose(plan)
        draft_ms = (time.perf_counter() - t0) * 1e3
        # 2. budget: one ranking of every candidate node; each tree cut to what is worth its rows
        choice = self._budget(plan, items, draft_ms)
        t_budget = time.perf_counter()
        # 3. verify: one packed target forward over the prompt chunks and the trees
        first_logits, logits, fused = self._forward(plan.chunks, items)
        t_verify = time.perf_counter()
        # 4. commit: per request; the draft head follows every request in one pass
        ended += self._commit(plan, items, first_logits, logits, fused, draft_ms, (t_verify - t_budget) * 1e3)
        t_end = time.perf_counter()
        if self.budget is not None and items:
            self.budget.step_done(seconds_ms=(t_end - t0) * 1e3, rows=plan.rows + sum(it.tree.size - 1 for it in items),
                                  context=self._context_done(items), requests=len(items) + len(plan.chunks),
                                  decoders=len(items), tokens=sum(it.emitted for it in items),
                                  draft_rows=sum(it.tree.size - 1 for it in items),
                                  prompt_rows=sum(c.end - c.start for c in plan.chunks),
                                  drafting=sum(it.proposal is not None for it in items),
                                  drafted_tokens=sum(it.emitted for it in items if it.proposal is not None),
                                  switch_ms=self._switch_ms)
        self.last = StepOutput(requests=len(self.running) + len(ended), decoders=len(items),
                               records=tuple(it.record for it in items if it.record is not None),
                               verify_rows=sum(it.tree.size for it in items), finished=tuple(ended),
                               undrafted="load" if self._plain else None,
                               draft_ms=draft_ms, budget_ms=(t_budget - t0) * 1e3 - draft_ms,
                               verify_ms=(t_verify - t_budget) * 1e3, commit_ms=(t_end - t_verify) * 1e3,
                               prefill_rows=sum(c.end - c.start for c in plan.chunks),
                               rows=plan.rows + sum(it.tree.size - 1 for it in items),
                               draft_rows=sum(it.tree.size - 1 for it in items),
                               budget_rows=choice.rows if choice is not None else None,
                               seconds=time.perf_counter() - t0)
        return ended

    # -- joins and leaves ---------------------------------------------------------------------------
    def _join(self, r: Request) -> None:
        """``r`` takes a free lane: its strategies and caches start over (as ``generate_ids`` does)."""
        lane = min(self.free, key=lambda lane: lane.index)  # the lowest slot: the slab's attended range stays short
        self.free.remove(lane)
        e, rt = lane.engine, lane.engine.runtime
        r.lane, r.status, r.started = lane, Status.PREFILL, time.perf_counter()
        lane.step, lane.depth_cap = 0, 0
        lane.pending.clear()
        lane.kept_rows = None
        e.begin(r.prompt, seed=r.seed, response_format=r.response_format, stop_ids=r.stop_ids, sampling=r.sampling,
                logprobs=r.logprobs, on_logprobs=r.on_logprobs)
        if self.budget is not None:
            self.budget.joined(len(self.running) + 1)
        with self._bound(lane):
            rt.reserve(len(r.prompt) + r.max_new_tokens)  # fits the reserved caches: nothing allocated
        rt.cache = empty(rt.cache)
        rt.P = 0
        self.running.append(r)

    def _reuse(self) -> bool:
        """Requests holding a lane that have not read any of their prompts yet take what the prefix
        cache keeps of them: its keys and values into the lane's cache, the head's rows for it
        (``lane.kept_rows``) to go with its first chunk's (so the head follows them, or leaves them
        pending, as it would have followed the prompt read whole). Asked again at every step until
        their first chunk runs (a prompt another request reads meanwhile is kept once read). Returns
        whether any took something."""
        hit = False
        for r in self.running:
            if r.status is not Status.PREFILL or r.prefilled:
                continue
            lane = r.lane
            n, states = self.prefix.load(r.prompt, lane.engine.runtime.cache)
            r.prefilled = r.cached = n
            if n and states is not None:
                lane.kept_rows = (torch.tensor(r.prompt[1:n + 1], dtype=torch.long, device=self.device), states,
                                  torch.arange(n, device=self.device))
            hit |= n > 0
        return hit

    def abort(self, reason: str) -> list[Request]:
        """End the running requests (those holding a lane) with ``finish_reason`` ``"error"``: a step
        failed; their lanes start clean at the next join, waiting requests stay queued. Returns them."""
        ended = [self._finish(r, "error") for r in list(self.running)]
        for r in ended:
            r.error = reason
        return ended

    def _finish(self, r: Request, reason: str) -> Request:
        if self.prefix is not None and r.lane is not None and reason != "error":
            # its sequence in the cache: the positions whose keys (and head states) are committed
            rt = r.lane.engine.runtime
            n = rt.P if r.status is Status.DECODE else r.prefilled
            self.prefix.store((r.prompt + r.out)[:n], rt.cache, r.lane.states)
        r.status, r.finish_reason, r.finished = Status.DONE, reason, time.perf_counter()
        if r in self.running:
            self.running.remove(r)
        if r.lane is not None:
            e = r.lane.engine
            r.grammar_ended = e.constraint is not None and e.constraint.terminated
            if reason == "error":
                e.proposer.finish(r.out)
            else:  # the engine's end of a generation: the proposers, the observer plugins (once)
                r.result = e.finish(list(r.out), r.stats(), r.records)
                r.accepted_by_source = r.result.stats.get("accepted_by_source", {})
            self.free.append(r.lane)
            r.lane = None
        return r

    # -- 1. propose -------------------------------------------------------------------------------
    def _propose(self, plan: StepPlan) -> list[Item]:
        items = [Item(request=r) for r in plan.decoders]
        self._plain = False
        self._switch_ms = 0.0
        if not self.speculative or not items:
            return items
        n = len(items)
        if self.budget is not None and not self.budget.speculate(n, plan.rows, self._context(items),
                                                                 n + len(plan.chunks), self._head_rows(plan, items)):
            self._plain = True
            return items  # a plain step: the roots alone
        drafting = self._explorers(items) if self.budget is not None and self.budget.exploring else items
        t = time.perf_counter()
        self._catch_up([it.request.lane for it in drafting])
        self._switch_ms = (time.perf_counter() - t) * 1e3
        stale = [it.request.lane.engine.runtime for it in drafting if it.request.lane.engine.runtime.root_logp is None]
        if stale:  # heads that followed plain steps: their draft distributions, in one pass
            logp = self.drafter.log_probs(torch.stack([rt.root_state for rt in stale]))
            for rt, lp in zip(stale, logp):
                rt.root_logp = lp
        for it in drafting:
            lane = it.request.lane
            e = lane.engine
            signals = e.proposer.signals(lane.step, it.request.last_accepted)
            it.signals = attrs.evolve(signals, batch_size=n, row_budget=lane.rows if self.budget is not None else 0)
            it.shape = e.policy.next_shape(it.signals)
            it.drafts = e.proposer.drafts()
        trees = self._draft([it for it in drafting if it.drafts])
        for it in drafting:
            it.proposal = it.request.lane.engine.proposer.fuse(it.shape, trees.get(id(it)))
            it.tree = it.proposal.tree
        return items

    def _head_rows(self, plan: StepPlan, items: Sequence[Item]) -> int:
        """Rows the draft head would run if this step drafted for every decoder: those plain steps
        left it behind on, and the step's prompt chunks (with their prefixes from the cache) where it
        is up to date (see :meth:`_commit`); in a plain step they wait."""
        if self.drafter is None:
            return 0
        n = 0
        for it in items:  # a lane's pending rows are consecutive positions: first to last, not entry by entry
            pending = it.request.lane.pending
            if pending:
                n += int(pending[-1][2][-1]) - int(pending[0][2][0]) + 1
        for c in plan.chunks:
            lane = c.request.lane
            if not lane.pending:
                n += c.end - c.start + (lane.kept_rows[0].shape[0] if lane.kept_rows is not None else 0)
        return n

    def _explorers(self, items: list[Item]) -> list[Item]:
        """The requests an exploring step drafts for: one per :data:`EXPLORE_GROUP` decoders, taking
        turns by lane (so what the head accepts is sampled over all the texts in flight). Exploring
        measures what the head accepts now; drafting for everyone made it dear under load (16 users
        on a 2-vCPU EPYC: ~180 ms, 70-90 of them the heads catching up, against a 23 ms plain step)."""
        k = -(-len(items) // EXPLORE_GROUP)
        if k >= len(items):
            return items
        turn = sorted(items, key=lambda it: (it.request.lane.index - self._explore_next) % len(self.lanes))[:k]
        self._explore_next = turn[-1].request.lane.index + 1
        return turn

    def _draft(self, items: Sequence[Item]) -> dict[int, DraftTree]:
        """Every item's head tree, all drafted together: one draft-head pass (and one LM-head pass)
        per depth level over the levels of all trees still growing."""
        d = self.drafter
        trees: dict[int, DraftTree] = {}
        growing = []  # (item, levels generator, masks, the level's expand arguments)
        for it in items:
            lane = it.request.lane
            rt = lane.engine.runtime
            rules = it.request.lane.engine.policy
            if self.budget is not None and lane.depth_cap:
                rules = DepthCap(rules, lane.depth_cap)
            with bound(d, lane.kv):
                masks = LevelMasks(rt, it.shape)
            levels = rt.draft_levels(it.shape, rules)
            try:
                growing.append((it, levels, masks, next(levels)))
            except StopIteration as done:
                trees[id(it)] = done.value
        while growing:
            tokens, states, positions, parts = [], [], [], []
            for it, _, masks, (tok, hid, parent_slots, depth) in growing:
                pos, mask = masks.inputs(tok.shape[0], parent_slots, depth)
                tokens.append(tok), states.append(hid), positions.append(pos)
                parts.append(DraftPart(kv=it.request.lane.kv, rows=tok.shape[0], mask=mask))
            out = packed_draft_step(d, torch.cat(tokens), torch.cat(states), torch.cat(positions), parts)
            logp = d.log_probs(out)  # [R, Vd]
            nxt, start = [], 0
            for (it, levels, masks, level), part in zip(growing, parts):
                masks.clear()
                end = start + part.rows
                try:
                    nxt.append((it, levels, masks, levels.send((logp[start:end], out[start:end]))))
                except StopIteration as done:
                    trees[id(it)] = done.value
                start = end
            growing = nxt
        return trees

    # -- 2. budget --------------------------------------------------------------------------------
    def _budget(self, plan: StepPlan, items: list[Item], draft_ms: float) -> Choice | None:
        budget = self.budget
        drafted = [it for it in items if it.proposal is not None]  # all, none (a plain step) or the explorers
        if budget is None or not drafted:
            return None
        scores, depths = [], []
        for it in drafted:
            fused = it.proposal.fused
            source_only = None
            if fused is not None:
                source_only = torch.tensor([o != 0 and not (o & HEAD) for o in fused.origin], dtype=torch.bool)
            it.estimates = budget.estimates(it.tree, source_only)
            scores.append(it.estimates[2])
            depths.append(it.tree.depth)
        context = self._context(items)
        choice = budget.choose(scores, depths, base_rows=plan.rows, decoders=len(items),
                               requests=len(items) + len(plan.chunks), context=context, draft_ms=draft_ms)
        for it, keep in zip(drafted, choice.keep):
            lane = it.request.lane
            lane.rows = keep.shape[0] - 1
            lane.depth_cap = int(it.tree.depth[keep].max()) + 1
            if keep.shape[0] < it.tree.size:
                it.keep, it.tree = keep, subtree(it.tree, keep)
        return choice

    # -- 3. verify --------------------------------------------------------------------------------
    def _forward(self, chunks: Sequence[Chunk], items: Sequence[Item]):
        """One packed target forward. Returns (logits of the last prompt rows, logits of the items'
        rows, the drafter's input states of all rows or None); each item's ``rows`` are its span of
        the forward's rows, ``logit`` where its logits start."""
        ids, positions, parts, logit_rows = [], [], [], []
        row = 0
        for c in chunks:
            rt = c.request.lane.engine.runtime
            n = c.end - c.start
            ids.append(torch.tensor(c.request.prompt[c.start:c.end], dtype=torch.long, device=self.device))
            positions.append(torch.arange(c.start, c.end, device=self.device))
            # in the slab where each member attends over its own keys (the kernels); alone otherwise, where
            # its long past would widen everyone's keys (by itself, an 8-row chunk's attention had cost as
            # much as the step's other rows: 7 decoders' steps went 15 -> 35 ms, not 1.8x)
            parts.append(Part(cache=rt.cache, rows=n, slot=self._slot(c.request.lane) if self._kernels else None))
            if c.last:
                logit_rows.append(torch.tensor([row + n - 1], device=self.device))
            row += n
        n_chunk_logits, li = len(logit_rows), 0
        for it in items:
            rt = it.request.lane.engine.runtime
            if it.tree is None:  # plain decoding: the root alone
                it.tree = _root_tree(rt.root)
            n = it.tree.size
            if n > 1:
                pos, mask = rt.verify_inputs(it.tree)
            else:
                pos, mask = rt.P + it.tree.depth, None
            ids.append(it.tree.tokens), positions.append(pos)
            parts.append(Part(cache=rt.cache, rows=n, mask=mask, slot=self._slot(it.request.lane)))
            logit_rows.append(torch.arange(row, row + n, device=self.device))
            it.rows, it.logit = (row, row + n), li
            row, li = row + n, li + n
        R = padded_rows(row)
        ids = torch.cat(ids)
        pos = torch.cat(positions)
        if R > row:
            ids = torch.cat([ids, ids.new_zeros(R - row)])
            pos = torch.cat([pos, pos.new_zeros(R - row)])
        read = torch.cat(logit_rows) if logit_rows else torch.zeros(0, dtype=torch.long, device=self.device)
        m = read.shape[0]
        if m:
            read = torch.cat([read, read[-1:].expand(padded_rows(m) - m)])  # bounded row counts for the LM head too
        logits, hidden = packed_forward(self.pieces, ids, pos, parts, read, hidden=self._head_states,
                                        slab=self.slab)
        for it in items:
            if it.tree.size > 1:
                it.request.lane.engine.runtime.verify_done(it.tree)
        fused = self.drafter.fuse(hidden)[0] if self.drafter is not None else None  # [R, H]
        return logits[:n_chunk_logits], logits[n_chunk_logits:m], fused

    # -- 4. commit --------------------------------------------------------------------------------
    def _commit(self, plan: StepPlan, items: Sequence[Item], first_logits: torch.Tensor, logits: torch.Tensor, fused,
                draft_ms: float, verify_ms: float) -> list[Request]:
        ended: list[Request] = []
        follow: list[tuple[Lane, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # the head's extension rows
        row, k = 0, 0
        for c in plan.chunks:  # prompt chunks: the head follows; the last one gives the first token
            r = c.request
            lane, rt = r.lane, r.lane.engine.runtime
            n = c.end - c.start
            r.prefilled = c.end
            nxt = r.prompt[c.start + 1 : c.end + 1]
            if c.last:
                rt.root = rt.pick(first_logits[k], c.end)
                k += 1
                rt.P = c.end
                nxt = nxt + [int(rt.root)]
            if fused is not None:
                rows = (torch.tensor(nxt, dtype=torch.long, device=self.device), fused[row:row + n],
                        torch.arange(c.start, c.end, device=self.device))
                if lane.kept_rows is not None:  # the prefix taken from the cache goes first
                    rows, lane.kept_rows = tuple(torch.cat(p) for p in zip(lane.kept_rows, rows)), None
                follow.append((lane, *rows))
            row += n
        first_tokens = [c.request for c in plan.chunks if c.last]
        greedy = self._greedy_rows(items, logits)
        for it in items:
            r = it.request
            lane = r.lane
            e, rt = lane.engine, lane.engine.runtime
            s, t = it.rows
            tree = it.tree
            rows = logits[it.logit:it.logit + tree.size]
            if it.proposal is None:  # a plain row: picked as Engine.ar_step picks (the same token for a seed)
                tok = greedy.get(id(it))
                if tok is None:
                    tok = int(rt.pick(rows[0], rt.P + 1))
                    e.last_rows = rt.last_rows
                else:  # greedy, no processor: the row as the target gave it
                    e.last_rows = rows[:1]
                result = VerifyResult(path=[0], tokens=[tok])
            else:
                result = e.verify(tree, rows, rt.P + 1)
            n_before = len(r.out)
            it.context = rt.P
            done = e.take(r.out, result.tokens, r.max_new_tokens, r.on_tokens, e.last_rows)
            it.emitted = len(r.out) - n_before
            r.forwards += 1
            if not done:
                if it.proposal is None:  # a plain row: already in place at P, nothing to compact
                    ext = self._plain_extension(lane, result, fused, s)
                else:
                    with self._bound(lane):
                        ext = rt.commit_target(tree, result, None, fused[s:t] if fused is not None else None)
                if ext is not None:
                    follow.append((lane, *ext))
                rt.advance(result)
            if it.proposal is None and self.speculative:  # a plain step of a speculative config: the sources see the token
                e.proposer.extend(r.out[n_before:])
            self._observe(it, result, r.out[n_before:], draft_ms, verify_ms)
            if done:
                ended.append(self._finish(r, e.finish_reason))
        for lane, _, states, positions in follow:  # the head's input states, for the prefix cache
            if lane.states is not None:
                _keep(lane, states, positions)
        for r in first_tokens:  # the prompt's last row picked the first token
            if self.prefix is not None:  # the prompt, kept for requests that follow
                self.prefix.store(r.prompt, r.lane.engine.runtime.cache, r.lane.states)
            r.status = Status.DECODE
            r.first_token = time.perf_counter()
            r.forwards = 1
            e = r.lane.engine
            done = e.take(r.out, [int(r.lane.engine.runtime.root)], r.max_new_tokens, r.on_tokens,
                          r.lane.engine.runtime.last_rows)
            e.proposer.extend(r.out)
            if done:
                ended.append(self._finish(r, e.finish_reason))
        if follow:
            # the head follows now where it is up to date; it catches up when it next drafts where a
            # plain step left rows behind (a prompt read in chunks over plain and drafting steps: its
            # later chunks wait behind the earlier ones, in order)
            now = []
            for lane, *rows in follow:
                if self._plain or lane.pending:
                    lane.pending.append(rows)
                else:
                    now.append((lane, *rows))
            if now:
                self._follow(now)
        return ended

    @staticmethod
    def _greedy_rows(items: Sequence[Item], logits: torch.Tensor) -> dict[int, int]:
        """The tokens of the plain rows picked greedily (no sampler, no grammar), all in one argmax:
        ``id(item)`` -> token (on a 2-vCPU EPYC, bf16, a 49k-vocabulary argmax of 8 rows: 380 us row
        by row, 180 in one call)."""
        plain = [it for it in items if it.proposal is None and it.request.lane.engine.runtime.sampler is None
                 and it.request.lane.engine.runtime.logits_processor is None]
        if not plain:
            return {}
        rows = [it.logit for it in plain]
        one = rows[-1] - rows[0] == len(rows) - 1  # consecutive (a plain step): a view, no gather (+110 us)
        picked = greedy_ids(logits[rows[0]:rows[-1] + 1] if one else logits[torch.tensor(rows)]).tolist()
        return {id(it): tok for it, tok in zip(plain, picked)}

    def _plain_extension(self, lane: Lane, result: VerifyResult, fused, row: int):
        """What :meth:`~adaptivespec.runtime.TorchRuntime.commit_target` returns for a plain row (the
        head's one row: the picked token, the row's state, position P), without its general path
        (a compaction check, index copies and the head bound and unbound: 80 us a request, a
        plain step of 8 on a 2-vCPU EPYC spent 0.6 ms more than ``ar.yaml``'s there)."""
        if fused is None:
            return None
        P = lane.engine.runtime.P
        lane.kv.length = P  # as commit_target leaves it: the head's rows from P on are this step's
        return (torch.tensor(result.tokens, dtype=torch.long, device=self.device), fused[row:row + 1],
                torch.tensor([P], device=self.device))

    def _catch_up(self, lanes: Sequence[Lane]) -> None:
        """The head runs the rows it skipped in plain steps, every lane's in one pass."""
        behind = [lane for lane in lanes if lane.pending]
        for lane in behind:  # commit_target moved the head's length past the rows it has not run yet
            lane.kv.length = int(lane.pending[0][2][0])
        if behind:
            self._follow([(lane, *(torch.cat(part) for part in zip(*lane.pending))) for lane in behind])
            for lane in behind:
                lane.pending.clear()

    def _follow(self, follow) -> None:
        """The draft head runs every request's new rows (prompt chunks, accepted tokens + bonus) in
        one pass; each request's root state and draft distribution come from its last row."""
        parts = [DraftPart(kv=lane.kv, rows=tokens.shape[0]) for lane, tokens, _, _ in follow]
        out = packed_draft_step(self.drafter, torch.cat([f[1] for f in follow]), torch.cat([f[2] for f in follow]),
                                torch.cat([f[3] for f in follow]), parts)
        ends = torch.tensor([p.rows for p in parts]).cumsum(0) - 1
        last = out[ends]
        for (lane, *_), state in zip(follow, last):  # the draft distribution when it is next needed (_propose)
            rt = lane.engine.runtime
            rt.root_state, rt.root_logp = state, None

    def _observe(self, it: Item, result: VerifyResult, emitted: list[int], draft_ms: float, verify_ms: float) -> None:
        """The request's step record, reported through its lane's engine (policy, ``on_step``, the
        observer plugins), as the one-request loop reports its own."""
        r, lane = it.request, it.request.lane
        e = lane.engine
        if it.proposal is not None:
            path = None if it.keep is None else it.keep[result.path].tolist()
            by_source = e.learn(it.proposal, it.tree, result, emitted, path)
            if self.budget is not None and it.estimates is not None:
                keep = it.keep if it.keep is not None else torch.arange(it.tree.size)
                self.budget.observe(it.estimates[0], it.estimates[1], keep, result.path)
            record = StepRecord(step=lane.step, shape=it.shape, tree_size=it.tree.size, accepted=result.accepted,
                                promoted=result.promoted, new_tokens=len(emitted), draft_ms=draft_ms,
                                verify_ms=verify_ms, other_ms=0.0, signals=it.signals, policy_state=e.policy.state(),
                                accepted_by_source=by_source)
        else:  # a plain row: the config's (autoregressive) or the row budget's choice (load)
            record = StepRecord(step=lane.step, shape=None, tree_size=1, accepted=0, promoted=0,
                                new_tokens=len(emitted), draft_ms=0.0, verify_ms=verify_ms, other_ms=0.0,
                                undrafted="load" if self.speculative else "autoregressive")
        r.records.append(record)
        it.record = record
        r.promoted += result.promoted
        r.last_accepted = result.accepted if it.proposal is not None else r.last_accepted
        lane.step += 1
        e.report(record, r.on_step)


def _keep(lane: Lane, states: torch.Tensor, positions: torch.Tensor) -> None:
    """The head's input ``states`` [n, H] of ``positions`` [n] into ``lane.states`` (grown by doubling
    for a request longer than reserved)."""
    end = int(positions[-1]) + 1
    if end > lane.states.shape[0]:
        lane.states = torch.cat([lane.states, lane.states.new_zeros(max(end, lane.states.shape[0]), states.shape[1])])
    lane.states.index_copy_(0, positions, states)


def _root_tree(root: torch.Tensor) -> DraftTree:
    """The root alone: a plain decoding row."""
    dev = root.device
    return DraftTree(tokens=root.reshape(1).to(torch.long), parents=torch.tensor([-1], device=dev),
                     depth=torch.zeros(1, dtype=torch.long, device=dev), ancestors=torch.ones(1, 1, dtype=torch.bool, device=dev),
                     draft_logp=torch.zeros(1, device=dev), shape=ROOT_SHAPE)


