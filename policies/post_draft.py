"""Policy ``post_draft``: draft a generous tree, then verify the ancestor-closed set of drafted (and
retrieved) nodes that maximises expected tokens per modelled millisecond.

It is ``cost_aware`` (same cost model and ``costs`` choice, same budget rule, same bank buckets and
circuit breaker) with three changes, each aimed at why ``cost_aware`` stays near ``eagle3.yaml`` (docs/post-draft.md):

* **values fitted offline, per depth and per proposer** (:class:`~adaptivespec.costmodel.PathCalibration`,
  ``adaptivespec fit-post-draft`` on training prompts): a drafted node's acceptance is a logistic
  function, at its depth, of its cumulative *and* its own edge's draft log-prob, capped by its
  parent's value (so values never rise along a path and every value-ranked prefix is closed under
  ancestors); a candidate source's node is valued from its own score by that source's fit
  (:meth:`fusion_source_scores`). Nothing is learnt online, so no state drifts with the traffic
  (``cost_aware``'s continuation rates could stay low and stop it drafting deep).
* **per-step depth and branching** (``select_level``): at each level, of EAGLE's top-``topk`` beam
  only the nodes whose best child could still pay for its verify row are expanded
  (``value x cont[d+1] > rate x per_verified_token``, the fitted continuation rate ``cont``);
  drafting stops (an empty beam) when none is left or when the next levels' expected surplus does
  not pay for their drafter forwards (``cost_aware``'s look-ahead rule at the fitted rates). Each
  extra level is paid in the step's time whether or not its nodes are verified.
* **the post-draft choice** (``select_final``, inherited): of everything drafted, the prefix of the
  value ranking maximising ``(1 + sum of values) / (base + per_draft_level x levels + per_verified_token x rows)``.
  With values monotone along paths, the best ``n``-node ancestor-closed subtree is the top ``n``
  by value, so this argmax over ``n`` is the exact optimum over subtrees. With sources, the fused
  ranking is cut by the same rule (``fusion_size``, inherited).

Host syncs per step: one per drafted level (the level's scores, at most ``topk^2`` floats; values, beam
and stop rule are a few numpy operations on the host) and one for the budget, as ``cost_aware``.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

import adaptivespec
from adaptivespec.api import (
    CandidateTrie, DraftTree, TreePolicy, TreeShape, VerifyResult, as_tuple, int_at_least, one_of,
)
from adaptivespec.costmodel import (
    COST_SOURCES,
    DEFAULT_COST_PROFILE,
    DEFAULT_PATH_CALIBRATION,
    CostModel,
    PathCalibration,
    rank_by_value,
    resolve_profile,
)
from adaptivespec.policies.cost_aware import LOOKAHEAD, CostAwareParams, CostAwarePolicy, _buckets, _file


@attrs.frozen(kw_only=True)
class PostDraftParams:
    max_depth: int = attrs.field(default=6, validator=int_at_least(1))
    """Most draft levels per step (the generous tree; drafting stops earlier when a level does not pay)."""
    topk: int = attrs.field(default=4, validator=int_at_least(1))
    """Children proposed per expanded node, and the widest beam of a level."""
    buckets: tuple[int, ...] = attrs.field(default=(4, 6, 8, 12, 16, 24), converter=as_tuple, validator=_buckets)
    """ndt buckets (tokens verified, root included): one bank shape each; the largest bounds the verified set."""
    min_keep: int = attrs.field(default=1, validator=int_at_least(1))
    """The root's best children verified whatever their value."""
    fill_buckets: bool = False
    """Verify the next-best nodes up to the bucket's ndt (free only where the runtime pads to the bucket)."""
    profile: str | None = attrs.field(default=None, validator=_file(DEFAULT_COST_PROFILE))
    """Cost profile (``adaptivespec calibrate``); null: the shipped CPU profile of the embedded model."""
    costs: str = attrs.field(default="auto", validator=one_of(*COST_SOURCES))
    """What steps are priced with: ``profile``, ``measured`` or ``auto`` (as ``cost_aware``'s)."""
    calibration: str | None = attrs.field(default=None, validator=_file(DEFAULT_PATH_CALIBRATION))
    """Path calibration (``adaptivespec fit-post-draft``); null: the shipped one of the embedded pair."""
    branch: bool = True
    """Expand only the beam nodes whose best child could pay for its verify row (per-step branching);
    false: EAGLE's full top-``topk`` beam at every drafted level."""
    lookahead: int = attrs.field(default=LOOKAHEAD, validator=int_at_least(0))
    """Levels the stop rule looks ahead (as ``cost_aware``'s; 0: the next level alone)."""
    breaker_steps: int = attrs.field(default=5, validator=int_at_least(1))
    """Consecutive zero-accept steps after which one step drafts and verifies the full tree."""

    def __attrs_post_init__(self) -> None:
        CostAwareParams.__attrs_post_init__(self)  # the same bucket and min_keep checks


