"""The draft stage's steps inside SGLang's EAGLE worker: merge the sources' candidates into the
verify input, repair the no-draft step's input, hand the emitted tokens back to the sources.

A mixin of :class:`~adaptivespec.sglang.workers.AdaptiveSpecWorker` (which owns the stage, the
controller and the runtime states); like that module it imports SGLang at the top and is imported
only inside SGLang's processes. The merge itself is :mod:`adaptivespec.sglang.draft_stage` (no sglang).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import torch

from adaptivespec.sglang.draft_stage import MergedTrees
from adaptivespec.sglang.module_wraps import wrap_once

logger = logging.getLogger("adaptivespec.sglang")

eu = importlib.import_module("sglang.srt.speculative.eagle_utils")
"""SGLang's tree-mask modes."""

_HEAD_SCORES: dict[str, Any] = {"last": None}
"""The draft's path probabilities of the head nodes SGLang kept, from its last
``organize_draft_results`` ([bs, ndt - 1], node order), for the draft stage's joint ranking."""


def keep_head_scores(ew: Any) -> None:
    """Wrap the EAGLE worker module's ``organize_draft_results`` (its ``draft_forward`` looks it up
    per call) so that each draft leaves its chosen nodes' scores in :data:`_HEAD_SCORES`."""
    wrap_once(ew, "organize_draft_results", _organize_keeping_scores)


def _organize_keeping_scores(organize, score_list, token_list, parents_list, num_draft_token):
    """SGLang's ``organize_draft_results``, also keeping the scores of the nodes it chose (it
    returns their indices only)."""
    parent_list, top_scores_index, draft_tokens = organize(score_list, token_list, parents_list, num_draft_token)
    _HEAD_SCORES["last"] = torch.cat(score_list, dim=1).flatten(1).gather(1, top_scores_index)
    return parent_list, top_scores_index, draft_tokens


def grammar_state(req) -> Any:
    """The request's grammar matcher (xgrammar's, which SGLang advances) when it stands at the
    request's last token; None for free text, a grammar of another kind, or one not in step."""
    grammar = getattr(req, "grammar", None)
    matcher = getattr(grammar, "matcher", None)
    if matcher is None or len(getattr(grammar, "accepted_tokens", ())) != len(req.output_ids):
        return None
    return matcher


