"""The batch engine: many requests, one packed target forward per step.

Each lane is an :class:`~adaptivespec.decode.Engine` of the config (its runtime's KV cache, its
policy, verifier, candidate sources and sampler), so every strategy works per request exactly as
it does alone, through that engine's own step surface (``begin``, ``verify``, ``take``, ``learn``,
``report``, ``finish``); the models are loaded once and shared. :meth:`BatchEngine.step` takes one
plan from the :class:`~adaptivespec.batch.scheduler.Scheduler` and runs it in four phases (see
:mod:`adaptivespec.batch`): the draft heads' work is :mod:`adaptivespec.batch.head`'s, the packed
forward :mod:`adaptivespec.batch.runner`'s. With a strict verifier every request's tokens are those
it would get decoded alone (float32: token for token, tested).
"""

from __future__ import annotations

import atexit
import functools
import gc
import time
from typing import Callable, Iterable, Sequence

import attrs
import torch

from adaptivespec.batch.budget import RowBudget, load_or_measure, prompt_chunk_rows
from adaptivespec.batch.head import DraftHeads
from adaptivespec.batch.prefix import PrefixCache
from adaptivespec.batch.request import Lane, Request, Status
from adaptivespec.batch.runner import Runner
from adaptivespec.batch.scheduler import Scheduler, StepPlan
from adaptivespec.batch.step import Item, StepOutput, StepStats, read_prompts  # noqa: F401 - StepStats: its old name
from adaptivespec.decode import Engine, GenerationResult
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.fastpath.kvcache import empty
from adaptivespec.plugins import get_plugin_host
from adaptivespec.runtime import TorchRuntime
from adaptivespec.types import VerifyResult

