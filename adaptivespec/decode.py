"""The decode loop: prefill, then speculative steps (draft -> verify -> accept -> commit).

:class:`Engine` resolves the strategies once from the config and calls their methods directly;
the per-step observer hook is called only when a plugin implements it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs
import torch

from adaptivespec.config import Config
from adaptivespec.fusion import fuse
from adaptivespec.models import DTYPES, encode_prompt, load_target
from adaptivespec.sampling import Sampler, check_sampling
from adaptivespec.types import StepRecord, StepSignals

_MODELS: dict[tuple, Any] = {}


def load_models(config: Config, host) -> tuple[Any, Any, Any]:
    """(target, tokenizer, drafter or None), cached per process so several configs share one load."""
    key = (config.model.target, config.runtime.dtype, config.runtime.device)
    if key not in _MODELS:
        _MODELS[key] = load_target(*key)
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
    """Generated ids only (the final EOS included when generation stopped there)."""
    text: str
    stats: dict[str, Any]
    """new_tokens, target_forwards, accept_length_mean, wall_seconds, tokens_per_second, promoted_tokens;
    accepted_by_source (speculative configs: accepted tokens per proposer, see StepRecord)."""
    records: list[StepRecord] = attrs.field(factory=list)
    prompt_id: Any = None


class Engine:
    """A target, a drafter, a tree policy and a verifier, ready to generate."""

    def __init__(self, config: Config, host=None) -> None:
        if host is None:
            from adaptivespec.plugins import get_plugin_host

            host = get_plugin_host()
        self.config, self.host = config, host
        if config.runtime.threads:
            torch.set_num_threads(config.runtime.threads)
        self.target, self.tokenizer, drafter = load_models(config, host)
        self.runtime = host.runtimes.get(config.runtime.name).cls(self.target, drafter, config)
        self.policy = host.policies.get(config.policy.name).cls(config.policy.params)
        self.verifier = host.verifiers.get(config.verifier.name).cls(config.verifier.params)
        check_sampling(config, host)  # temperature > 0 needs a verifier with a sampling form
        self.sampler = Sampler.from_config(config.generation, self.runtime.device)  # None: greedy
        if self.sampler is not None:
            self.runtime.sampler = self.verifier.sampler = self.sampler
        self.sources = [host.sources.get(s.name).cls(s.params) for s in config.sources]
        self.proposers = ["head", *(s.name for s in config.sources)]  # origin bits of fused nodes
        if drafter is not None or self.sources:  # one executor per shape the policy may choose, built up front
            extra = max((s.extra_slots() for s in self.sources), default=0)
            self.runtime.prepare(self.policy.shapes(), capacity=2 * config.generation.max_new_tokens + 512, extra_rows=extra)
        self.eos = self.tokenizer.eos_token_id if config.generation.stop_at_eos else None
        self._observe = host.has_observers("adaptivespec_step")

    @property
    def lossless(self) -> bool:
        return self.config.autoregressive or self.verifier.lossless

    def forget(self) -> None:
        """Drop what the candidate sources remembered across generations (their output caches)."""
        for s in self.sources:
            s.forget()

    def encode(self, text: str, raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat=self.config.generation.chat_template and not raw)

    def generate(self, text: str, *, raw: bool = False, max_new_tokens: int | None = None, on_tokens=None,
                 seed: int | None = None) -> GenerationResult:
        result = self.generate_ids(self.encode(text, raw), max_new_tokens=max_new_tokens, on_tokens=on_tokens, seed=seed)
        return result

    def generate_ids(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        seed: int | None = None,
    ) -> GenerationResult:
        """Generation from ``prompt_ids``; ``on_tokens`` receives each step's new ids.

        Greedy at ``generation.temperature`` 0; otherwise sampled, the generator reseeded with
        ``seed`` (default ``generation.seed``) so that a seed always gives the same output."""
        limit = max_new_tokens or self.config.generation.max_new_tokens
        if self.sampler is not None:
            self.sampler.reseed(self.config.generation.seed if seed is None else seed)
        rt, policy, verifier, sources = self.runtime, self.policy, self.verifier, self.sources
        speculative = rt.drafter is not None or bool(sources)
        out: list[int] = []
        records: list[StepRecord] = []
        promoted_total = 0
        by_source = {n: 0 for n in self.proposers if n != "head" or rt.drafter is not None}
        t0 = time.perf_counter()
        policy.reset()
        for s in sources:
            s.reset(list(prompt_ids))

        first = rt.prefill(prompt_ids, limit)
        forwards = 1
        done = self._take(out, [first], limit, on_tokens)
        for s in sources:
            s.extend(out)
        last_accepted, step = -1, 0
        while not done:
            t_step = time.perf_counter()
            if not speculative:
                done = self._take(out, [rt.ar_step()], limit, on_tokens)
                forwards += 1
                continue
            # 1. candidates from the sources; shape: the policy reads signals available before drafting
            tries = [s.propose() for s in sources]
            top1 = rt.draft_top1_prob() if rt.drafter is not None else max(
                (s for t in tries if t for s, p in zip(t.scores, t.parents) if p < 0), default=0.0)
            signals = StepSignals(step=step, draft_top1_prob=top1, last_accepted=last_accepted)
            shape = policy.next_shape(signals)
            # 2. draft a tree of that shape (unless a source's match is long enough); fuse the candidates in
            skip = any(t is not None and s.skip_draft(t) for s, t in zip(sources, tries))
            tree = rt.draft(shape, policy) if rt.drafter is not None and not skip else None
            fused = None
            if any(tries) or tree is None:  # (no drafter and nothing proposed: the root alone, a plain step)
                budget = shape.ndt + max((s.extra_slots() for s, t in zip(sources, tries) if t), default=0)
                fused = fuse(int(rt.root), budget, shape, tree, candidates=tries, device=rt.device, rules=policy)
                tree = fused.tree
            t_draft = time.perf_counter()
            # 3. verify: one target forward over the tree, then the verifier's rule
            logits, hidden = rt.verify_forward(tree)
            t_verify = time.perf_counter()
            result = verifier.verify(tree, logits)
            policy.observe_tree(tree, result)  # per-node learning (a no-op for most policies)
            forwards += 1
            # 4. emit accepted + bonus tokens; commit the accepted path to both caches
            n_before = len(out)
            done = self._take(out, result.tokens, limit, on_tokens)
            if not done:
                rt.commit(tree, result, hidden)
            for s, t in zip(sources, tries):
                s.extend(out[n_before:])
                if t:
                    s.observe(t, result.tokens)
            step_by = fused.accepted_by(result.path, self.proposers) if fused is not None else {"head": result.accepted}
            step_by = {n: step_by.get(n, 0) for n in by_source}
            for n, k in step_by.items():
                by_source[n] += k
            t_end = time.perf_counter()
            promoted_total += result.promoted
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
                accepted_by_source=step_by,
            )
            policy.observe(record)
            records.append(record)
            if on_step is not None:
                on_step(record)
            if self._observe:
                self.host.pm.hook.adaptivespec_step(record=record)
            last_accepted, step = result.accepted, step + 1

        wall = time.perf_counter() - t0
        stats = {
            "new_tokens": len(out),
            "target_forwards": forwards,
            "accept_length_mean": len(out) / forwards,
            "wall_seconds": wall,
            "tokens_per_second": len(out) / wall if wall > 0 else 0.0,
            "promoted_tokens": promoted_total,
        }
        if speculative:
            stats["accepted_by_source"] = by_source
        for s in sources:
            s.finish(list(out))
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        res = GenerationResult(token_ids=out, text=text, stats=stats, records=records)
        if self.host.has_observers("adaptivespec_generation_done"):
            self.host.pm.hook.adaptivespec_generation_done(result=res)
        return res

    def _take(self, out: list[int], tokens: list[int], limit: int, on_tokens) -> bool:
        """Append ``tokens`` up to EOS (inclusive) or the limit; True when generation is finished."""
        room = limit - len(out)
        chunk = tokens[:room]
        if self.eos is not None and self.eos in chunk:
            chunk = chunk[: chunk.index(self.eos) + 1]
        out.extend(chunk)
        if on_tokens is not None and chunk:
            on_tokens(chunk)
        return len(out) >= limit or (self.eos is not None and bool(chunk) and chunk[-1] == self.eos)
