"""The decode loop: prefill, then speculative steps (propose -> verify -> commit -> observe).

:class:`Engine` resolves the strategies once from the config and calls their methods directly;
the per-step observer hook is called only when a plugin implements it. What the target verifies
at each step (the candidate sources, the head's draft, their fusion and who proposed what) is
the proposal stage's business (:mod:`adaptivespec.proposal`); one step reads top to bottom in
:meth:`Engine._step`.

With a response format (structured output) the generation's grammar state
(:class:`~adaptivespec.constraints.Constraint`) masks every logits row the target's next token is
picked or verified from: the runtime's prefill and plain steps through its ``logits_processor``,
the verify tree's rows in :meth:`Engine._step` before the verifier's rule; the emitted tokens
advance it in :meth:`Engine._take`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import attrs
import torch

from adaptivespec.config import Config, check_sampling
from adaptivespec.constraints import GrammarBackend  # xgrammar itself: only when a grammar is compiled
from adaptivespec import hardware
from adaptivespec.costmodel import CostSource, RunningSetup, warn_if_fitted_elsewhere
from adaptivespec.models import DTYPES, encode_prompt, load_target
from adaptivespec.plugins import get_plugin_host
from adaptivespec.proposal import Proposer, structured_sources
from adaptivespec.sampling import Sampler
from adaptivespec.tree import subtree
from adaptivespec.types import StepRecord, VerifyResult

_MODELS: dict[tuple, Any] = {}


def eos_ids(tokenizer, target) -> frozenset[int]:
    """Every id that ends a generation: the tokenizer's EOS and each one the target's generation config
    lists (``generation_config.json``'s ``eos_token_id``, an id or a list: Llama-3's ``<|eot_id|>`` and
    ``<|eom_id|>``, as transformers' ``generate`` stops on them)."""
    ids = {tokenizer.eos_token_id}
    listed = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update(listed if isinstance(listed, (list, tuple, set)) else [listed])
    return frozenset(int(i) for i in ids if i is not None)


def load_models(config: Config, host) -> tuple[Any, Any, Any]:
    """(target, tokenizer, drafter or None), cached per process so several configs share one load.
    A runtime class with its own ``load_models(config, host)`` loads them (the llamacpp runtime: a GGUF file)."""
    own = getattr(host.runtimes.get(config.runtime.name).cls, "load_models", None)
    if own is not None:
        return own(config, host)
    rt = config.runtime
    key = (config.model.target, rt.dtype, rt.device, rt.quantization, rt.quantization_keep, rt.quantization_groups)
    if key not in _MODELS:
        _MODELS[key] = load_target(*key[:3], decoding=True, quantization=rt.quantization, keep=rt.quantization_keep,
                                   groups=rt.groups)
    target, tok = _MODELS[key]
    drafter = None
    if config.model.drafter is not None:
        dkey = key + (config.model.drafter_kind, config.model.drafter)
        if dkey not in _MODELS:
            cls = host.drafters.get(config.model.drafter_kind).cls
            _MODELS[dkey] = cls.from_pretrained(config.model.drafter, target, DTYPES[config.runtime.dtype], config.runtime.device)
        drafter = _MODELS[dkey]
    return target, tok, drafter


@attrs.define(kw_only=True)
class GenerationResult:
    """One finished generation."""

    token_ids: list[int]
    """Generated ids only (the final EOS or stop id included when generation stopped there)."""
    text: str
    stats: dict[str, Any]
    """new_tokens, target_forwards, accept_length_mean, wall_seconds, tokens_per_second, promoted_tokens,
    prefill_seconds (the wall time to the first token, included in wall_seconds);
    accepted_by_source (speculative configs: accepted tokens per proposer, see StepRecord)."""
    records: list[StepRecord] = attrs.field(factory=list)
    prompt_id: Any = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """With ``logprobs`` asked: per generated token ``(id, log-probability, [(id, log-probability)]
    of the target's top ones)``, the target's own (its log-softmax, before temperature, top-k/p
    and grammar masks), read from the forward that verified the token. None when not asked."""


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """``(token, log p(token), top-``top`` [(id, log p)])`` per row of target logits ``rows`` [m, V]
    and the token emitted from it, in one transfer to the host."""
    lsm = rows[: len(tokens)].float().log_softmax(-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=lsm.device)
    chosen = lsm.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    if not top:
        return [(t, lp, []) for t, lp in zip(tokens, chosen)]
    best = lsm.topk(top, -1)
    return [(t, lp, list(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, best.indices.tolist(), best.values.tolist())]


class Engine:
    """A target, a drafter, a tree policy, candidate sources (the proposal stage) and a verifier,
    ready to generate."""

    def __init__(self, config: Config, host=None, *, structured: bool = False) -> None:
        """``structured``: prompts may carry their own response format (``generate_ids(...,
        response_format=...)``) even where the config sets none, so the sources that draft from
        the grammar are set up as if it did."""
        if host is None:
            host = get_plugin_host()
        self.config, self.host = config, host
        if config.runtime.threads:
            torch.set_num_threads(config.runtime.threads)
        self.target, self.tokenizer, drafter = load_models(config, host)
        self.runtime = host.runtimes.get(config.runtime.name).cls(self.target, drafter, config)
        policy = host.policies.get(config.policy.name).cls(config.policy.params)
        bind = getattr(policy, "bind_costs", None)  # this machine's measured step costs, for a policy that prices steps
        if bind is not None and not config.autoregressive:
            running = RunningSetup(config.runtime.name, config.runtime.dtype, hardware.isa())  # what the file's timings must match
            bind(CostSource(getattr(self.runtime, "cost_table", lambda: None), running), config.runtime.device)
        fitted = getattr(policy, "fitted_on", None)  # files fitted on another target or CPU: said once
        if fitted is not None and not config.autoregressive:
            warn_if_fitted_elsewhere(config.policy.name, fitted(), target=config.model.target,
                                     drafter=config.model.drafter, device=config.runtime.device)
        self.verifier = host.verifiers.get(config.verifier.name).cls(config.verifier.params)
        check_sampling(config, host)  # temperature > 0 needs a verifier with a sampling form
        self.sampler = Sampler.from_config(config.generation, self.runtime.device)  # None: greedy
        if self.sampler is not None:
            self.runtime.sampler = self.verifier.sampler = self.sampler
        sources = [host.sources.get(s.name).cls(s.params) for s in config.sources]
        self.structured = structured or config.generation.response_format is not None
        if self.structured and config.generation.grammar_draft and not config.autoregressive:
            sources += structured_sources(host, listed=[s.name for s in sources])
        self.proposer = Proposer(self.runtime, policy, sources)
        if self.proposer.active:  # one executor per shape the policy may choose, built up front
            self.runtime.prepare(policy.shapes(), capacity=2 * config.generation.max_new_tokens + 512,
                                 extra_rows=self.proposer.extra_slots())
        stop = config.generation.stop_at_eos
        self.eos_ids: frozenset[int] = eos_ids(self.tokenizer, self.target) if stop else frozenset()
        """Every id that ends a generation (:func:`eos_ids`; empty when ``generation.stop_at_eos`` is off)."""
        primary = self.tokenizer.eos_token_id
        self.eos = (primary if primary is not None else min(self.eos_ids, default=None)) if stop else None
        """The primary EOS id (the tokenizer's) or None; :attr:`eos_ids` holds them all."""
        self._stops: frozenset[int] = self.eos_ids  # this generation's: eos_ids and the request's stop_ids
        self._observe = host.has_observers("adaptivespec_step")
        self.config_sampler = self.sampler
        """The config's sampler (None: greedy); a generation with its own settings gets its own."""
        self.constraint = None
        """The running generation's grammar state (None: free text)."""
        self.logprobs: int | None = None
        """Top log-probabilities kept per token by the running generation (None: none kept)."""
        self.token_logprobs: list = []
        self.last_rows: torch.Tensor | None = None
        self._on_logprobs = None
        self.finish_reason: str | None = None
        """Why the running generation ended (``"stop"``: a stop id or the grammar's end;
        ``"length"``), set by :meth:`take`; None while it runs."""

    @property
    def policy(self):
        """The tree policy (shared with the proposal stage; assigning one replaces it in both)."""
        return self.proposer.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.proposer.policy = policy

    @property
    def sources(self) -> list:
        """The candidate sources, in config order."""
        return self.proposer.sources

    @property
    def lossless(self) -> bool:
        return self.config.autoregressive or self.verifier.lossless

    def reserve(self, positions: int) -> None:
        """Size every buffer a generation writes for ``positions`` context positions (prompt plus
        generated tokens) now, rather than at the first prefill that needs them; later generations
        that fit reuse them. A server calls it at start-up with its context length. A runtime
        without ``reserve`` sizes its buffers per generation."""
        reserve = getattr(self.runtime, "reserve", None)
        if reserve is not None:
            reserve(positions)

    def forget(self) -> None:
        """Drop what the candidate sources remembered across generations (their output caches)."""
        self.proposer.forget()

    def encode(self, text: str, raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat=self.config.generation.chat_template and not raw)

    def generate(self, text: str, *, raw: bool = False, max_new_tokens: int | None = None, on_tokens=None,
                 seed: int | None = None, response_format=None, stop_ids: Iterable[int] | None = None) -> GenerationResult:
        return self.generate_ids(self.encode(text, raw), max_new_tokens=max_new_tokens, on_tokens=on_tokens, seed=seed,
                                 response_format=response_format, stop_ids=stop_ids)

    def make_constraint(self, response_format=None):
        """A fresh grammar state for ``response_format`` (default: the config's), or None (free text)."""
        fmt = response_format if response_format is not None else self.config.generation.response_format
        if fmt is None:
            return None
        return GrammarBackend.for_tokenizer(self.tokenizer, self.target.config.vocab_size).constraint(fmt)

    # -- a generation, step by step: the surface the one-request loop and the batch engine share ----
    def begin(self, prompt_ids: list[int], *, seed: int | None = None, response_format=None,
              stop_ids: Iterable[int] | None = None, sampling=None, logprobs: int | None = None,
              on_logprobs: Callable[[list], None] | None = None) -> None:
        """Start a generation of ``prompt_ids`` on this engine: the stop ids (:attr:`eos_ids` and
        ``stop_ids``), the sampler (the config's, or ``sampling``'s own settings: an object with
        ``temperature``, ``top_k``, ``top_p``, ``min_p``; temperature 0 is greedy) seeded with
        ``seed`` (default ``generation.seed``), the policy, the grammar state of ``response_format``
        (default the config's) and the proposers; ``logprobs`` (None: off) the number of top
        log-probabilities kept per token beside the emitted one's, each step's handed to
        ``on_logprobs`` before its tokens go to ``on_tokens``. :meth:`generate_ids` and each lane of
        a batch call it."""
        self._stops = self.eos_ids.union(int(i) for i in stop_ids) if stop_ids else self.eos_ids
        sampler = self.config_sampler
        if sampling is not None:
            sampler = None if sampling.temperature == 0 else Sampler(sampling.temperature, sampling.top_k, sampling.top_p,
                                                                      sampling.min_p, self.runtime.device)
        if sampler is not None:
            sampler.reseed(self.config.generation.seed if seed is None else seed)
        self.sampler = self.runtime.sampler = self.verifier.sampler = sampler
        self.policy.reset()
        self.constraint = constraint = self.make_constraint(response_format)
        self.runtime.logits_processor = constraint.mask_next if constraint is not None else None
        self.proposer.reset(prompt_ids, constraint)
        self.finish_reason = None
        self.logprobs, self._on_logprobs, self.token_logprobs = logprobs, on_logprobs, []
        self.runtime.keep_logits = logprobs is not None
        self.last_rows = None
        self._masks = None  # (the tree cut by grammar_cut, its nodes' bitmask rows) until verify reads them

    def take(self, out: list[int], tokens: list[int], limit: int, on_tokens=None, rows: torch.Tensor | None = None) -> bool:
        """Append ``tokens`` to ``out`` up to a stop id (an EOS or the request's, inclusive), the
        ``limit`` or the grammar's end; True when the generation is finished, its
        :attr:`finish_reason` then ``"stop"`` or ``"length"``. ``rows``: the target's logits rows
        the tokens were picked from (their log-probabilities, when the generation keeps them)."""
        room = limit - len(out)
        chunk = tokens[:room]
        stops = self._stops
        stopped = next((i for i, t in enumerate(chunk) if t in stops), None) if stops else None
        if stopped is not None:
            chunk = chunk[: stopped + 1]
        if self.constraint is not None:  # the grammar follows the emitted tokens, up to its stop token
            chunk = chunk[: self.constraint.accept(chunk)]
        out.extend(chunk)
        if self.logprobs is not None and chunk and rows is not None:
            entries = token_logprobs(rows, chunk, self.logprobs)
            self.token_logprobs.extend(entries)
            if self._on_logprobs is not None:
                self._on_logprobs(entries)
        if on_tokens is not None and chunk:
            on_tokens(chunk)
        if (self.constraint is not None and self.constraint.terminated) or (bool(chunk) and chunk[-1] in stops):
            self.finish_reason = "stop"
        elif len(out) >= limit:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def grammar_cut(self, tree):
        """``tree`` without the nodes the response format forbids (their token or an ancestor's: never
        acceptable, p = 0 under any verifier), and the kept nodes' indices in ``tree`` (None when
        none was cut, or without a format). The grammar's masks of the kept nodes are computed here,
        once, and :meth:`verify` applies them to the same tree. Call it just before the verify forward."""
        self._masks = None
        if self.constraint is None or tree.size <= 1:
            return tree, None
        keep, rows = self.constraint.allowed(tree)
        if keep is not None:
            tree = subtree(tree, keep)
        self._masks = (tree, rows)
        return tree, keep

    def verify(self, tree, logits: torch.Tensor, position: int) -> VerifyResult:
        """The verifier's rule over ``tree``'s rows of target ``logits`` [n, V], the root row's token
        being sequence position ``position``'s: logits processing first (with a response format,
        every node's row masked by the grammar along its path: a forbidden token gets p = 0), and
        the sampler told where its keyed choices sit (a seed gives the same text whatever the tree).
        With log-probabilities kept, :attr:`last_rows` holds the target's rows the emitted tokens
        came from (before the masks), for :meth:`take`."""
        raw = logits.clone() if self.logprobs is not None and self.constraint is not None else logits
        if self.constraint is not None:  # (its time: other_ms, and stats["mask_ms_per_step"])
            cut, rows = self._masks if self._masks is not None else (None, None)
            self._masks = None
            self.constraint.mask_tree(tree, logits, rows if cut is tree else None)
        if self.sampler is not None:
            self.sampler.at(position)
        result = self.verifier.verify(tree, logits)
        if self.logprobs is not None:
            self.last_rows = raw[torch.tensor(result.path, device=raw.device)]
        return result

    def learn(self, proposal, tree, result: VerifyResult, emitted: list[int], path: list[int] | None = None) -> dict[str, int]:
        """The policy and the proposers see a verified step (``path``: the accepted path in the
        proposal's own tree where ``tree`` is a cut of it); returns the accepted tokens per proposer."""
        self.policy.observe_tree(tree, result)  # per-node learning (a no-op for most policies)
        accounted = result if path is None else attrs.evolve(result, path=path)
        return self.proposer.observe(proposal, accounted, emitted)

    def report(self, record: StepRecord, on_step=None) -> None:
        """A step is done: the policy (drafted steps), ``on_step`` and the observer plugins see its record."""
        if record.undrafted is None:
            self.policy.observe(record)
        if on_step is not None:
            on_step(record)
        if self._observe:
            self.host.pm.hook.adaptivespec_step(record=record)

    def finish(self, out: list[int], stats: dict[str, Any], records: list[StepRecord], prompt_id: Any = None) -> GenerationResult:
        """The generation is over (``out`` its tokens): the proposers remember it, the observer
        plugins get the result (once per generation)."""
        if self.proposer.active:
            stats["accepted_by_source"] = dict(self.proposer.accepted)
        if self.constraint is not None:  # host time computing and applying the grammar's masks, per target forward
            stats["mask_ms_per_step"] = self.constraint.mask_seconds * 1e3 / max(self.constraint.mask_calls, 1)
        self.proposer.finish(out)
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        res = GenerationResult(token_ids=out, text=text, stats=stats, records=records, prompt_id=prompt_id,
                               logprobs=self.token_logprobs if self.logprobs is not None else None)
        if self.host.has_observers("adaptivespec_generation_done"):
            self.host.pm.hook.adaptivespec_generation_done(result=res)
        return res

    def generate_ids(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        seed: int | None = None,
        response_format=None,
        stop_ids: Iterable[int] | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list], None] | None = None,
        sampling=None,
    ) -> GenerationResult:
        """Generation from ``prompt_ids``; ``on_tokens`` receives each step's new ids, ``on_step``
        each step's record (as the ``adaptivespec_step`` observers do); ``logprobs``: keep each
        token's log-probability and that many top ones (:attr:`GenerationResult.logprobs`; each
        step's to ``on_logprobs`` too); ``sampling``: this generation's own settings (see :meth:`begin`).

        Greedy at ``generation.temperature`` 0; otherwise sampled, the token at each position keyed
        by ``seed`` (default ``generation.seed``) and the position, so that a seed always gives the
        same output (:mod:`adaptivespec.sampling`). ``response_format`` (a
        :class:`~adaptivespec.response_format.ResponseFormat`; default the config's
        ``generation.response_format``) constrains the output. ``stop_ids``: token ids that end this
        generation besides :attr:`eos_ids` (the API's ``stop_token_ids``; kept in the output, as an
        EOS is)."""
        limit = max_new_tokens or self.config.generation.max_new_tokens
        rt = self.runtime
        speculative = self.proposer.active
        out: list[int] = []
        records: list[StepRecord] = []
        t0 = time.perf_counter()
        self.begin(prompt_ids, seed=seed, response_format=response_format, stop_ids=stop_ids, logprobs=logprobs,
                   on_logprobs=on_logprobs, sampling=sampling)
        done = self.take(out, [rt.prefill(prompt_ids, limit)], limit, on_tokens, getattr(rt, "last_rows", None))
        prefill = time.perf_counter() - t0  # to the first token (the prompt's forward; for a drafter, its too)
        self.proposer.extend(out)
        promoted, last_accepted, step = 0, -1, 0
        defers = getattr(rt, "defers_head", False)  # the policy may ask for plain steps (TreePolicy.plain_next)
        while not done:
            if not speculative or (defers and self.policy.plain_next()):  # plain: one target forward, one token
                t, n_before = time.perf_counter(), len(out)
                done = self.take(out, [rt.ar_step()], limit, on_tokens, getattr(rt, "last_rows", None))
                if speculative:
                    self.proposer.extend(out[n_before:])
                record = StepRecord(step=step, shape=None, tree_size=1, accepted=0, promoted=0, new_tokens=len(out) - n_before,
                                    draft_ms=0.0, verify_ms=(time.perf_counter() - t) * 1e3, other_ms=0.0,
                                    undrafted="policy" if speculative else "autoregressive")
            else:
                record, done = self._step(step, last_accepted, out, limit, on_tokens)
                promoted += record.promoted
                last_accepted = record.accepted
            records.append(record)
            self.report(record, on_step)
            step += 1

        wall = time.perf_counter() - t0
        forwards = 1 + len(records)
        stats = {
            "new_tokens": len(out),
            "target_forwards": forwards,
            "accept_length_mean": len(out) / forwards,
            "wall_seconds": wall,
            "tokens_per_second": len(out) / wall if wall > 0 else 0.0,
            "prefill_seconds": prefill,
            "promoted_tokens": promoted,
        }
        return self.finish(out, stats, records)

    def _step(self, step: int, last_accepted: int, out: list[int], limit: int, on_tokens) -> tuple[StepRecord, bool]:
        """One speculative step: propose, verify, commit, observe. Appends the emitted tokens to
        ``out``; returns the step's record and whether generation is finished."""
        rt, policy, proposer = self.runtime, self.policy, self.proposer
        t_step = time.perf_counter()
        # 1. propose: the sources' candidates give the signals the policy picks the shape from; the
        #    head drafts a tree of that shape, fused with the candidates (proposal.py)
        signals = proposer.signals(step, last_accepted)
        shape = policy.next_shape(signals)
        proposal = proposer.propose(shape)
        tree, keep = self.grammar_cut(proposal.tree)  # (a response format: what it forbids is not verified)
        t_draft = time.perf_counter()
        # 2. verify: one target forward over the tree (logits [n, V], one row per node), then the
        #    verifier's rule (logits processing between the two: :meth:`verify`)
        logits, hidden = rt.verify_forward(tree)
        t_verify = time.perf_counter()
        result = self.verify(tree, logits, rt.P + 1)
        # 3. commit: emit accepted + bonus tokens; keep the accepted path in both caches
        n_before = len(out)
        done = self.take(out, result.tokens, limit, on_tokens, self.last_rows)
        if not done:
            rt.commit(tree, result, hidden)
        # 4. observe: the policy and the proposers see what was emitted and accepted
        by_source = self.learn(proposal, tree, result, out[n_before:], None if keep is None else keep[result.path].tolist())
        t_end = time.perf_counter()
        record = StepRecord(
            step=step,
            shape=shape,
            tree_size=tree.size,
            accepted=result.accepted,
            promoted=result.promoted,
            new_tokens=len(out) - n_before,
            draft_ms=(t_draft - t_step) * 1e3,
            verify_ms=(t_verify - t_draft) * 1e3,
            other_ms=(t_end - t_verify) * 1e3,
            signals=signals,
            policy_state=policy.state(),
            accepted_by_source=by_source,
        )
        return record, done