PREFILL_STEP = 8
PREFILL_ROWS_UNMEASURED = 128
DEFAULT_CONTEXT = 2048
"""Context positions per lane reserved when the caller names none (a longer request gets caches of
its own, outside the slab: correct, slower)."""


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
        first = self.lanes[0].engine
        if not isinstance(first.runtime, TorchRuntime):
            raise AdaptiveSpecError(f"runtime.name: batching runs on the torch runtime, got {config.runtime.name!r}")
        self.tokenizer, self.target = first.tokenizer, first.target
        self.drafter = first.runtime.drafter
        self.device = first.runtime.device
        self.speculative = first.proposer.active
        self.heads = DraftHeads(self.drafter, self.device)
        self.runner = Runner(self.target, self.drafter, first.runtime.dtype, self.device)
        bc = config.batch
        self.budget: RowBudget | None = None
        goodput = bc.row_budget == "goodput" and self.speculative
        if costs is None and (goodput or measure):
            costs = load_or_measure(self.target, self.drafter, config.model.target, config.runtime.precision,
                                    first.runtime.dtype, self.device, log=log)
        if goodput:
            self.budget = RowBudget(costs, bc.max_rows)
        self.costs = costs
        chunk_rows = functools.partial(prompt_chunk_rows, costs, bc.max_rows, bc.prefill_stall)
        self.scheduler = Scheduler(self.lanes, prefill_rows=bc.prefill_rows or chunk_rows,
                                   prefill_chunk=config.runtime.prefill_chunk, max_rows=bc.max_rows)
        self.last = StepOutput()
        self._plain = False  # the step in flight drafts nothing (the row budget's choice)
        self._switch_ms = 0.0  # of the step in flight: the heads catching up on rows plain steps left
        self.prefix: PrefixCache | None = None
        self._flush = False  # flush_prefix was asked: the pool is emptied before the next step
        if bc.prefix_cache_mb:
            self.prefix = PrefixCache(self.target.config, bc.prefix_cache_mb, first.runtime.dtype, self.device,
                                      self.drafter.config.hidden_size if self.drafter is not None else None)
        self.scheduler.share_prompts = self.prefix is not None
        self.reserve(context_length or DEFAULT_CONTEXT, pool=False)
        # the models', tokenizer's and caches' objects (~450k for the embedded pair) leave the cyclic
        # collector's view: a full collection over them took 0.2 s, inside whichever step it fell on
        gc.freeze()
        atexit.register(gc.unfreeze)  # and come back for the interpreter's own teardown (nanobind counts leaks)

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

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @staticmethod
    def _context(items: Sequence[Item]) -> float:
        return sum(it.request.lane.engine.runtime.P for it in items) / len(items)

    # -- requests in and out ----------------------------------------------------------------------
    def reserve(self, positions: int, *, pool: bool = True) -> None:
        """Every lane's caches sized for ``positions`` context positions now (a server's start-up;
        :meth:`Runner.reserve <adaptivespec.batch.runner.Runner.reserve>`); with ``pool`` the prefix
        cache's pool made resident too (the engine's own first call leaves its pages to be written as
        sequences are kept)."""
        self.runner.reserve(self.lanes, positions, self.heads, self.prefix.states if self.prefix is not None else None)
        if pool and self.prefix is not None:
            self.prefix.resident()

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (any thread); it joins a free lane at a coming step."""
        return self.scheduler.submit(request)

    def flush_prefix(self) -> None:
        """Forget every kept prefix before the next step (any thread; SGLang's ``/flush_cache``)."""
        self._flush = self.prefix is not None

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

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
        """One step for every running request; returns the requests that finished in it (and
        :attr:`last`, its :class:`~adaptivespec.batch.step.StepOutput`)."""
        if self._flush:
            self.prefix.clear()
            self._flush = False
        ended: list[Request] = []
        plan = self.scheduler.schedule(admit=self._join, leave=lambda r: ended.append(self._finish(r, "cancelled")),
                                       match=self.prefix.take if self.prefix is not None else None)
        if plan.idle:
            return ended
        t0 = time.perf_counter()
        # 1. propose: each decoder's sources and policy; every head tree drafted together
        items = self._propose(plan)
        draft_ms = (time.perf_counter() - t0) * 1e3
        # 2. budget: one ranking of every candidate node; each tree cut to what is worth its rows
        choice = None
        if self.budget is not None and items:
            choice = self.budget.cut(items, plan.rows, len(plan.chunks), self._context(items), draft_ms)
        for it in items:  # a response format: what it forbids is not verified (the lane's engine, as alone)
            if it.proposal is not None:
                it.tree, cut = it.request.lane.engine.grammar_cut(it.tree)
                if cut is not None:
                    it.keep = cut if it.keep is None else it.keep[cut]
        t_budget = time.perf_counter()
        # 3. verify: one packed target forward over the prompt chunks and the trees
        first_logits, logits, fused = self.runner.forward(plan.chunks, items)
        t_verify = time.perf_counter()
        # 4. commit: per request, through its engine; the draft head follows every request in one pass
        ended += self._commit(plan, items, first_logits, logits, fused, draft_ms, (t_verify - t_budget) * 1e3)
        t_end = time.perf_counter()
        draft_rows = sum(it.tree.size - 1 for it in items)
        prompt_rows = sum(c.end - c.start for c in plan.chunks)
        if self.budget is not None and items:
            self.budget.step_done(seconds_ms=(t_end - t0) * 1e3, rows=plan.rows + draft_rows,
                                  context=sum(it.context for it in items) / len(items),
                                  requests=len(items) + len(plan.chunks), decoders=len(items),
                                  tokens=sum(it.emitted for it in items), draft_rows=draft_rows,
                                  prompt_rows=prompt_rows, drafting=sum(it.proposal is not None for it in items),
                                  drafted_tokens=sum(it.emitted for it in items if it.proposal is not None),
                                  switch_ms=self._switch_ms)
        self.last = StepOutput(requests=len(self.running) + len(ended), decoders=len(items), prefill_rows=prompt_rows,
                               rows=plan.rows + draft_rows, draft_rows=draft_rows,
                               budget_rows=choice.rows if choice is not None else None,
                               draft_ms=draft_ms, budget_ms=(t_budget - t0) * 1e3 - draft_ms,
                               verify_ms=(t_verify - t_budget) * 1e3, commit_ms=(t_end - t_verify) * 1e3,
                               records=tuple(it.record for it in items if it.record is not None),
                               verify_rows=sum(it.tree.size for it in items), finished=tuple(ended),
                               undrafted="load" if self._plain else None, seconds=time.perf_counter() - t0)
        return ended

    # -- joins and leaves ---------------------------------------------------------------------------
    def _join(self, r: Request, lane: Lane) -> None:
        """``r`` takes ``lane``: its engine begins the request, its caches start over."""
        e, rt = lane.engine, lane.engine.runtime
        r.lane, r.status, r.started = lane, Status.PREFILL, time.perf_counter()
        lane.step, lane.depth_cap = 0, 0
        lane.pending.clear()
        lane.kept_rows = None
        e.begin(r.prompt, seed=r.seed, response_format=r.response_format, stop_ids=r.stop_ids, sampling=r.sampling,
                logprobs=r.logprobs, on_logprobs=r.on_logprobs)
        if self.budget is not None:
            self.budget.joined(len(self.running))
        with self.heads.bound(lane):
            rt.reserve(len(r.prompt) + r.max_new_tokens)  # fits the reserved caches: nothing allocated
        rt.cache = empty(rt.cache)
        rt.P = 0

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
            self.prefix.store((r.prompt + r.out)[:rt.P], rt.cache, r.lane.states)
        r.status, r.finish_reason, r.finished = Status.DONE, reason, time.perf_counter()
        if r.lane is not None:
            e = r.lane.engine
            r.grammar_ended = e.constraint is not None and e.constraint.terminated
            if reason == "error":
                e.proposer.finish(r.out)
            else:  # the engine's end of a generation: the proposers, the observer plugins (once)
                r.result = e.finish(list(r.out), r.stats(), r.records)
                r.accepted_by_source = r.result.stats.get("accepted_by_source", {})
        self.scheduler.release(r)
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
                                                                 n + len(plan.chunks), self.heads.rows_behind(plan, items)):
            self._plain = True
            return items  # a plain step: the roots alone
        drafting = self.budget.explorers(items, len(self.lanes)) if self.budget is not None and self.budget.exploring else items
        t = time.perf_counter()
        self.heads.catch_up([it.request.lane for it in drafting])
        self._switch_ms = (time.perf_counter() - t) * 1e3
        for it in drafting:
            lane = it.request.lane
            e = lane.engine
            signals = e.proposer.signals(lane.step, it.request.last_accepted)
            it.signals = attrs.evolve(signals, batch_size=n, row_budget=lane.rows if self.budget is not None else 0)
            it.shape = e.policy.next_shape(it.signals)
            it.drafts = e.proposer.drafts()
        trees = self.heads.draft([it for it in drafting if it.drafts], capped=self.budget is not None)
        for it in drafting:
            it.proposal = it.request.lane.engine.proposer.fuse(it.shape, trees.get(id(it)))
            it.tree = it.proposal.tree
        return items

    # -- 4. commit --------------------------------------------------------------------------------
    def _commit(self, plan: StepPlan, items: Sequence[Item], first_logits: torch.Tensor, logits: torch.Tensor, fused,
                draft_ms: float, verify_ms: float) -> list[Request]:
        """Every request's step through its lane's engine (verify, take, learn, report); the prompts
        read to their end give their first tokens; the head follows every request in one pass."""
        ended: list[Request] = []
        follow = read_prompts(plan.chunks, first_logits, fused, self.device)  # the head's rows: (lane, tokens, states, positions)
        for it in items:
            r = it.request
            lane = r.lane
            e, rt = lane.engine, lane.engine.runtime
            s, t = it.rows
            tree = it.tree
            rows = logits[it.logit:it.logit + tree.size]
            if it.proposal is not None:
                result = e.verify(tree, rows, rt.P + 1)
            elif it.token is not None:  # a greedy plain row, picked with the others by the runner
                result, e.last_rows = VerifyResult(path=[0], tokens=[it.token]), rows[:1]
            else:  # a plain row: picked as Engine.ar_step picks (the same token for a seed)
                result = VerifyResult(path=[0], tokens=[int(rt.pick(rows[0], rt.P + 1))])
                e.last_rows = rt.last_rows
            n_before = len(r.out)
            it.context = rt.P
            done = e.take(r.out, result.tokens, r.max_new_tokens, r.on_tokens, e.last_rows)
            it.emitted = len(r.out) - n_before
            r.forwards += 1
            if not done:  # the accepted path kept in the target's cache; the head's rows to follow
                ext = rt.commit_target(tree, result, None, fused[s:t] if fused is not None else None, head_kv=lane.kv)
                if ext is not None:
                    follow.append((lane, *ext))
                rt.advance(result)
            if it.proposal is None and self.speculative:  # a plain step of a speculative config: the sources see the token
                e.proposer.extend(r.out[n_before:])
            self._observe(it, result, r.out[n_before:], draft_ms, verify_ms)
            if done:
                ended.append(self._finish(r, e.finish_reason))
        self.heads.keep(follow)  # (before the prompts are kept: with the head's states of their rows)
        for r in [c.request for c in plan.chunks if c.last]:  # the prompt's last row picked the first token
            if self.prefix is not None:  # the prompt, kept for requests that follow
                self.prefix.store(r.prompt, r.lane.engine.runtime.cache, r.lane.states)
            r.status, r.first_token, r.forwards = Status.DECODE, time.perf_counter(), 1
            e = r.lane.engine
            done = e.take(r.out, [int(e.runtime.root)], r.max_new_tokens, r.on_tokens, e.runtime.last_rows)
            e.proposer.extend(r.out)
            if done:
                ended.append(self._finish(r, e.finish_reason))
        if follow:
            self.heads.extend(follow, plain=self._plain)
        return ended

    def _observe(self, it: Item, result: VerifyResult, emitted: list[int], draft_ms: float, verify_ms: float) -> None:
        """The request's step record, reported through its lane's engine (policy, ``on_step``, the
        observer plugins), as the one-request loop reports its own."""
        r, lane = it.request, it.request.lane
        e = lane.engine
        by_source: dict[str, int] = {}
        if it.proposal is not None:
            by_source = e.learn(it.proposal, it.tree, result, emitted, None if it.keep is None else it.keep[result.path].tolist())
            if self.budget is not None:
                self.budget.learn(it, result)
            r.last_accepted = result.accepted
        it.record = it.step_record(lane.step, result, len(emitted), by_source, draft_ms, verify_ms, self.speculative)
        r.records.append(it.record)
        r.promoted += result.promoted
        lane.step += 1
        e.report(it.record, r.on_step)
