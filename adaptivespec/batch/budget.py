"""One row budget per step: the measured cost of rows, and the goodput rule that spends them.

:class:`CostTable` is what a step costs on the machine it runs on, measured (never shipped: a
table fitted on another CPU prices rows wrongly): the packed target forward by rows at two context
lengths plus a per-request term, and one draft-head level by rows. It is measured by
``adaptivespec calibrate --batch`` or at the engine's start-up, and cached per CPU model, target,
dtype and thread count (:func:`cost_path`).

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
draft at all (:meth:`RowBudget.speculate`): a speculative step's predicted rate
``N * tau / (T(N + N * b) + overhead_spec)`` against a plain one's ``N / (T(N) + overhead_plain)``,
with ``tau`` (tokens per request per speculative step), ``b`` (draft rows per request) and the
overheads (each mode's measured step time beyond the table's forward) kept as running means of
what the steps measured. A plain step is plain batched decoding (no draft, no candidates; the head
still follows every token, so a later speculative step starts fresh); after
:data:`EXPLORE_EVERY` plain steps one speculates to keep ``tau`` current (less often while such
steps keep confirming the plain choice).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Sequence

import attrs
import numpy as np
import torch

from adaptivespec.fastpath.batched import DraftKV, DraftPart, KVSlab, Part, bound, layer_pieces, packed_draft_step, packed_forward
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.models import cache_dir
from adaptivespec.types import DraftTree

ROWS = (1, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Row counts the verify cost is measured at (linear in between, the last slope beyond)."""
DRAFT_ROWS = (1, 8, 32, 64, 128)
CONTEXTS = (128, 1024)
"""Cached keys per request the verify cost is measured at (linear in between and beyond)."""
VERSION = 2
"""Tables of an older version are measured again (2: attention by SGLang's kernels where installed;
the fastest of repeats, monotone)."""
EXPLORE_EVERY = 8
"""Plain steps in a row after which one step speculates anyway (what the head accepts changes with
the text); doubled, up to :data:`EXPLORE_MAX`, each time such a step confirms that plain steps pay more."""
EXPLORE_MAX = 128


