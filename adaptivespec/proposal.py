"""The proposal stage of a decode step: what the target verifies, and who proposed it.

One :class:`Proposer` per engine owns the candidate sources, the head's draft (through the
runtime) and their fusion into one verify tree, and counts the accepted tokens of every proposer.
The decode loop asks it twice per step and tells it once::

    signals = proposer.signals(step, last_accepted)   # the sources propose; what the policy reads
    shape = policy.next_shape(signals)
    proposal = proposer.propose(shape)                  # the head drafts; fusion under the budget
    ... verify proposal.tree, commit ...
    proposer.observe(proposal, result, emitted)         # the sources learn; per-source counts

A new candidate source needs nothing here or in the loop: it registers through
``adaptivespec_register_sources``, a config lists it under ``sources:``, and its tries are fused
with the head's tree like every other source's (:func:`~adaptivespec.fusion.fuse`).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from adaptivespec.fusion import FusedTree, fuse
from adaptivespec.protocols import Runtime
from adaptivespec.strategies import CandidateSource
from adaptivespec.types import CandidateTrie, DraftTree, StepSignals, TreeShape, VerifyResult

HEAD_NAME = "head"
"""The drafter's name in ``accepted_by_source`` (the sources go by their registered names)."""


@attrs.define(eq=False, kw_only=True)
class Proposal:
    """One step's verify tree and where its nodes came from."""

    tree: DraftTree
    """The tree the target verifies; its root is the last emitted token."""
    tries: list[CandidateTrie | None]
    """Each source's candidates this step, in config order (None: it proposed nothing)."""
    fused: FusedTree | None = None
    """Per-node origins when candidates were fused in; None: the head's tree as drafted."""


def structured_sources(host: Any, listed: Sequence[str]) -> list[CandidateSource]:
    """The registered sources that draft from the response format's grammar
    (``CandidateSource.structured_default``) and are not in ``listed``, with default parameters:
    what a speculative config gains when its output is constrained (``generation.grammar_draft``)."""
    out = []
    for name in host.sources.names():
        cls = host.sources.get(name).cls
        if getattr(cls, "structured_default", False) and name not in listed:
            out.append(cls())
    return out