class DraftStageSteps:
    """The worker's draft-stage steps (see the module docstring)."""

    def _adaptivespec_grammar_view(self, matcher) -> Any:
        """A request's grammar state as the sources' ``constraint`` (read, never advanced here);
        None where no tokenizer is loaded (``--skip-tokenizer-init``): the request is still
        constrained by SGLang, only not drafted from its grammar."""
        from adaptivespec.constraints import Constraint, GrammarBackend

        backend = getattr(self, "_adaptivespec_grammar_backend", None)
        if backend is None:
            tokenizer = getattr(self._target_worker, "tokenizer", None)
            if tokenizer is None:
                if not getattr(self, "_adaptivespec_told_grammar", False):
                    logger.warning("adaptivespec: no tokenizer in the worker: constrained requests are not drafted from their grammar")
                    self._adaptivespec_told_grammar = True
                return None
            vocab = self._target_worker.model_runner.model_config.vocab_size
            backend = self._adaptivespec_grammar_backend = GrammarBackend.for_tokenizer(tokenizer, vocab)
        return Constraint.following(backend, matcher)

    @staticmethod
    def _adaptivespec_root_only(batch) -> None:
        """The no-draft step's verify input as a one-node chain: SGLang's own (``_build_trivial_verify_input``)
        carries a prefix-sized mask that its CPU attention kernel refuses (it expects one cell per
        request) and int32 tokens that its CPU verify kernel refuses (int64 like the retrieve
        arrays); a chain (``topk`` 1) needs no mask, and the attention kernel takes its mask-free path."""
        spec = batch.spec_info
        bs = len(batch.reqs)
        batch.spec_info = dataclasses.replace(
            spec, topk=1, draft_token=spec.draft_token.long(), num_tokens_per_req=-1,
            custom_mask=torch.ones(bs, dtype=torch.bool, device=spec.positions.device))

    def _adaptivespec_merge(self, batch) -> MergedTrees | None:
        """Merge the sources' candidates into the head's verify input (``batch.spec_info``); on a
        merge, the batch verifies the merged trees at their width. None: nothing to merge."""
        spec, stage = batch.spec_info, self.adaptivespec_stage
        reqs = batch.reqs
        tries = stage.propose([(r.rid, r.origin_input_ids, r.output_ids, grammar_state(r)) for r in reqs])
        mode = self._draft_worker.tree_mask_mode
        mask = getattr(self._target_worker.model_runner.attn_backend, "verify_mask", None)  # a property where it exists
        if mask is not None:
            mode = mask.mode
        if getattr(spec, "kv_loc_plan", None) is not None or mode not in (eu.TreeMaskMode.QLEN_ONLY, eu.TreeMaskMode.FULL_MASK):
            stage.unmerged([r.rid for r in reqs], tries)
            if not getattr(self, "_adaptivespec_told", False):
                logger.warning("adaptivespec: candidates not merged: this backend plans verify KV slots or packs "
                               "its tree mask (%s); the head's trees verify alone", mode)
                self._adaptivespec_told = True
            return None
        bs, ndt = len(reqs), spec.draft_token_num
        scores, _HEAD_SCORES["last"] = _HEAD_SCORES["last"], None
        if scores is not None and tuple(scores.shape) != (bs, ndt - 1):
            scores = None  # not this step's draft (a topk=1 chain keeps no scores)
        merged = stage.merge(
            head_tokens=spec.draft_token.view(bs, ndt), next_token=spec.retrieve_next_token,
            next_sibling=spec.retrieve_next_sibling, seq_lens=batch.seq_lens, shape=self.adaptivespec_shape,
            tries=tries, rids=[r.rid for r in reqs], full_mask=mode == eu.TreeMaskMode.FULL_MASK,
            seq_lens_host=batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else None,
            head_scores=scores,
        )
        if merged is None:
            return None
        layout = merged.layout
        self._adaptivespec_widen(merged.width)
        batch.spec_info = dataclasses.replace(
            spec, draft_token=merged.tokens.reshape(-1).to(spec.draft_token.dtype), custom_mask=layout.custom_mask,
            positions=layout.positions, retrieve_index=layout.retrieve_index,
            retrieve_next_token=layout.retrieve_next_token, retrieve_next_sibling=layout.retrieve_next_sibling,
            spec_steps=max(layout.depth, 1), topk=-1, draft_token_num=merged.width, num_tokens_per_req=-1,
            draft_probs=None, prepared_out_cache_loc=None, prepared_mrope_positions=None, kv_loc_plan=None,
        )
        return merged

    def _adaptivespec_after_verify(self, batch, out, merged: MergedTrees | None) -> None:
        """Hand the step's emitted tokens to the sources and count what each proposer got accepted
        (one host copy of the accept lengths, tokens and accepted rows)."""
        bs = len(batch.reqs)
        index = out.accept_index.long()
        tokens = out.next_token_ids.long().view(-1)
        host = torch.cat([out.accept_lens.long(), tokens, index.view(-1)]).tolist()
        lens, flat, rest = host[:bs], host[bs: bs + tokens.numel()], host[bs + tokens.numel():]
        depth = index.shape[1]
        accepted = [rest[b * depth: (b + 1) * depth] for b in range(bs)]
        if merged is not None or self.topk > 1:  # SGLang compacted the accepted path to the front
            width = len(flat) // bs
            emitted = [flat[b * width: b * width + lens[b]] for b in range(bs)]
        else:
            emitted = [[flat[i] for i in accepted[b][: lens[b]]] for b in range(bs)]
        by_source = self.adaptivespec_stage.observe(accepted if merged is not None else None, emitted)
        if merged is not None:
            self.adaptivespec.note_sources(by_source, merged.width)

