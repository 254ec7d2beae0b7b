"""One row budget per step: the measured cost of rows, and the goodput rule that spends them.

:class:`CostTable` is what a step costs on the machine it runs on, measured (never shipped: a
table fitted on another CPU prices rows wrongly); it lives in :mod:`adaptivespec.fastpath.costs`
(the single-request policies price their steps with it too) and is re-exported here with
:func:`load_or_measure`, :func:`measure`, :func:`cost_path` and :func:`machine_key`.

:class:`RowBudget` pools every decoding request's candidate nodes, each with its calibrated
path-acceptance ``S`` (the probability that the target accepts the whole path to it: the tree's
own estimate ``exp(draft_logp)``, recalibrated online from what was accepted), ranks them in one
list and verifies the prefix that maximises expected tokens per millisecond of the whole step
(DSpark's / SmartSpec's goodput rule)::

    B* = argmax_B  (N + S_1 + ... + S_B) / (T(R0 + B) + D)

``N`` decoding requests each emit at least their bonus token; ``R0`` rows are spent anyway
(every request's root row, the prompt chunks); ``T`` is the table's verify cost and ``D`` the
step's draft cost. A node's ``S`` is capped by its parent's, so every prefix of the ranking is
closed under ancestors and each request's verified tree falls out of the one ranking.

Drafting is spent before the ranking, so the budget also decides, before each step, whether to
draft at all (:meth:`RowBudget.speculate`): what speculating adds to the step,
``N * (tau - 1)`` tokens for ``T(R0 + N * b) + overhead_spec - T(R0) - overhead_plain`` ms, against
what those milliseconds buy in plain steps, ``N / (T(N) + overhead_plain)`` (without prompt rows,
``R0 = N``: a speculative step's rate against a plain one's),
with ``tau`` (tokens per request per speculative step), ``b`` (draft rows per request) and the
overheads (each mode's measured step time beyond the table's forward) kept as running means of
what the steps measured. A plain step is plain batched decoding (no draft, no candidates; the head
still follows every token, so a later speculative step starts fresh); after
:data:`EXPLORE_EVERY` plain steps one speculates to keep ``tau`` current (less often while such
steps keep confirming the plain choice), drafting for one request in :data:`EXPLORE_GROUP`.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import torch

from adaptivespec.fastpath.costs import (  # noqa: F401 - re-exported: the table and its measuring live below the batch layer
    CONTEXTS, DRAFT_ROWS, ROWS, VERSION, CostTable, cost_path, cpu_name, load_or_measure, machine_key, measure,
)
from adaptivespec.fastpath.batched import padded_rows
from adaptivespec.fusion import HEAD
from adaptivespec.tree import subtree
from adaptivespec.types import DraftTree

EXPLORE_EVERY = 8
"""Plain steps in a row after which one step speculates anyway (what the head accepts changes with
the text); doubled, up to :data:`EXPLORE_MAX`, each time such a step confirms that plain steps pay more."""
EXPLORE_MAX = 128
EXPLORE_GROUP = 8
"""An exploring step drafts for one request in this many decoders (at least one): it measures what
the head accepts, which a few requests' trees tell as well as all of them, at a fraction of the cost."""