class PostDraftPolicy(CostAwarePolicy):
    """Draft while a level can pay, then verify the best tokens-per-ms subtree (lossless)."""

    name = "post_draft"
    Params = PostDraftParams
    eagle_beam = True
    """Every level's beam is a subset of EAGLE's top-k, so its trees are sub-trees of EAGLE's full
    tree and ``adaptivespec/analysis/shape_oracle.py`` can replay it."""

    def __init__(self, params: PostDraftParams | None = None) -> None:
        TreePolicy.__init__(self, params)
        p = self.params
        self._files = {"policy.profile": resolve_profile(p.profile, DEFAULT_COST_PROFILE, "profile"),
                       "policy.calibration": resolve_profile(p.calibration, DEFAULT_PATH_CALIBRATION, "calibration")}
        self.cost = CostModel.load(self._files["policy.profile"])  # (fitted_on: cost_aware's, over these files)
        self.cal = PathCalibration.load(self._files["policy.calibration"])
        self.buckets = tuple(sorted(set(p.buckets)))
        self.shape = TreeShape(p.max_depth, p.topk, self.buckets[-1])
        self._bucket_shapes = {b: TreeShape(p.max_depth, p.topk, b) for b in self.buckets}
        self._cont = self.cal.continuation
        self._cont_n = np.ones_like(self._cont)  # (cost_aware's look-ahead reads its length only)
        self._steps = 0
        self._context: int | None = None
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._prev: tuple[np.ndarray, np.ndarray] | None = None  # (scores, values) of the last level, on the host
        self._beam_host = np.zeros(0, dtype=np.int64)  # the last level's expanded nodes
        self._expanded: list[int] = []

    # -- the level rule: values, branching, stop ---------------------------------------------------
    def _continuation(self, idx):
        """The fitted continuation rates (no online state: cost_aware's look-ahead reads these)."""
        return self._cont[np.minimum(idx, self._cont.shape[0] - 1)]

    def _level_values(self, s: np.ndarray, depth: int, k: int) -> np.ndarray:
        """Calibrated values of a level's candidates (``s``: their scores on the host), each capped by its parent's."""
        if depth == 1 or self._prev is None:
            ps, pv = 0.0, 1.0
        else:
            par = np.repeat(self._beam_host, k)  # every expanded node proposes k children, in beam order
            ps, pv = self._prev[0][par], self._prev[1][par]
        v = np.minimum(self.cal.head_values_np(depth, s, s - ps), pv)
        self._prev = (s, v)
        return v

    def select_level(self, scores: torch.Tensor, depth: int, shape: TreeShape, nodes_so_far: int):
        if depth == 1:
            self._levels, self._level_gain, self._values, self._stop = [], [], [], None
            self._source_nodes, self._head, self._probe, self._expanded = 0, None, False, []
        s = scores.float().cpu().numpy().astype(np.float64)  # the level's scores on the host: one sync
        k = min(shape.topk, s.shape[0])
        order = np.argsort(-s, kind="stable")[:k]  # EAGLE's beam, best first
        v = self._level_values(s, depth, shape.topk)
        self._values.append(v)
        self._levels.append(v.shape[0])
        self._beam_host = order
        full = torch.from_numpy(order).to(scores.device)
        if depth >= shape.nsteps:
            self._stop = "max_depth"
            return None, full
        if self._forced:
            self._stop = "breaker"
            self._expanded.append(k)
            return None, full
        c = self.cost
        pool = np.concatenate(self._values) if depth > 1 else v
        _, _, rate = rank_by_value(pool, base_ms=self._base_ms(depth - 1, sum(self._expanded)), per_token_ms=self._token_ms,
                                   min_keep=1, max_keep=self.buckets[-1] - 1)
        bv = v[order]  # beam values, best score first
        if self.params.branch:  # expand a node only if its best child could pay for its row
            order = order[bv * float(self._continuation(depth + 1)) > rate * self._token_ms]
            bv = v[order]
        if bv.shape[0] == 0:
            margin = 0.0
        elif self.params.lookahead:
            margin = self._lookahead_margin(bv, depth, shape.nsteps - depth, rate)
        else:
            gain = float(bv.sum()) * float(self._continuation(depth + 1))
            margin = gain - rate * (c.per_draft_level + bv.shape[0] * (c.per_draft_node + self._token_ms))
        self._level_gain.append(margin)
        if margin <= 0:
            self._stop = "cost"
            return None, full[:0]
        self._beam_host = order
        self._expanded.append(int(order.shape[0]))
        return None, full if order.shape[0] == k else torch.from_numpy(order).to(scores.device)

    # -- fusion: the head's values and each source's own calibrated estimate ----------------------
    def fusion_scores(self, head: DraftTree) -> list[float]:
        """The head's nodes valued by the fitted map (capped along paths), on the sources' scale."""
        depth = head.depth[1:].cpu().numpy().astype(np.int64)
        logp = head.draft_logp.float().cpu().numpy()
        parents = head.parents.cpu().numpy()
        edge = logp[1:] - np.where(parents[1:] > 0, logp[np.maximum(parents[1:], 0)], 0.0)
        v = np.concatenate([[1.0], self.cal.head_values_np(depth, logp[1:], edge)])
        anc = head.ancestors.cpu().numpy()
        v = np.where(anc, v[None, :], np.inf).min(-1)  # the smallest value on each node's path
        self._head = (depth, logp[1:])
        return v.tolist()

    def fusion_source_scores(self, source: str, trie: CandidateTrie) -> list[float] | None:
        """``source``'s candidates valued by its own fit (depth and score); None: no fit, its scores."""
        if not len(trie):
            return None
        v = self.cal.source_values(source, trie.depths(), trie.scores)
        return None if v is None else v.tolist()

    # -- nothing learnt online -------------------------------------------------------------------------
    def observe_tree(self, tree: DraftTree, result: VerifyResult) -> None:
        self._fused = None

    def _trace_reliability(self) -> None:
        return None  # a fixed calibration: its held-out reliability is in the fit's card

    def state(self) -> dict[str, Any]:
        return {**super().state(), "expanded": list(self._expanded)}


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(PostDraftPolicy)
