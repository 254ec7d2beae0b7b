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
from adaptivespec.models import DTYPES, encode_prompt, load_target
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
    """new_tokens, target_forwards, accept_length_mean, wall_seconds, tokens_per_second, promoted_tokens."""
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
        if drafter is not None:  # one executor per shape the policy may choose, built up front
            self.runtime.prepare(self.policy.shapes(), capacity=2 * config.generation.max_new_tokens + 512)
        self.eos = self.tokenizer.eos_token_id if config.generation.stop_at_eos else None
        self._observe = host.has_observers("adaptivespec_step")

    @property
    def lossless(self) -> bool:
        return self.config.autoregressive or self.verifier.lossless

    def encode(self, text: str, raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat=self.config.generation.chat_template and not raw)

    def generate(self, text: str, *, raw: bool = False, max_new_tokens: int | None = None, on_tokens=None) -> GenerationResult:
        result = self.generate_ids(self.encode(text, raw), max_new_tokens=max_new_tokens, on_tokens=on_tokens)
        return result

    def generate_ids(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> GenerationResult:
        """Greedy generation from ``prompt_ids``; ``on_tokens`` receives each step's new ids."""
        limit = max_new_tokens or self.config.generation.max_new_tokens
        rt, policy, verifier = self.runtime, self.policy, self.verifier
        speculative = rt.drafter is not None
        out: list[int] = []
        records: list[StepRecord] = []
        promoted_total = 0
        t0 = time.perf_counter()
        policy.reset()

        first = rt.prefill(prompt_ids, limit)
        forwards = 1
        done = self._take(out, [first], limit, on_tokens)
        last_accepted, step = -1, 0
        while not done:
            t_step = time.perf_counter()
            if not speculative:
                done = self._take(out, [rt.ar_step()], limit, on_tokens)
                forwards += 1
                continue
            # 1. shape: the policy reads signals available before drafting
            signals = StepSignals(step=step, draft_top1_prob=rt.draft_top1_prob(), last_accepted=last_accepted)
            shape = policy.next_shape(signals)
            # 2. draft a tree of that shape
            tree = rt.draft(shape, policy)
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