# -- the budget -------------------------------------------------------------------------------------
class Calibration:
    """Online calibration of a tree's acceptance estimates: for nodes whose estimate fell in bin
    ``b`` (of ``bins`` equal bins of [0, 1]), the share the target accepted, shrunk towards the
    estimate itself by a prior of ``prior`` observations. One table for the head's nodes and one
    for nodes only a candidate source proposed."""

    def __init__(self, bins: int = 10, prior: float = 16.0) -> None:
        self.bins, self.prior = bins, prior
        self.seen = torch.zeros(2, bins, dtype=torch.float64)  # [kind, bin]
        self.accepted = torch.zeros(2, bins, dtype=torch.float64)

    def _bin(self, p: torch.Tensor) -> torch.Tensor:
        return (p.double() * self.bins).long().clamp_(0, self.bins - 1)

    def __call__(self, p: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance of estimates ``p`` [n] (``kind`` [n]: 0 head, 1 source only)."""
        b = self._bin(p)
        n, a = self.seen[kind, b], self.accepted[kind, b]
        return ((a + self.prior * p.double()) / (n + self.prior)).float()

    def observe(self, p: torch.Tensor, kind: torch.Tensor, accepted: torch.Tensor) -> None:
        """Verified nodes' estimates, kinds, and whether each was accepted (bool [n])."""
        idx = kind * self.bins + self._bin(p)
        self.seen.view(-1).index_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
        self.accepted.view(-1).index_add_(0, idx, accepted.double())


PREFILL_STEP = 8
PREFILL_ROWS_UNMEASURED = 128


def prompt_chunk_rows(costs: CostTable | None, max_rows: int, stall: float, base_rows: int, past: int = 0,
                      prompts: int = 1) -> int:
    """Prompt rows for a step that runs ``base_rows`` rows without them (``batch.prefill_rows: 0``),
    the first prompt's first ``past`` tokens already read, ``prompts`` requests reading their
    prompts: the most, in multiples of 8 (at least 8), that keep the step within
    ``1 + (stall - 1) * prompts`` times its cost by the cost table (the chunk's rows
    priced at their context); 128 without a table.

    One prompt arriving while the others decode stalls them by at most ``stall`` (``batch.prefill_stall``); every
    further request still reading its prompt may stall the step by as much again (it is a user
    too, producing nothing until its prompt is read: on a 2-vCPU EPYC with 8 users a fixed
    1.8x left half the lanes reading prompts 8 rows a step and cost 30% of the throughput)."""
    if costs is None:
        return PREFILL_ROWS_UNMEASURED
    limit = (1 + (stall - 1) * max(prompts, 1)) * float(costs.verify(base_rows))
    # every candidate at once (one step's 64 table look-ups had been 1.3% of a served step at 16
    # users); the chunk's rows attend over `past` keys, the roots over few
    rows = np.arange(2 * PREFILL_STEP, max_rows + 1, PREFILL_STEP)
    fits = costs.verify(base_rows + rows, past * rows / (base_rows + rows)) <= limit
    more = len(rows) if fits.all() else int(np.argmin(fits))  # candidates that fit before the first that does not
    return PREFILL_STEP * (1 + more)


@attrs.frozen(kw_only=True)
class Choice:
    """What the budget chose for one step."""

    keep: list[torch.Tensor]
    """Per request: the node indices of its tree to verify (sorted, the root first)."""
    rows: int
    """Verify rows chosen beyond the roots (B*)."""
    expected_tokens: float
    step_ms: float
    """The table's price of the chosen step."""


class RowBudget:
    """The goodput rule over one step's trees (see the module's text)."""

    def __init__(self, costs: CostTable, max_rows: int) -> None:
        self.costs, self.max_rows = costs, max_rows
        self.calibration = Calibration()
        self.tau = 2.0  # tokens per request per speculative step (running mean; optimistic start: try it)
        self.rows_per_request = 2.0  # draft rows per request the ranking chose (running mean)
        self.overhead = {True: 0.0, False: 0.0}  # ms beyond the table's forward, per mode (running means)
        self.plain_run = 0
        self.explore_every = EXPLORE_EVERY
        self.mode = True  # the mode of the step in flight
        self.exploring = False
        self._explore_next = 0  # the lane whose turn it is to draft in an exploring step

    # -- draft or not ---------------------------------------------------------------------------------
    def predicted_rates(self, decoders: int, base_rows: int, context: float, requests: int,
                        head_rows: int = 0) -> tuple[float, float]:
        """(speculative, plain) tokens per ms predicted for a step of ``decoders`` decoding requests
        and ``base_rows`` rows (their roots and any prompt chunks) among ``requests``; ``head_rows``:
        rows the draft head would have to run first if the step drafted (what plain steps left it
        behind on, prompt chunks), priced as one head pass over them.

        The speculative rate is the *marginal* one: the tokens speculating adds (``tau - 1`` per
        decoder) per millisecond it adds to this step; the plain rate is what those milliseconds buy
        in plain decoding steps of the same decoders (no prompt rows). Without prompt rows this is
        the comparison of the two steps' rates; with them, the prompt rows are paid in either mode
        and no longer make the draft rows look cheap (on a 2-vCPU EPYC at 16 users, the steps that
        read prompts drafted and spent 11-13 s of a 15 s run where plain decoding spent 6-8). The
        head's rows are a cost of drafting in this step: unpriced, at 16 users the steps right after
        prompts were read drafted, their heads first running 9 prompts' rows (106 ms of a 290 ms
        step); left to plain steps, they are run only if that request drafts again."""
        c, n = self.costs, decoders
        plain_ms = c.verify(padded_rows(base_rows), context, requests) + self.overhead[False]
        spec_ms = (c.verify(padded_rows(base_rows + n * self.rows_per_request), context, requests) + self.overhead[True]
                   + (c.draft_level(head_rows) if head_rows else 0.0))
        decode_ms = self._decode_ms(n, context) if base_rows > n else plain_ms
        return n * (self.tau - 1) / max(spec_ms - plain_ms, 1e-3), n / max(decode_ms, 1e-3)

    def _decode_ms(self, decoders: int, context: float) -> float:
        """A plain step of ``decoders`` decoding requests and nothing else: the table's forward and
        the plain mode's overhead (what a step's draft or prompt rows are weighed against)."""
        return float(self.costs.verify(padded_rows(decoders), context, decoders)) + self.overhead[False]

    def speculate(self, decoders: int, base_rows: int, context: float, requests: int, head_rows: int = 0) -> bool:
        """Whether the coming step drafts (see the module's text); remembered for :meth:`step_done`."""
        spec, plain = self.predicted_rates(decoders, base_rows, context, requests, head_rows)
        # exploring waits for a step without prompt chunks: one with them measures little of the mode
        # (its overheads are not learned) and is the dearest step to draft in
        self.exploring = spec <= plain and self.plain_run >= self.explore_every and requests == decoders
        self.mode = spec > plain or self.exploring
        self.plain_run = 0 if self.mode else self.plain_run + 1
        return self.mode

    def joined(self, running: int = 1) -> None:
        """A request joined, ``running`` now decoding or reading prompts: what the head accepts may change
        with its text, so the next exploring step comes after at most ``EXPLORE_EVERY * running`` plain
        steps (the newcomer is one of ``running`` requests a step speculates for). On a 2-vCPU EPYC at
        one request, a backoff grown to 128 on a prompt the head drafted badly kept the next prompt,
        where it drafts well, in plain steps throughout; at 8 users, starting over at 8 on every join
        made 25 of a run's 36 speculative steps explorations (each dearer than plain steps there)."""
        self.explore_every = min(self.explore_every, EXPLORE_EVERY * max(running, 1))

    def step_done(self, *, seconds_ms: float, rows: int, context: float, requests: int, decoders: int,
                  tokens: int, draft_rows: int, prompt_rows: int = 0, drafting: int | None = None,
                  drafted_tokens: int | None = None, switch_ms: float = 0.0, smoothing: float = 0.2) -> None:
        """What the step just run measured: its wall time, rows, tokens emitted by its decoders.
        A step that also read ``prompt_rows`` rows of prompts does not move the overheads (its
        chunks attend over their own long pasts, which the table does not price: on a 2-vCPU EPYC
        such steps had pushed the plain mode's overhead to 48 ms and made plain look dear).
        ``drafting`` of the decoders drafted (default: all), emitting ``drafted_tokens``: an exploring
        step that drafted for some of them teaches ``tau`` and the rows per request from those, and
        not the overhead (its drafting cost is a part of a whole speculative step's). ``switch_ms``
        of the step went into bringing heads up to date on rows plain steps left them: a cost of
        switching modes, paid once, not of the speculative mode, so not learned as its overhead (at
        one request on a 2-vCPU EPYC it had been: each exploring step after a plain run taught the
        mode a dearer step, and the budget stayed in plain steps where speculating paid 4%)."""
        if not decoders:
            return
        drafting = decoders if drafting is None else drafting
        drafted_tokens = tokens if drafted_tokens is None else drafted_tokens
        if not prompt_rows and drafting in (0, decoders):
            table = float(self.costs.verify(padded_rows(rows), context, requests))
            # one step's excess is capped at the forward's price beyond the running mean: a stray pause
            # (another process, a page fault) moves the mean, it does not take it over
            over = min(seconds_ms - switch_ms - table, self.overhead[self.mode] + table)
            self.overhead[self.mode] += smoothing * (over - self.overhead[self.mode])
        if self.mode and drafting:
            self.tau += smoothing * (drafted_tokens / drafting - self.tau)
            self.rows_per_request += smoothing * (draft_rows / drafting - self.rows_per_request)
        if self.exploring:  # did the speculative step pay? then look again soon, else later
            spec, plain = self.predicted_rates(decoders, rows - draft_rows, context, requests)
            self.explore_every = EXPLORE_EVERY if spec > plain else min(2 * self.explore_every, EXPLORE_MAX)

    # -- one step's trees -------------------------------------------------------------------------------
    def cut(self, items, base_rows: int, chunks: int, context: float, draft_ms: float) -> Choice | None:
        """Every drafted item's tree cut to what the goodput rule keeps (one ranking of all their
        nodes, ``base_rows`` spent anyway, ``chunks`` prompts read beside them); the lanes learn the
        rows and depth they got. None when nothing was drafted."""
        drafted = [it for it in items if it.proposal is not None]  # all, none (a plain step) or the explorers
        if not drafted:
            return None
        scores, depths = [], []
        for it in drafted:
            fused = it.proposal.fused
            source_only = None
            if fused is not None:
                source_only = torch.tensor([o != 0 and not (o & HEAD) for o in fused.origin], dtype=torch.bool)
            it.estimates = self.estimates(it.tree, source_only)
            scores.append(it.estimates[2])
            depths.append(it.tree.depth)
        choice = self.choose(scores, depths, base_rows=base_rows, decoders=len(items), requests=len(items) + chunks,
                             context=context, draft_ms=draft_ms)
        for it, keep in zip(drafted, choice.keep):
            lane = it.request.lane
            lane.rows = keep.shape[0] - 1
            lane.depth_cap = int(it.tree.depth[keep].max()) + 1
            if keep.shape[0] < it.tree.size:
                it.keep, it.tree = keep, subtree(it.tree, keep)
        return choice

    def learn(self, item, result) -> None:
        """What the target accepted of a drafted ``item``'s verified tree recalibrates the estimates."""
        if item.estimates is not None:
            keep = item.keep if item.keep is not None else torch.arange(item.tree.size)
            self.observe(item.estimates[0], item.estimates[1], keep, result.path)

    def explorers(self, items: list, lanes: int) -> list:
        """The requests an exploring step drafts for: one per :data:`EXPLORE_GROUP` decoders, taking
        turns by lane (so what the head accepts is sampled over all the texts in flight). Exploring
        measures what the head accepts now; drafting for everyone made it dear under load (16 users
        on a 2-vCPU EPYC: ~180 ms, 70-90 of them the heads catching up, against a 23 ms plain step)."""
        k = -(-len(items) // EXPLORE_GROUP)
        if k >= len(items):
            return items
        turn = sorted(items, key=lambda it: (it.request.lane.index - self._explore_next) % lanes)[:k]
        self._explore_next = turn[-1].request.lane.index + 1
        return turn

    def estimates(self, tree: DraftTree, source_only: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw estimate p [n], kind [n], calibrated and ancestor-capped S [n]) of ``tree``'s nodes
        (root: 1). ``source_only`` [n] bool: nodes no head proposed (None: all the head's)."""
        p = tree.draft_logp.float().exp().clamp(max=1.0)
        kind = source_only.long() if source_only is not None else torch.zeros_like(tree.tokens)
        s = self.calibration(p, kind)
        s[0] = 1.0
        capped = torch.where(tree.ancestors, s.unsqueeze(0), torch.ones_like(s).unsqueeze(0)).amin(-1)
        return p, kind, capped

    def choose(self, scores: Sequence[torch.Tensor], depths: Sequence[torch.Tensor], *, base_rows: int,
               decoders: int, requests: int, context: float, draft_ms: float) -> Choice:
        """``scores[j]`` / ``depths[j]``: request ``j``'s capped ``S`` and node depths (root first);
        ``base_rows``: rows the step runs anyway (roots, prompt chunks); ``decoders``: requests
        verifying; ``requests``: requests in the forward; ``context``: their mean cached keys;
        ``draft_ms``: what drafting cost this step."""
        owner = torch.cat([torch.full((s.shape[0] - 1,), j, dtype=torch.long) for j, s in enumerate(scores)])
        node = torch.cat([torch.arange(1, s.shape[0]) for s in scores])
        S = torch.cat([s[1:] for s in scores])
        depth = torch.cat([d[1:] for d in depths])
        room = max(0, min(S.shape[0], self.max_rows - base_rows))
        # one ranking: S descending, a parent before its child at equal S (shallower first)
        by_depth = torch.sort(depth, stable=True).indices
        order = by_depth[torch.sort(S[by_depth], descending=True, stable=True).indices][:room]
        gain = decoders + np.concatenate([[0.0], np.cumsum(S[order].double().numpy())])
        # priced at the rows the forward runs: padded to its bucket, so the rows up to the bucket's end
        # cost nothing more and the ranking fills them (priced linearly, the budget cut a tree of 16
        # rows to 9 that ran as 16: one request on a 2-vCPU EPYC took 57 steps for 128 tokens, not 48)
        cost = self.costs.verify(padded_rows(base_rows + np.arange(room + 1)), context, requests) + draft_ms
        if base_rows > decoders:
            # prompt rows in the step: a node is worth its row when it brings more than the row's time
            # buys in plain steps of these decoders (the step's own rate, its prompt rows in it, made
            # every row look cheap: at 16 users on a 2-vCPU EPYC such steps verified nodes of S 0.05)
            plain_rate = decoders / self._decode_ms(decoders, context)
            B = int(np.argmax(gain - plain_rate * (cost - cost[0])))  # the first maximum: fewer rows on a tie
        else:
            B = int(np.argmax(gain / cost))  # the first maximum: fewer rows on a tie
        chosen = order[:B]
        keep = []
        for j, s in enumerate(scores):
            mine = node[chosen[owner[chosen] == j]]
            keep.append(torch.cat([torch.zeros(1, dtype=torch.long), torch.sort(mine).values]))
        return Choice(keep=keep, rows=B, expected_tokens=float(gain[B]), step_ms=float(cost[B]))

    def observe(self, p: torch.Tensor, kind: torch.Tensor, keep: torch.Tensor, path: Sequence[int]) -> None:
        """A request verified nodes ``keep`` of its tree (estimates ``p``, kinds ``kind`` over the
        whole tree) and accepted ``path`` (indices into the verified tree, root first)."""
        if keep.shape[0] <= 1:
            return
        accepted = torch.zeros(keep.shape[0], dtype=torch.bool)
        accepted[list(path)] = True
        self.calibration.observe(p[keep[1:]], kind[keep[1:]], accepted[1:])
