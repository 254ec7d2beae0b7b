"""Our draft stage inside SGLang's EAGLE-3 worker: the head's tree and the candidate sources' tries,
merged into one verify tree per request. No sglang import.

The same proposal pieces as the torch runtime (:mod:`adaptivespec.proposal`): the config's
registered :class:`~adaptivespec.strategies.CandidateSource` classes, with their lifecycle
(``reset`` / ``extend`` / ``propose`` / ``observe``), and :func:`~adaptivespec.fusion.fuse`. What
differs is where they run: one set of source instances per served request (keyed by SGLang's
request id, rebuilt from the request's tokens whenever they do not match what the sources hold),
and the head's tree comes from SGLang's draft, as its verify input laid it out.

Merge rule (served): the head's nodes (scored by the draft's path probabilities, when SGLang's
draft kept them) and the sources' nodes (by their own scores) are ranked together in at most
``ndt + extra_slots`` rows, as the torch runtime's fusion ranks them; without the head's scores the
head's tree is kept whole and the sources fill the extra rows. A node the head also drafted is one
node. SGLang verifies the same number of tokens for every request of a batch, so each request is
padded (padding rows are unreachable, never accepted) to ``ndt`` plus the most nodes the sources
added to one request, rounded up to a multiple of 4; a step where no source adds a node verifies
the head's trees as SGLang built them, at ``ndt``.

Constrained requests (``json_schema``, ``regex``, ``ebnf``): the sources that draft from a grammar
(``structured_default``, the ``grammar`` source) are added to the config's, as the torch runtime adds
them, and read the request's grammar state as SGLang keeps it (its xgrammar matcher, viewed through
:meth:`~adaptivespec.constraints.Constraint.following`, never advanced here). SGLang still masks
every verified node by the grammar, so a candidate can only be accepted where the grammar allows it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs
import torch

from adaptivespec.fusion import fuse
from adaptivespec.proposal import HEAD_NAME, structured_sources
from adaptivespec.sglang.tree_layout import VerifyLayout, verify_layout
from adaptivespec.sglang.verification import parents_from_retrieve
from adaptivespec.strategies import CandidateSource
from adaptivespec.types import CandidateTrie, TreeShape

HEAD_FIRST = 2.0
"""Fusion score of every head node: above any source score (at most 1), so the head's tree is kept
whole and the sources fill the extra rows."""


@attrs.define(eq=False)
class _RequestState:
    sources: list[CandidateSource]
    tokens: list[int] = attrs.field(factory=list)
    """The request's tokens (prompt + output) the sources hold."""
    grammar: Any = None
    """The request's grammar state (a matcher its server advances) and its view for the sources."""
    view: Any = None
    extra: int = 0
    """Verify rows its sources may add beyond the head's tree: the most of theirs, those that
    draft from a grammar counted only while the request has one (as in the torch runtime)."""


@attrs.frozen(kw_only=True)
class MergedTrees:
    """One step's merged verify trees, ``width`` nodes per request (node 0 the root)."""

    tokens: torch.Tensor  # [bs, width] int64
    parents: torch.Tensor  # [bs, width] int64; -1 for the root and for padding
    origin: list[list[int]]  # per request, per node: proposer bits (bit 0 the head, bit k + 1 source k)
    layout: VerifyLayout
    width: int
    rids: tuple[Any, ...]

    @property
    def candidates(self) -> int:
        """Source nodes verified this step that the head did not also draft, summed over requests."""
        return sum(1 for per in self.origin for bits in per if bits and not bits & 1)