@attrs.frozen(kw_only=True)
class CostTable:
    """Measured step costs (milliseconds) on one machine, for one target and dtype."""

    rows: tuple[int, ...]
    verify_short: tuple[float, ...]
    """Packed target forward of ``rows[i]`` rows, one request with ``contexts[0]`` cached keys."""
    verify_long: tuple[float, ...]
    """The same with ``contexts[1]`` cached keys."""
    contexts: tuple[int, int]
    per_request: float
    """Added per request beyond the first (its attention calls, its cache writes)."""
    draft_rows: tuple[int, ...]
    draft: tuple[float, ...]
    """One draft-head level (step + log-probs) of ``draft_rows[i]`` rows (empty: no head)."""
    machine: dict = attrs.field(factory=dict)
    """What the table was measured on: cpu, target, dtype, threads, torch."""

    def verify(self, rows, context: float = 0.0, requests: int = 1):
        """Cost of a packed forward of ``rows`` (an int or an array) rows over ``requests`` requests
        whose mean context is ``context`` keys."""
        short = _interp(rows, self.rows, self.verify_short)
        long = _interp(rows, self.rows, self.verify_long)
        c0, c1 = self.contexts
        w = (context - c0) / (c1 - c0)
        return short + w * (long - short) + self.per_request * max(requests - 1, 0)

    def draft_level(self, rows: int) -> float:
        return float(_interp(rows, self.draft_rows, self.draft)) if self.draft_rows else 0.0

    def to_dict(self) -> dict:
        return {"version": VERSION, **attrs.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        d = {k: v for k, v in d.items() if k != "version"}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def summary(self) -> str:
        one = self.verify(1, self.contexts[0])
        return (f"verify {one:.1f} ms at 1 row, {self.verify(64, self.contexts[0]):.1f} at 64, "
                f"{self.verify(256, self.contexts[0]):.1f} at 256 (+{self.per_request:.2f} per request); "
                f"draft level {self.draft_level(8):.1f} ms at 8 rows")


def _interp(x, xs: Sequence[int], ys: Sequence[float]):
    """Piecewise-linear in ``xs``, extended by the last segment's slope."""
    x = np.asarray(x, dtype=np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y if y.ndim else float(y)


# -- measuring --------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(target_name: str, dtype: str) -> dict:
    return {"cpu": cpu_name(), "target": target_name, "dtype": dtype, "threads": torch.get_num_threads(),
            "torch": torch.__version__.split("+")[0]}


def cost_path(key: dict) -> Path:
    """Where the table for ``key`` is cached: ``<cache>/costs/<cpu>-<target>-<dtype>-t<threads>.json``."""
    slug = "-".join(re.sub(r"[^A-Za-z0-9]+", "_", str(key[k])).strip("_") for k in ("cpu", "target", "dtype"))
    return cache_dir() / "costs" / f"{slug}-t{key['threads']}.json"


def _best_ms(fn, reps: int) -> float:
    """The fastest of ``reps`` timed runs after a warm one: another process sharing the cores only
    ever adds time, so the minimum is the least disturbed estimate (a median of 3 was not: one
    table measured beside a test run priced 32 rows above 48)."""
    fn()  # warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def _monotone(short: list[float], long: list[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """More rows never cost less, nor do more cached keys: running maxima over rows, and the long
    context's row at least the short one's."""
    short_m = np.maximum.accumulate(np.asarray(short))
    long_m = np.maximum.accumulate(np.maximum(np.asarray(long), short_m))
    return tuple(map(float, short_m)), tuple(map(float, long_m))


@torch.inference_mode()
def measure(target, drafter, dtype: torch.dtype, device, *, reps: int = 5, progress=None) -> CostTable:
    """Measure a :class:`CostTable` for ``target`` (and ``drafter``, or None) here and now: packed
    forwards over scratch caches filled with zeros (the cost does not depend on the values)."""
    pieces = layer_pieces(target)
    cfg = target.config
    top = max(ROWS)
    slab = KVSlab(cfg, 8, max(CONTEXTS) + top + 8, dtype, device)  # as the batch engine holds its caches
    caches = [buffered_cache(cfg, slab.capacity) for _ in range(8)]
    for i, cache in enumerate(caches):
        slab.bind(i, cache)

    def fill(cache, n: int) -> None:  # n cached keys of zeros
        for layer in cache.layers:
            layer.length = n
            layer._view()

    def run(rows_per_part: list[int], context: int) -> None:
        for c in caches[: len(rows_per_part)]:
            fill(c, context)
        R = sum(rows_per_part)
        ids = torch.zeros(R, dtype=torch.long, device=device)
        pos = torch.full((R,), context, dtype=torch.long, device=device)
        parts = [Part(cache=c, rows=r, mask=None, slot=i) for i, (c, r) in enumerate(zip(caches, rows_per_part))]
        packed_forward(pieces, ids, pos, parts, torch.arange(R, device=device), hidden=drafter is not None, slab=slab)

    todo = len(ROWS) * len(CONTEXTS) + 2 + (len(DRAFT_ROWS) if drafter is not None else 0)
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, todo)

    table: dict[int, list[float]] = {}
    for context in CONTEXTS:
        table[context] = []
        for r in ROWS:
            table[context].append(_best_ms(lambda: run([r], context), reps))
            tick()
    one = _best_ms(lambda: run([64], CONTEXTS[0]), reps)
    tick()
    eight = _best_ms(lambda: run([8] * 8, CONTEXTS[0]), reps)
    tick()
    draft_ms: list[float] = []
    if drafter is not None:
        H = drafter.config.hidden_size
        for r in DRAFT_ROWS:
            kv = DraftKV()
            with bound(drafter, kv) as d:
                d.reset_cache(capacity=CONTEXTS[0] + r + 8)

            def level(r=r, kv=kv):
                kv.length = CONTEXTS[0]
                tokens = torch.zeros(r, dtype=torch.long, device=device)
                states = torch.zeros(r, H, dtype=dtype, device=device)
                pos = torch.full((r,), CONTEXTS[0], dtype=torch.long, device=device)
                out = packed_draft_step(drafter, tokens, states, pos, [DraftPart(kv=kv, rows=r, mask=None)])
                drafter.log_probs(out)

            draft_ms.append(_best_ms(level, reps))
            tick()
    short, long = _monotone(table[CONTEXTS[0]], table[CONTEXTS[1]])
    return CostTable(rows=ROWS, verify_short=short, verify_long=long,
                     contexts=CONTEXTS, per_request=max(0.0, (eight - one) / 7),
                     draft_rows=DRAFT_ROWS if drafter is not None else (),
                     draft=tuple(map(float, np.maximum.accumulate(draft_ms))) if draft_ms else ())


def load_or_measure(target, drafter, target_name: str, dtype_name: str, dtype, device, *, log=print,
                    remeasure: bool = False) -> CostTable:
    """The cached table for this machine, target and dtype, or a fresh one (measured, then cached).
    ``$ADAPTIVESPEC_BATCH_COSTS``: a table file to use instead (as written by ``calibrate --batch``)."""
    forced = os.environ.get("ADAPTIVESPEC_BATCH_COSTS")
    key = machine_key(target_name, dtype_name)
    if forced:
        return CostTable.from_dict(json.loads(Path(forced).read_text()))
    path = cost_path(key)
    if path.is_file() and not remeasure:
        try:
            raw = json.loads(path.read_text())
            table = CostTable.from_dict(raw)
            if raw.get("version") == VERSION and table.machine == key and (drafter is None or table.draft_rows):
                return table
        except (ValueError, TypeError, KeyError):
            pass  # an older or damaged file: measure again
    t0 = time.perf_counter()
    table = attrs.evolve(measure(target, drafter, dtype, device), machine=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_dict(), indent=1))
    log(f"batch costs measured in {time.perf_counter() - t0:.1f} s ({table.summary()}); cached in {path}")
    return table


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

    # -- draft or not ---------------------------------------------------------------------------------
    def predicted_rates(self, decoders: int, base_rows: int, context: float, requests: int) -> tuple[float, float]:
        """(speculative, plain) tokens per ms predicted for a step of ``decoders`` decoding requests
        and ``base_rows`` rows (roots and prompt chunks)."""
        c = self.costs
        spec_ms = c.verify(base_rows + decoders * self.rows_per_request, context, requests) + self.overhead[True]
        plain_ms = c.verify(base_rows, context, requests) + self.overhead[False]
        return decoders * self.tau / max(spec_ms, 1e-3), decoders / max(plain_ms, 1e-3)

    def speculate(self, decoders: int, base_rows: int, context: float, requests: int) -> bool:
        """Whether the coming step drafts (see the module's text); remembered for :meth:`step_done`."""
        spec, plain = self.predicted_rates(decoders, base_rows, context, requests)
        self.exploring = spec <= plain and self.plain_run >= self.explore_every
        self.mode = spec > plain or self.exploring
        self.plain_run = 0 if self.mode else self.plain_run + 1
        return self.mode

    def step_done(self, *, seconds_ms: float, rows: int, context: float, requests: int, decoders: int,
                  tokens: int, draft_rows: int, prompt_rows: int = 0, smoothing: float = 0.2) -> None:
        """What the step just run measured: its wall time, rows, tokens emitted by its decoders.
        A step that also read ``prompt_rows`` rows of prompts does not move the overheads (its
        chunks attend over their own long pasts, which the table does not price: on a 2-vCPU EPYC
        such steps had pushed the plain mode's overhead to 48 ms and made plain look dear)."""
        if not decoders:
            return
        if not prompt_rows:
            table = float(self.costs.verify(rows, context, requests))
            # one step's excess is capped at the forward's price beyond the running mean: a stray pause
            # (another process, a page fault) moves the mean, it does not take it over
            over = min(seconds_ms - table, self.overhead[self.mode] + table)
            self.overhead[self.mode] += smoothing * (over - self.overhead[self.mode])
        if self.mode:
            self.tau += smoothing * (tokens / decoders - self.tau)
            self.rows_per_request += smoothing * (draft_rows / decoders - self.rows_per_request)
        if self.exploring:  # did the speculative step pay? then look again soon, else later
            spec, plain = self.predicted_rates(decoders, rows - draft_rows, context, requests)
            self.explore_every = EXPLORE_EVERY if spec > plain else min(2 * self.explore_every, EXPLORE_MAX)

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
        cost = self.costs.verify(base_rows + np.arange(room + 1), context, requests) + draft_ms
        rate = gain / cost
        B = int(np.argmax(rate))  # the first maximum: fewer rows on a tie
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