class Proposer:
    """Candidate sources, the head's draft, their fusion and the per-proposer accounting.

    ``policy`` is the tree policy: its level rules shape the head's tree and its optional fusion
    rules (:class:`~adaptivespec.fusion_rules.FusionRules`) rank and size the fused one. The runtime's
    drafter is read at every call (a runtime may swap it for a proxy, as CUDA graphs do).
    """

    def __init__(self, runtime: Runtime, policy: Any, sources: Sequence[CandidateSource]) -> None:
        self.runtime, self.policy, self.sources = runtime, policy, list(sources)
        self.names = [HEAD_NAME, *(s.name for s in self.sources)]
        """Proposer of each origin bit of a fused node: bit 0 the head, bit ``k + 1`` source ``k``."""
        self.accepted: dict[str, int] = {}
        """Accepted tokens per proposer in this generation (the head only when there is a drafter)."""
        self._tries: list[CandidateTrie | None] = []

    @property
    def active(self) -> bool:
        """Whether anything proposes (a drafter or a source); False: plain decoding."""
        return self.runtime.drafter is not None or bool(self.sources)

    def extra_slots(self) -> int:
        """Most verify slots a source may add beyond a shape's ``ndt`` (the shape bank's extra rows)."""
        return max((s.extra_slots() for s in self.sources), default=0)

    # -- lifecycle ------------------------------------------------------------------------------
    def reset(self, prompt_ids: list[int], constraint: Any = None) -> None:
        """A new generation from ``prompt_ids``: the sources restart (``constraint``: the
        generation's grammar state, given to every source; None: free text), the counts go to zero."""
        for s in self.sources:
            s.constraint = constraint
            s.reset(list(prompt_ids))
        self.accepted = {n: 0 for n in self.names if n != HEAD_NAME or self.runtime.drafter is not None}

    def extend(self, tokens: list[int]) -> None:
        """``tokens`` were emitted outside a speculative step (the prefill's first token)."""
        for s in self.sources:
            s.extend(tokens)

    def finish(self, output_ids: list[int]) -> None:
        for s in self.sources:
            s.finish(list(output_ids))

    def forget(self) -> None:
        """Drop what the sources remembered across generations (their output caches)."""
        for s in self.sources:
            s.forget()

    # -- one step ---------------------------------------------------------------------------------
    def signals(self, step: int, last_accepted: int) -> StepSignals:
        """Ask every source for its candidates, and return what the policy may read before it
        picks the shape: the head's top-1 draft probability, or without a head the best score a
        source gave a child of the root (0 when none proposed)."""
        rt = self.runtime
        self._tries = tries = [s.propose() for s in self.sources]
        src_top = max((s for t in tries if t for s, p in zip(t.scores, t.parents) if p < 0), default=0.0)
        top1, entropy, top4 = rt.draft_root_stats() if rt.drafter is not None else (src_top, 0.0, src_top)
        return StepSignals(step=step, draft_top1_prob=top1, last_accepted=last_accepted, context=int(getattr(rt, "P", 0)),
                           draft_entropy=entropy, draft_top4_prob=top4, source_match=max((t.match_length for t in tries if t), default=0),
                           source_nodes=sum(len(t) for t in tries if t), source_top=src_top)

    def propose(self, shape: TreeShape) -> Proposal:
        """This step's verify tree: the head's tree of ``shape`` (not drafted when a source's
        candidates alone are worth verifying, see ``skip_draft``) fused with the candidates, at
        most ``shape.ndt`` nodes plus the proposing sources' extra slots. Without candidates the
        head's tree is verified as drafted; with neither, the root alone (a plain step)."""
        rt = self.runtime
        return self.fuse(shape, rt.draft(shape, self.policy) if self.drafts() else None)

    def drafts(self) -> bool:
        """Whether the head drafts this step (after :meth:`signals`): there is a head and no
        source's candidates alone are worth verifying (``skip_draft``)."""
        skip = any(t is not None and s.skip_draft(t) for s, t in zip(self.sources, self._tries))
        return self.runtime.drafter is not None and not skip

    def fuse(self, shape: TreeShape, tree: DraftTree | None) -> Proposal:
        """:meth:`propose`'s second half: the head's ``tree`` (None: not drafted) and this step's
        candidates as one verify tree. A batch engine drafts every request's tree in one pass per
        level, then calls this per request."""
        rt, tries = self.runtime, self._tries
        if tree is not None and not any(tries):
            return Proposal(tree=tree, tries=tries)
        budget = shape.ndt + max((s.extra_slots() for s, t in zip(self.sources, tries) if t), default=0)
        fused = fuse(int(rt.root), budget, shape, tree, candidates=tries, device=rt.device, rules=self.policy,
                     source_names=self.names[1:])
        return Proposal(tree=fused.tree, tries=tries, fused=fused)

    def observe(self, proposal: Proposal, result: VerifyResult, emitted: list[int]) -> dict[str, int]:
        """The step verified ``proposal`` and emitted ``emitted`` (``result.tokens`` cut at EOS or
        the limit): the sources extend their sequence, and those that proposed learn from the
        target's tokens. Returns this step's accepted tokens per proposer (a node proposed by two
        counts for both), also added to :attr:`accepted`."""
        for s, t in zip(self.sources, proposal.tries):
            s.extend(emitted)
            if t:
                s.observe(t, result.tokens)
        fused = proposal.fused
        by = fused.accepted_by(result.path, self.names) if fused is not None else {HEAD_NAME: result.accepted}
        step = {n: by.get(n, 0) for n in self.accepted}
        for n, k in step.items():
            self.accepted[n] += k
        return step