class ServedDraftStage:
    """Per-request candidate sources and the merge of their tries into SGLang's head tree.

    A merged step verifies only the rows it needs: ``ndt`` plus the most nodes the sources added
    to one request of the batch, rounded up to :attr:`ROW_STEP` (each width is a runtime state).

    ``make_sources`` builds one request's sources (in config order); ``extra_slots`` is how many
    verify rows they may add beyond the head's ``ndt`` (the largest of theirs, as in the torch runtime).
    """

    ROW_STEP = 4
    """Extra verify rows come in multiples of this (fewer widths to build)."""

    def __init__(self, make_sources: Callable[[], list[CandidateSource]], extra_slots: int,
                 view: Callable[[Any], Any] | None = None) -> None:
        self.make_sources = make_sources
        self.view = view
        """Wraps a request's grammar state (what :meth:`propose` is given) as the sources'
        ``constraint`` (:meth:`adaptivespec.constraints.Constraint.following`); None: sources get none."""
        probe = make_sources()
        self.names = [HEAD_NAME, *(s.name for s in probe)]
        self._fixed_extra = extra_slots > 0  # given: every request may add that many rows
        self.extra_slots = extra_slots if extra_slots > 0 else max((s.extra_slots() for s in probe), default=0)
        self._requests: dict[Any, _RequestState] = {}
        self._last: MergedTrees | None = None
        self._last_tries: list[list[CandidateTrie | None]] = []
        self._rids: tuple[Any, ...] = ()

    @classmethod
    def from_config(cls, config: Any, host: Any) -> "ServedDraftStage | None":
        """The stage of ``config``'s ``sources:`` (None when it lists none)."""
        if not getattr(config, "sources", ()):
            return None
        entries = [(host.sources.get(s.name).cls, s.params) for s in config.sources]
        listed = [s.name for s in config.sources]
        if getattr(config.generation, "grammar_draft", True):  # what a constrained request adds, as in the torch runtime
            entries += [(type(s), s.params) for s in structured_sources(host, listed)]
        return cls(lambda: [c(p) for c, p in entries], extra_slots=0)

    def width(self, ndt: int, added: int | None = None) -> int:
        """Verify rows per request of a merged step whose head trees have ``ndt`` nodes and whose
        sources added at most ``added`` nodes to one request (default: all ``extra_slots``):
        the extra rows rounded up to a multiple of :attr:`ROW_STEP`, at most ``extra_slots``."""
        extra = self.extra_slots if added is None else min(-(-added // self.ROW_STEP) * self.ROW_STEP, self.extra_slots)
        return ndt + extra

    def widths(self, shapes: Sequence[TreeShape]) -> list[int]:
        """Every verify width a merged step of these shapes may use (one runtime state each)."""
        return sorted({self.width(s.ndt, a) for s in shapes for a in range(1, self.extra_slots + 1)})

    # -- requests -----------------------------------------------------------------------------
    def _sync(self, rid: Any, prompt: Sequence[int], output: Sequence[int], grammar: Any = None) -> _RequestState:
        state = self._requests.get(rid)
        n = len(prompt) + len(output)
        if state is not None and len(state.tokens) != n:
            held, seq = state.tokens, [*prompt, *output]
            m = min(n, len(held))  # the last tokens both have, compared
            if seq[max(m - 4, 0): m] != held[max(m - 4, 0): m]:
                state = None  # not the same sequence (a retraction, a cut): rebuilt below
            elif n > len(held):  # tokens emitted while the stage did not run: the sources catch up
                missing = seq[len(held):]
                for s in state.sources:
                    s.extend(missing)
                held.extend(missing)
            # n < len(held): the server's token lists lag the verify the sources already saw
            # (the overlap scheduler): the sources keep what they hold
        if state is None:  # new, or not in step
            state = self._requests[rid] = _RequestState(self.make_sources(), tokens=[*prompt, *output])
            for s in state.sources:
                s.reset(list(prompt))
                if output:
                    s.extend(list(output))
            self._set_grammar(state, grammar)
        elif grammar is not state.grammar:
            self._set_grammar(state, grammar)
        return state

    def _set_grammar(self, state: _RequestState, grammar: Any) -> None:
        """The request's grammar state (server-side: viewed, never advanced here) becomes its
        sources' ``constraint``, and its extra verify rows follow."""
        state.grammar = grammar
        state.view = self.view(grammar) if grammar is not None and self.view is not None else None
        for s in state.sources:
            s.constraint = state.view
        state.extra = max((s.extra_slots() for s in state.sources
                           if state.view is not None or not getattr(s, "structured_default", False)), default=0)

    def propose(self, requests: Sequence[tuple]) -> list[list[CandidateTrie | None]]:
        """Each request's tries, ``requests`` as ``(rid, prompt_ids, output_ids)`` or
        ``(rid, prompt_ids, output_ids, grammar)``: ``grammar`` is the request's grammar state at
        ``output_ids`` (None: free text, or not in step with the tokens this time). Requests absent
        from this batch are forgotten (a request that comes back is rebuilt from its tokens)."""
        states = [self._sync(*r) for r in requests]
        live = {r[0] for r in requests}
        for rid in [r for r in self._requests if r not in live]:
            del self._requests[rid]
        return [[s.propose() for s in st.sources] for st in states]

    # -- one step ------------------------------------------------------------------------------
    def merge(self, *, head_tokens: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
              seq_lens: torch.Tensor, shape: TreeShape, tries: list[list[CandidateTrie | None]],
              rids: Sequence[Any], full_mask: bool = False, seq_lens_host: Sequence[int] | None = None,
              head_scores: torch.Tensor | None = None) -> MergedTrees | None:
        """Merge the head's trees (SGLang's layout: ``head_tokens`` [bs, ndt], ``next_token`` /
        ``next_sibling`` its ``retrieve_next_*``) with ``tries``; None when no request has a
        candidate (the head's trees verify as SGLang built them).

        ``head_scores`` [bs, ndt - 1]: the draft's path probability of every head node but the
        root (what SGLang ranked them by): head and source nodes are then ranked together, as the
        torch runtime's fusion does, and a source node may take a weak head node's row. None: the
        head's tree is kept whole (:data:`HEAD_FIRST`)."""
        if not any(t for per in tries for t in per):
            self.unmerged(rids, tries)
            return None
        bs, ndt = head_tokens.shape
        host = torch.stack([head_tokens.long(), next_token.long(), next_sibling.long()]).cpu().tolist()
        scores = head_scores.float().cpu().tolist() if head_scores is not None else None
        trees = []
        for b in range(bs):
            h_parents = parents_from_retrieve(host[1][b], host[2][b])
            reach = _reachable(h_parents)
            keep = [i for i in range(ndt) if reach[i]]
            slot = {node: k for k, node in enumerate(keep)}
            h_tok = [host[0][b][i] for i in keep]
            h_par = [-1] + [slot[h_parents[i]] for i in keep[1:]]
            h_score = [HEAD_FIRST] * len(keep) if scores is None else [math.inf] + [scores[b][i - 1] for i in keep[1:]]
            state = self._requests.get(rids[b])
            extra = self.extra_slots if self._fixed_extra or state is None else min(state.extra, self.extra_slots)
            fused = fuse(h_tok[0], len(keep) + extra, shape, _HeadTree(h_tok, h_par),
                         head_scores=h_score, candidates=tries[b])
            trees.append((fused, fused.tree.size - len(keep)))
        added = max(a for _, a in trees)
        if added <= 0:  # every candidate was already in the head's tree
            self.unmerged(rids, tries)
            return None
        width = self.width(ndt, added)
        tok_rows, par_rows, origin = [], [], []
        for fused, _ in trees:
            f_tok, f_par = torch.stack([fused.tree.tokens, fused.tree.parents]).tolist()
            pad = width - len(f_tok)  # padding: the root's token, no parent (unreachable)
            tok_rows.append(f_tok + [f_tok[0]] * pad)
            par_rows.append(f_par + [-1] * pad)
            origin.append(fused.origin + [0] * pad)
        parents = torch.tensor(par_rows, dtype=torch.long)
        host_lens = torch.tensor(list(seq_lens_host)) if seq_lens_host is not None else seq_lens.cpu()
        device = head_tokens.device
        layout = verify_layout(parents, host_lens, full_mask=full_mask).to(device)
        merged = MergedTrees(tokens=torch.tensor(tok_rows, dtype=torch.long, device=device), parents=parents.to(device),
                             origin=origin, layout=layout, width=width, rids=tuple(rids))
        self._last, self._last_tries, self._rids = merged, tries, tuple(rids)
        return merged

    def unmerged(self, rids: Sequence[Any], tries: list[list[CandidateTrie | None]]) -> None:
        """This step verifies the head's trees alone (``tries``: what the sources proposed, if
        anything; they still learn from the step at :meth:`observe`)."""
        self._last, self._last_tries, self._rids = None, tries, tuple(rids)

    def observe(self, accept_index: Sequence[Sequence[int]] | None, emitted: Sequence[Sequence[int]]) -> dict[str, int]:
        """The step of the last :meth:`merge` verified and emitted ``emitted[b]`` (accepted + bonus)
        for request ``b``; ``accept_index`` [bs, depth + 1]: the accepted nodes' rows
        (``b * width + node``, -1 padded), read only when the step was merged. The sources extend
        their sequences and learn from the target's tokens; returns the accepted drafted tokens per
        proposer of a merged step (a node two proposed counts for both; empty when not merged)."""
        merged, tries, rids = self._last, self._last_tries, self._rids
        out = {n: 0 for n in self.names} if merged is not None else {}
        rows = accept_index if merged is not None else None
        for b, toks in enumerate(emitted):
            if b >= len(rids):
                break
            toks = list(toks)
            if rows:
                for r in rows[b][1:]:
                    if r < 0:
                        break
                    bits = merged.origin[b][r - b * merged.width]
                    for k, name in enumerate(self.names):
                        if bits >> k & 1:
                            out[name] += 1
            state = self._requests.get(rids[b])
            if state is None:
                continue
            state.tokens.extend(toks)
            for s, t in zip(state.sources, tries[b] if b < len(tries) else [None] * len(state.sources)):
                s.extend(toks)
                if t:
                    s.observe(t, toks)
        return out


def _reachable(parents: list[int]) -> list[bool]:
    out = [True] + [False] * (len(parents) - 1)
    for i in range(1, len(parents)):
        p = parents[i]
        out[i] = 0 <= p < i and out[p]
    return out


class _HeadTree:
    """The fields of a :class:`~adaptivespec.types.DraftTree` that :func:`fuse` reads."""

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        self.tokens, self.parents = torch.tensor(tokens), torch.tensor(parents)
        self.size = len(tokens)
