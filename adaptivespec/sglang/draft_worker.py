"""The draft worker of :mod:`adaptivespec.sglang.workers`: SGLang's EAGLE draft worker, whose
draft-extend keeps the bank's widest first level and may be skipped on settled undrafted steps.

Imports SGLang at the top, like :mod:`~adaptivespec.sglang.workers` (only inside SGLang's processes).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from adaptivespec.sglang import root_entropy

ew = importlib.import_module("sglang.srt.speculative.eagle_worker_v2")
"""SGLang's EAGLE worker module (the draft worker's base, the draft input class)."""


@contextlib.contextmanager
def topk_as(worker: Any, topk: int):
    """Temporarily set ``worker.topk`` (0: leave it)."""
    saved = worker.topk
    if topk:
        worker.topk = topk
    try:
        yield
    finally:
        worker.topk = saved



class AdaptiveSpecDraftWorker(ew.EagleDraftWorker):
    """Draft worker whose draft-extend hands the next step the bank's widest first level.

    The next step's shape is not known when draft-extend runs, so it keeps ``max topk``
    candidates with their probabilities (above 1 this also bypasses SGLang's topk=1 argmax path,
    which reports probability 1.0); the worker slices them to the chosen ``topk``.
    """

    adaptivespec_topk = 0  # the bank's largest topk when > 1; 0 keeps SGLang's behaviour

    adaptivespec_entropy = False  # measure the root's entropy (a policy reads it)

    adaptivespec_skip_extend = False  # this step's draft-extend is skipped (set per step by the worker)

    adaptivespec_skip_prefill = False  # this prefill's draft-extend is skipped (set per batch by the worker)

    def _draft_extend_for_decode(self, batch, batch_result, *args, **kwargs):
        if self.adaptivespec_skip_extend:
            return self._adaptivespec_skipped_extend(batch, batch_result)
        with topk_as(self, self.adaptivespec_topk), root_entropy.measuring(self.adaptivespec_entropy):
            return super()._draft_extend_for_decode(batch, batch_result, *args, **kwargs)

    def _adaptivespec_skipped_extend(self, batch, batch_result) -> None:
        """A settled undrafted step's draft-extend, skipped (as SGLang's zero-step flag
        ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` does, decided per step here): the next step's
        draft input gets zeros of the right shapes (the bank's widest top-k, so that a batch merged
        with new requests stays consistent). The head's KV cache then lacks these positions; a
        request that drafts again later drafts from a colder head (verification keeps the output
        exact; its acceptance may drop), which is why only settled steps skip it."""
        nxt = batch_result.next_draft_input
        stub = self._adaptivespec_stub(batch.seq_lens.shape[0], batch.seq_lens.device)
        nxt.topk_p, nxt.topk_index = stub["topk_p"], stub["topk_index"]
        if stub["hidden_states"] is not None:
            nxt.hidden_states = stub["hidden_states"]

    def _adaptivespec_stub(self, bs: int, device) -> dict[str, Any]:
        """Zeros shaped as a draft-extend's output for ``bs`` requests: the first level at the bank's
        widest top-k (so that a batch merged with other requests stays consistent) and the head's
        recurrent hidden state (None where the head has none)."""
        k = max(self.topk, self.adaptivespec_topk)
        hidden_size, hidden_dtype = ew.get_draft_recurrent_hidden_state_spec(self.draft_runner)
        return {
            "topk_p": torch.zeros((bs, k), dtype=torch.float32, device=device),
            "topk_index": torch.zeros((bs, k), dtype=torch.int64, device=device),
            "hidden_states": (torch.zeros((bs, hidden_size), dtype=hidden_dtype, device=device)
                              if hidden_size is not None else None),
        }

    def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids, *args, **kwargs):
        if self.adaptivespec_skip_prefill:
            return self._adaptivespec_skipped_prefill(batch, next_token_ids)
        with topk_as(self, self.adaptivespec_topk), root_entropy.measuring(self.adaptivespec_entropy):
            return super()._draft_extend_for_prefill(batch, target_hidden_states, next_token_ids, *args, **kwargs)

    def _adaptivespec_skipped_prefill(self, batch, next_token_ids):
        """The draft input of requests admitted while the load model is settled, without running the
        head over their prompts: the target's first token as the next root, zeros elsewhere (as
        :meth:`_adaptivespec_skipped_extend`). Such a request drafts, if it ever does, from a head
        that never saw its prompt: verification keeps its output exact, its acceptance is low, and
        the load model prices that in from what the probes accept."""
        return ew.EagleDraftInput(**self._adaptivespec_stub(len(batch.reqs), next_token_ids.device),
                                  bonus_tokens=next_token_ids, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)

    def _rebuild_topk1_chain_buffers(self):
        # While a topk=1 shape is captured, SGLang's capture context restores the start-up
        # (nsteps, ndt) before .topk is restored; skip that inconsistent rebuild:
        # apply_runtime_state rebuilds the buffers whenever a topk=1 state becomes active.
        if self.topk != 1 or self.speculative_num_draft_tokens == self.speculative_num_steps + 1:
            super()._rebuild_topk1_chain_buffers()
