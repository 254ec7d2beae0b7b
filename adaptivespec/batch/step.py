"""What a step of the batch engine carries: each decoding request's item in flight, and what the
step gives back (:class:`StepOutput`: read by the server's worker, its /metrics, the row budget and
the tests)."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from adaptivespec.batch.request import Request
from adaptivespec.batch.scheduler import Chunk
from adaptivespec.proposal import Proposal
from adaptivespec.types import DraftTree, StepRecord, TreeShape, VerifyResult


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
    token: int | None = None
    """A greedy plain row's token, picked by the runner with the step's others in one call."""
    emitted: int = 0
    """Tokens it emitted this step."""
    context: int = 0
    """Its cached positions when the step began."""
    record: StepRecord | None = None
    """Its step's record, once committed."""

    def step_record(self, step: int, result: VerifyResult, new_tokens: int, by_source: dict[str, int], draft_ms: float,
                    verify_ms: float, speculative: bool) -> StepRecord:
        """The record of this request's step: a drafted one (its shape, tree and acceptance), or a
        plain row (``undrafted``: the config's, ``autoregressive``, or the row budget's, ``load``)."""
        if self.proposal is None:
            return StepRecord(step=step, shape=None, tree_size=1, accepted=0, promoted=0, new_tokens=new_tokens,
                              draft_ms=0.0, verify_ms=verify_ms, other_ms=0.0,
                              undrafted="load" if speculative else "autoregressive")
        return StepRecord(step=step, shape=self.shape, tree_size=self.tree.size, accepted=result.accepted,
                          promoted=result.promoted, new_tokens=new_tokens, draft_ms=draft_ms, verify_ms=verify_ms,
                          other_ms=0.0, signals=self.signals, policy_state=self.request.lane.engine.policy.state(),
                          accepted_by_source=by_source)


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


def read_prompts(chunks: Sequence[Chunk], first_logits: torch.Tensor, fused, device) -> list:
    """The prompt chunks read: their progress, the first token of each prompt read to its end
    (picked as prefill picks it), and the head's rows for them (after those of a prefix taken
    from the cache)."""
    follow, row, k = [], 0, 0
    for c in chunks:
        r = c.request
        lane, rt = r.lane, r.lane.engine.runtime
        n = c.end - c.start
        rt.P = c.end  # the request's computed positions (Request.prefilled reads it)
        nxt = r.prompt[c.start + 1 : c.end + 1]
        if c.last:
            rt.root = rt.pick(first_logits[k], c.end)
            k += 1
            nxt = nxt + [int(rt.root)]
        if fused is not None:
            rows = (torch.tensor(nxt, dtype=torch.long, device=device), fused[row:row + n],
                    torch.arange(c.start, c.end, device=device))
            if lane.kept_rows is not None:  # the prefix taken from the cache goes first
                rows, lane.kept_rows = tuple(torch.cat(p) for p in zip(lane.kept_rows, rows)), None
            follow.append((lane, *rows))
        row += n
    return follow
