"""Policy ``cost_aware``: sizes the draft tree while drafting, from calibrated path values and a
measured step-cost model.

Every drafted candidate gets a *value*: the calibrated probability that strict verification accepts
it, read from a :class:`~adaptivespec.costmodel.CalibrationMap` at its depth and cumulative draft
log-probability (the score EAGLE-2 ranks by). Since a step emits ``1 + sum(values of the verified
nodes)`` tokens in expectation, values add up to expected tokens, and the cost model
(:class:`~adaptivespec.costmodel.CostModel`, a profile measured by ``adaptivespec calibrate``, or
this machine's measured cost table: ``costs``) turns every decision into tokens per millisecond:

* **level rule** (``select_level``, after each level is scored): with ``R`` the best expected
  tokens/ms of a tree cut here (:func:`~adaptivespec.costmodel.rank_by_value` over the pool so
  far), ``b`` the beam width, ``v_i`` the beam's values and ``cont[d]`` the observed probability
  that an accepted node at depth ``d - 1`` with verified children has one accepted (online, same
  stream as the map), the next level is drafted when, looking ``L = min(lookahead, levels left)``
  levels ahead, some depth ``j <= L`` gives positive net tokens::

      max_j  sum_{l<=j} [ sum_i max(0, v_i * cont[d+1] * ... * cont[d+l] - R * per_verified_token)
                          - R * (per_draft_level + b * per_draft_node) ]  >  0

  (each beam path continued one node per level, verified only where it pays for its token);
  ``explore`` > 0 prices every ``cont`` at an upper confidence bound instead, so that a depth the
  rule stopped drafting on old evidence is tried again as that evidence decays;
  ``lookahead: 0`` is the myopic rule, the next level alone with every beam child verified::

      sum(v_i) * cont[d + 1]  >  R * (per_draft_level + b * (per_draft_node + per_verified_token))
* **budget rule** (``select_final``): the prefix of the value ranking that maximises expected
  tokens/ms, i.e. a node is verified while its value exceeds the marginal cost of one more
  verified token (``per_verified_token`` x the rate reached), the root's ``min_keep`` best
  children always first; at most the largest ndt bucket. The verified tree is tagged with the
  smallest bucket shape that holds it (``verify_shape``), so the shape bank holds one executor per
  bucket (graph-capturable; the CUDA-graph runtime pads to the bucket, ``fill_buckets`` fills the
  padding with the next-best nodes instead);
* **learning** (``observe_tree``, after each verify): the map and ``cont`` are updated from which
  verified nodes were on the accepted path (vectorised);
* **plain steps** (``min_keep: 0``): where no candidate pays for what verifying it adds (the cost
  model's ``tree_step``: on llama.cpp two rows cost nearly twice one; and the learned extra time of
  a drafted step over its price), the root is verified alone; on a runtime that keeps its head's
  rows for later (llamacpp) the next 1, 2, 4, ... ``plain_streak`` steps are then plain decoding
  steps with the head idle (:meth:`CostAwarePolicy.plain_next`), a drafted tree ending the streak;
* **circuit breaker** (as in ``dcs``): ``breaker_steps`` consecutive zero-accept steps force the
  next step to draft the full tree (``max_depth`` levels, the largest bucket verified), a probe
  that keeps the map fed where it has been too pessimistic (with sources, its fused tree takes
  the whole budget);
* **fusion with candidate sources** (``fusion_scores`` / ``fusion_size``, called by
  :func:`~adaptivespec.fusion.fuse` when a config has ``sources:``): the head's nodes are scored
  with their calibrated values, on the scale of the sources' scores (estimated acceptance), and
  the fused ranking is cut by the budget rule above (at most the drafting shape's ndt plus the
  sources' extra slots); a fused tree of at most the largest bucket takes its bucket's shape. The
  map and ``cont`` learn from the fused tree's head nodes only.

Values are monotone (a child never above its parent, ties broken by pool order, which puts parents
first), so every kept set is closed under ancestors. Host syncs per step: one per level and one
for the budget (and one for the head's values when fusing).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

import adaptivespec
from adaptivespec.api import (
    DraftTree, StepRecord, StepSignals, TreePolicy, TreeShape, VerifyResult, as_tuple, int_at_least, number_in, one_of,
)
from adaptivespec.costmodel import (
    COST_SOURCES,
    DEFAULT_COST_PROFILE,
    DEFAULT_PRIOR,
    MEASURED_SOURCE,
    CalibrationMap,
    CostModel,
    ProfileOrigin,
    measured_costs,
    rank_by_value,
    resolve_profile,
)


LOOKAHEAD = 2
"""Default ``lookahead`` of the level rule (levels)."""
OVERHEAD_RATE = 0.1
"""Weight of the newest drafted step in the learned overhead of a tree over a plain step (EMA)."""


def _buckets(inst, attribute, value) -> None:
    ok = isinstance(value, tuple) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in value)
    if not ok:
        raise ValueError(f"expected a non-empty list of integers >= 2 (ndt, the root included), got {value!r}")


def _file(default: str):
    def check(inst, attribute, value) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"expected a file name or null, got {value!r}")
        resolve_profile(value, default, "")

    return check


@attrs.frozen(kw_only=True)
class CostAwareParams:
    max_depth: int = attrs.field(default=6, validator=int_at_least(1))
    """Most draft levels per step (the tree stops earlier when a level does not pay)."""
    topk: int = attrs.field(default=4, validator=int_at_least(1))
    """Children proposed per expanded node, and the beam width of every level (EAGLE's topk)."""
    buckets: tuple[int, ...] = attrs.field(default=(4, 6, 8, 12), converter=as_tuple, validator=_buckets)
    """ndt buckets (tokens verified, root included): one bank shape each; the largest bounds the budget."""
    min_keep: int = attrs.field(default=1, validator=int_at_least(0))
    """The root's best children verified whatever their value. 0: a step verifies the root alone (a
    plain step, one row) where no drafted node pays for what verifying it adds; with a cost table
    whose ``tree_step`` is large (llama.cpp on a CPU: two rows cost nearly twice one) that is often."""
    fill_buckets: bool = False
    """Verify the next-best nodes up to the bucket's ndt (free where the runtime pads to the bucket,
    as the CUDA-graph runtime does; on the eager runtime every verified token costs)."""
    profile: str | None = attrs.field(default=None, validator=_file(DEFAULT_COST_PROFILE))
    """Cost profile (``adaptivespec calibrate``); null: the shipped CPU profile of the embedded model."""
    costs: str = attrs.field(default="auto", validator=one_of(*COST_SOURCES))
    """What steps are priced with: ``profile`` (the file), ``measured`` (this machine's cost table,
    as the batch engine measures it: ~30 s once, cached; the file where the runtime measures none)
    or ``auto`` (measured where the profile was fitted on another CPU, else the file)."""
    prior: str | None = attrs.field(default=None, validator=_file(DEFAULT_PRIOR))
    """Calibration prior (``adaptivespec calibrate --prior-out``); null: the shipped one."""
    prior_weight: float = attrs.field(default=8.0, validator=number_in(0, None, lo_open=True))
    """Pseudo-observations of the prior in every (depth, log-prob) cell."""
    decay: float = attrs.field(default=0.998, validator=number_in(0, 1, lo_open=True))
    """Per-step decay of the online counts (older verify results weigh less)."""
    breaker_steps: int = attrs.field(default=5, validator=int_at_least(1))
    """Consecutive zero-accept steps that trip the circuit breaker."""
    trace_every: int = attrs.field(default=16, validator=int_at_least(1))
    """Steps between two reliability tables in the step trace (and at the first step)."""
    lookahead: int = attrs.field(default=LOOKAHEAD, validator=int_at_least(0))
    """Levels the level rule looks ahead (bounded by the levels left to ``max_depth``): 0 is the
    myopic rule (the next level priced with all its beam children verified); L >= 1 weighs the
    next L levels, each beam node's path continued at the learned continuation rates and only the
    nodes that pay for their verified token counted."""

    explore: float = attrs.field(default=0.0, validator=number_in(0, None))
    """Optimism of the level rule about going deeper: with ``explore`` > 0 it prices the next levels
    with an upper confidence bound on the continuation rates, ``p + explore * sqrt(p (1 - p) / n)``
    (``n`` the decayed count behind ``p``), not with ``p`` itself. A depth the rule stopped drafting
    gets no new evidence, so its count decays and the bound widens until the level is tried again;
    0 (the default) prices with ``p`` alone, where a rate pulled down by one kind of prompt can stay
    down (docs/tuning.md, "Known problem"). 1.0 tied 0 on held-out training prompts (docs/tuning.md), so it is off."""

    cont_prior: float = attrs.field(default=0.0, validator=number_in(0, None))
    """Pseudo-observations of a continuation rate of 1/2 that do not decay, added at every depth to
    the decayed counts (as ``prior_weight`` does for the calibration map). A depth the level rule
    stopped drafting then drifts back toward 1/2 as its old evidence decays, instead of keeping the
    ratio it had (docs/tuning.md, "Known problem"); 0 (the default): the initial 2-of-4 decays with the rest.
    4 and 16 tied 0 on held-out training prompts, in an order that forms the trap too (docs/tuning.md), so it is off."""

    plain_streak: int = attrs.field(default=32, validator=int_at_least(0))
    """With ``min_keep: 0``, on a runtime that keeps its head's rows for later (llamacpp): after a
    step that verified the root alone, the next steps are plain ones (nothing drafted, the head not
    run: exactly plain decoding's cost), 1 the first time, then 2, 4, ... up to ``plain_streak`` while
    the policy keeps choosing the root alone; a drafted tree ends it. 0: every step is decided on the
    head's draft. Elsewhere ignored (the root alone is verified as a one-node tree)."""

    def __attrs_post_init__(self) -> None:
        top = max(self.buckets)
        cap = self.topk + (self.max_depth - 1) * self.topk * self.topk
        if top - 1 > cap:
            raise ValueError(f"buckets: the largest ({top}) needs {top - 1} drafted nodes; max_depth={self.max_depth}, "
                             f"topk={self.topk} draft at most {cap}")
        if self.min_keep > min(self.topk, top - 1):
            raise ValueError(f"min_keep: expected at most min(topk, max(buckets) - 1) = {min(self.topk, top - 1)}, got {self.min_keep}")


class CostAwarePolicy(TreePolicy):
    """Draft while the next level pays for itself; verify while a node pays for its token (lossless)."""

    name = "cost_aware"
    Params = CostAwareParams
    _overhead = 0.0
    """What a drafted step took beyond its price, ms (EMA, learned where ``min_keep`` is 0): what plain steps save."""
    eagle_beam = True
    """Every level's beam is EAGLE's top-k (drafting may stop early, a subset is verified): its trees
    are sub-trees of EAGLE's full tree, so ``adaptivespec/analysis/shape_oracle.py`` can replay it on those."""

    def __init__(self, params: CostAwareParams | None = None) -> None:
        super().__init__(params)
        p = self.params
        self._files = {"policy.profile": resolve_profile(p.profile, DEFAULT_COST_PROFILE, "profile"),
                       "policy.prior": resolve_profile(p.prior, DEFAULT_PRIOR, "prior")}
        self.cost = CostModel.load(self._files["policy.profile"])
        self.calib = CalibrationMap.load(self._files["policy.prior"], prior_weight=p.prior_weight, decay=p.decay)
        self.buckets = tuple(sorted(set(p.buckets)))
        self.shape = TreeShape(p.max_depth, p.topk, self.buckets[-1])  # the drafting shape
        self._bucket_shapes = {b: TreeShape(p.max_depth, p.topk, b) for b in self.buckets}
        D = self.calib.max_depth + 1
        # continuation: accepted nodes at depth d - 1 with verified children, and those whose path went on
        self._cont_n = np.full(D + 1, 4.0)
        self._cont_a = np.full(D + 1, 2.0)
        self._steps = 0
        self._priced = 0.0  # the price of this step's tree (the last ranking's)
        self._context: int | None = None  # committed positions this step (None: the profile's context_ref)
        self.reset()

    # -- lifecycle --------------------------------------------------------------------------------
    def shapes(self) -> tuple[TreeShape, ...]:
        return (self.shape, *(s for b, s in self._bucket_shapes.items() if s != self.shape))

    def fitted_on(self) -> list[ProfileOrigin]:
        """The cost profile (timings: target, head and CPU matter; left out once measured costs replace
        it) and the calibration prior or path calibration (acceptance)."""
        return [ProfileOrigin.read(key, path, timed=key == "policy.profile") for key, path in self._files.items()
                if not (key == "policy.profile" and self.cost.meta.get("source") == MEASURED_SOURCE)]

    def bind_costs(self, measure, device: str) -> None:
        """Price steps with this machine's measured cost table where ``costs`` asks for it."""
        origin = ProfileOrigin.read("policy.profile", self._files["policy.profile"], timed=True)
        cost = measured_costs(self.name, self.params.costs, origin, measure, device, topk=self.params.topk,
                              rows=self.buckets[-1], context_ref=self.cost.context_ref)
        if cost is not None:
            self.cost = cost

    def reset(self) -> None:
        """New prompt: the breaker state; what is learnt (map, continuation) carries over."""
        self._zero_streak = 0
        self._forced = False
        self._tripped = False
        self._levels: list[int] = []
        self._level_gain: list[float] = []
        self._values: list[np.ndarray] = []
        self._stop: str | None = None
        self._budget = 0
        self._rate = 0.0
        self._expected = 0.0
        self._head = None  # the head tree's (depth, draft log-prob) on the host, while fusing it
        self._fused = None  # (head node of every fused node, head arrays) until observe_tree
        self._source_nodes = 0
        self._probe = False  # this step's tree is the circuit breaker's probe
        self._plain_run = 0  # the plain streak's length (doubles while the root alone keeps winning)
        self._plain_left = 0  # plain steps left in it

    def next_shape(self, signals: StepSignals) -> TreeShape:
        self._context = getattr(signals, "context", 0) or None  # what a verified row costs depends on it
        return self.shape

    def plain_next(self) -> bool:
        """The plain streak (``plain_streak``): True while steps are left in it."""
        if self._plain_left:
            self._plain_left -= 1
            return True
        return False

    def verify_shape(self, shape: TreeShape, n: int) -> TreeShape:
        """The smallest bucket shape holding a tree of ``n`` nodes (the bank's executor for it)."""
        for b in self.buckets:
            if n <= b:
                return self._bucket_shapes[b]
        raise ValueError(f"cost_aware: a tree of {n} nodes exceeds the largest bucket {self.buckets[-1]}")

    # -- tree rules --------------------------------------------------------------------------------
    def _base_ms(self, levels: int, nodes: int) -> float:
        c = self.cost
        return c.base_ms(self._context) + c.per_draft_level * levels + c.per_draft_node * nodes

    @property
    def _token_ms(self) -> float:
        """Cost of one more verified token at this step's context."""
        return self.cost.token_ms(self._context)

    def _rank(self, values, levels: int, nodes: int, min_keep: int, max_keep: int, forced=None):
        """:func:`~adaptivespec.costmodel.rank_by_value` at this step's costs: ``(order, k, rate)``. A
        tree is priced with the cost model's ``tree_step`` and, where the root alone may win
        (``min_keep: 0``), the learned extra time of a drafted step over its price (:meth:`observe`)."""
        return rank_by_value(values, base_ms=self._base_ms(levels, nodes), per_token_ms=self._token_ms,
                             min_keep=min_keep, max_keep=max_keep, forced=forced, tree_ms=self._tree_ms)

    @property
    def _tree_ms(self) -> float:
        """What a tree costs beyond the line through one row: ``tree_step``, and the learned overhead where
        the root alone may win."""
        return self.cost.tree_step + (self._overhead if self.params.min_keep == 0 else 0.0)

    def select_level(self, scores: torch.Tensor, depth: int, shape: TreeShape, nodes_so_far: int):
        if depth == 1:
            self._levels, self._level_gain, self._values, self._stop = [], [], [], None
            self._source_nodes, self._head, self._probe = 0, None, False
        v = self.calib.values(depth, scores.float())  # host copy of the level's scores: one sync
        self._values.append(v)
        self._levels.append(v.shape[0])
        k = min(shape.topk, v.shape[0])
        beam = torch.topk(scores, k, sorted=False).indices
        if depth >= shape.nsteps:
            self._stop = "max_depth"
            return None, beam
        if self._forced:
            self._stop = "breaker"
            return None, beam
        c = self.cost
        levels, nodes = depth - 1, (depth - 1) * shape.topk  # drafter forwards and nodes run so far
        pool = np.concatenate(self._values) if depth > 1 else v
        _, kept, rate = self._rank(pool, levels, nodes, min(self.params.min_keep, 1), self.buckets[-1] - 1)
        # the beam is the level's top-k by score; values are monotone in score at one depth
        top = np.partition(v, v.shape[0] - k)[v.shape[0] - k:] if k < v.shape[0] else v
        if self.params.lookahead:
            margin = self._lookahead_margin(top, depth, shape.nsteps - depth, rate)
        else:  # myopic: the next level alone, every beam child verified
            cont = float(self._continuation(depth + 1)) if depth + 1 < self._cont_n.shape[0] else 0.0
            gain = float(top.sum()) * cont
            margin = gain - rate * (c.per_draft_level + k * (c.per_draft_node + self._token_ms))
        if kept == 0:  # a plain step is the best so far: a tree must pay for the switch to it too
            margin -= rate * self._tree_ms
        self._level_gain.append(margin)
        if margin <= 0:
            self._stop = "cost"
            return None, beam[:0]
        return None, beam

    def _lookahead_margin(self, beam_values: np.ndarray, depth: int, levels_left: int, rate: float) -> float:
        """Best net tokens (expected tokens gained minus the time spent, at ``rate`` tokens/ms) of
        drafting the next 1..L levels, L = min(lookahead, levels_left).

        Each beam node's path is continued one node per level at the learned continuation rates
        (``value x cont[d+1] x ... x cont[d+j]``, a geometric tail when the rates are equal); a
        continued node is verified only where its value pays for its token (``per_verified_token x
        rate``); every level costs a drafter forward over the beam. A handful of numpy ops on a
        [beam, L] array."""
        c, L = self.cost, min(self.params.lookahead, levels_left)
        idx = np.minimum(np.arange(depth + 1, depth + 1 + L), self._cont_n.shape[0] - 1)  # deeper ones share the last
        reach = np.cumprod(self._continuation(idx))  # [L] P(path goes on j more levels)
        surplus = np.maximum(beam_values[:, None] * reach[None, :] - rate * self._token_ms, 0.0).sum(0)
        draft = rate * (c.per_draft_level + beam_values.shape[0] * c.per_draft_node)
        return float(np.cumsum(surplus - draft).max())

    def _continuation(self, idx):
        """The continuation rates at depth index (or indices) ``idx`` that the level rule prices with:
        the upper confidence bound of ``explore`` (see :class:`CostAwareParams`) on each observed rate."""
        n, p = self._rates(idx)
        if not self.params.explore:
            return p
        return np.minimum(1.0, p + self.params.explore * np.sqrt(p * (1.0 - p) / n))

    def _rates(self, idx):
        """(count, point estimate) of the continuation rates at ``idx``, ``cont_prior`` included."""
        w = self.params.cont_prior
        n = self._cont_n[idx] + w
        return n, (self._cont_a[idx] + 0.5 * w) / n

    def select_final(self, scores: torch.Tensor, shape: TreeShape) -> torch.Tensor:
        values = np.concatenate(self._values)
        n1 = self._levels[0]
        cap = self.buckets[-1] - 1
        levels = len(self._levels) - 1
        nodes = levels * min(shape.topk, n1)
        if self._forced:
            self._forced, self._probe = False, True
            order = torch.sort(scores, descending=True, stable=True).indices
            k, rate = min(cap, order.shape[0]), 0.0
            self._budget, self._rate, self._priced = k + 1, rate, self.cost.step_ms(k + 1, levels, nodes, self._context)
            self._expected = 1.0 + float(values[order[:k].cpu().numpy()].sum())
            return order[:k]
        forced = np.zeros(values.shape[0], dtype=bool)
        m = min(self.params.min_keep, n1)
        forced[np.argsort(-values[:n1], kind="stable")[:m]] = True  # depth 1: value order = score order
        order, k, rate = self._rank(values, levels, nodes, self.params.min_keep, cap, forced)
        if self.params.fill_buckets:
            k = min(self.verify_shape(shape, k + 1).ndt - 1, order.shape[0])
        kept = order[:k]
        self._budget, self._rate, self._priced = k + 1, rate, self.cost.step_ms(k + 1, levels, nodes, self._context)
        self._expected = 1.0 + float(values[kept].sum())
        return torch.from_numpy(kept).to(scores.device)

    # -- fusion with candidate sources (retrieval) -------------------------------------------------
    def fusion_scores(self, head: DraftTree) -> list[float]:
        """The head's nodes valued like in :meth:`select_final` (calibrated acceptance by depth and
        cumulative draft log-prob): the scale of the sources' scores (estimated acceptance)."""
        depth, logp = torch.stack([head.depth[1:].float(), head.draft_logp[1:].float()]).cpu().numpy()
        depth = depth.astype(np.int64)
        self._head = (depth, logp)
        return [1.0, *self.calib.values(depth, logp).tolist()]

    def fusion_size(self, ranking) -> int:
        """The budget rule on the fused ranking: its best tokens/ms prefix, the root's ``min_keep``
        best children included, at most ``ranking.budget - 1`` (the bank's rows, extra slots too)."""
        v = np.asarray(ranking.scores, dtype=np.float64)
        cap = min(ranking.budget - 1, v.shape[0])
        first = np.flatnonzero(ranking.first_level)
        m = min(self.params.min_keep, first.shape[0])
        lo = int(first[m - 1]) + 1 if m else 0  # ranks are non-increasing: the best children come first
        levels = max(len(self._levels) - 1, 0) if self._head is not None else 0  # drafter forwards this step
        nodes = levels * min(self.params.topk, self._levels[0]) if levels else 0
        _, k, rate = self._rank(v, levels, nodes, min(lo, cap), cap)
        if self._probe:  # the circuit breaker's probe: every candidate the bank has room for
            k, rate = cap, 0.0
        elif self.params.fill_buckets and k + 1 <= self.buckets[-1]:
            k = min(self.verify_shape(self.shape, k + 1).ndt - 1, cap)
        index, head = np.asarray(ranking.index[:k]), np.asarray(ranking.head_index[:k], dtype=np.int64)
        fused_head = np.concatenate([[0], head[np.argsort(index, kind="stable")]])  # per fused node; -1: a source's
        self._fused = (fused_head, self._head)
        self._head = None
        self._budget, self._rate, self._priced = k + 1, rate, self.cost.step_ms(k + 1, levels, nodes, self._context)
        self._expected = 1.0 + float(v[:k].sum())
        self._source_nodes = int((head < 0).sum())
        return k

    # -- learning ----------------------------------------------------------------------------------
    def observe_tree(self, tree: DraftTree, result: VerifyResult) -> None:
        """Update the calibration map and the continuation rates from one verify result (on the host).

        A fused tree (head + sources' candidates) teaches from its head nodes only, with their own
        depths and draft log-probs: the sources' scores are not draft probabilities."""
        n = tree.size
        fused, self._fused = self._fused, None
        if n < 2:  # the root alone paid best: a plain streak follows, twice as long as the last one
            self._plain_run = min(max(1, 2 * self._plain_run), getattr(self.params, "plain_streak", 0))
            self._plain_left = self._plain_run
            self._overhead *= 1.0 - OVERHEAD_RATE  # unseen, the overhead fades: a tree is tried again where it may pay
            return
        self._plain_run = 0
        depth = tree.depth.cpu().numpy()
        parents = tree.parents.cpu().numpy()
        path = np.asarray(result.path)
        if fused is not None and fused[0].shape[0] == n:
            head_of, head = fused
            is_head = head_of >= 0
            off = np.flatnonzero(~is_head[path])  # the accepted path's head prefix: up to its first source-only node
            path = path[: off[0]] if off.shape[0] else path
            nodes = np.flatnonzero(is_head[1:]) + 1
            if head is None or nodes.shape[0] == 0:
                return
            on_path = np.zeros(n, dtype=bool)
            on_path[path] = True
            h = head_of[nodes] - 1  # index into the head's arrays (root excluded)
            self.calib.update(head[0][h], head[1][h], on_path[nodes])
            parents = np.where(is_head, parents, -1)  # source nodes are nobody's verified children here
        else:
            on_path = np.zeros(n, dtype=bool)
            on_path[path] = True
            self.calib.update(depth[1:], tree.draft_logp[1:], on_path[1:])
        children = np.bincount(parents[1:] + 1, minlength=n + 1)[path + 1] > 0  # path nodes with verified children
        went_on = np.arange(path.shape[0]) < path.shape[0] - 1
        d = np.minimum(depth[path] + 1, self._cont_n.shape[0] - 1)
        decay = self.params.decay
        self._cont_n *= decay
        self._cont_a *= decay
        np.add.at(self._cont_n, d, children)
        np.add.at(self._cont_a, d, children & went_on)

    def observe(self, record: StepRecord) -> None:
        if record.shape is None or record.tree_size <= 1:  # a plain step (min_keep 0) is no failed tree
            return
        if self.params.min_keep == 0:  # the step's own time beyond its price: the engine's share, this machine's
            took = record.draft_ms + record.verify_ms + record.other_ms  # one slow step (a page fault) counts at most its price
            self._overhead += OVERHEAD_RATE * (min(max(took - self._priced, 0.0), self._priced) - self._overhead)
        self._steps += 1
        if record.accepted:
            self._zero_streak = 0
            self._tripped = False
            return
        self._zero_streak += 1
        self._tripped = False
        if self._zero_streak >= self.params.breaker_steps:  # circuit breaker: probe with the full tree
            self._zero_streak = 0
            self._forced = self._tripped = True

    def continuation(self) -> list[float]:
        """The continuation rate at every depth index (point estimates, ``cont_prior`` included)."""
        return self._rates(slice(None))[1].tolist()

    def state(self) -> dict[str, Any]:
        out = {
            "levels": len(self._levels),
            "level_widths": list(self._levels),
            "stop": self._stop,
            "level_margin": [round(g, 4) for g in self._level_gain],
            "budget": self._budget,
            "expected_tokens": round(self._expected, 4),
            "rate_tok_per_ms": round(self._rate, 5),
            "source_nodes": self._source_nodes,
            "breaker_tripped": self._tripped,
            "zero_streak": self._zero_streak,
            "plain_streak": self._plain_run,
            "tree_overhead_ms": round(self._overhead, 3),
        }
        rel = self._trace_reliability()
        if rel is not None:
            out["reliability"] = rel
        return out

    def _trace_reliability(self) -> dict[str, Any] | None:
        """The calibration map's reliability table, every ``trace_every`` steps (None between)."""
        return self.calib.reliability() if self._steps % self.params.trace_every == 0 else None


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(CostAwarePolicy)
