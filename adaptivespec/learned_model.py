"""The fitted tree-shape model of the ``learned`` policy: features, expected tokens, cost, choice.

A fitted file (JSON, written by ``adaptivespec train-policy``) holds, per shape ``S`` of its shape
set, ridge-regression weights ``w_S`` over a fixed feature basis ``phi(x)`` of what a policy knows
before it drafts (:data:`FEATURES`), and the calibrated cost model the labels were priced with.
The choice of a step is the shape with the most expected tokens per millisecond::

    E[accepted | S, x] = clip(phi(x) . w_S, 0, S.nsteps)
    t_S(P, m)          = fixed + per_context P + per_draft_level (nsteps - 1)
                         + per_draft_node (nsteps - 1) topk + token_ms(P) (ndt + m)
    choice             = argmax_S (1 + E[accepted | S, x]) / t_S(P, m)

(``P`` committed positions, ``m`` the verify slots candidate sources take: ``min(source nodes,
extra_slots)`` in a ``hybrid`` file, 0 otherwise). One choice is a [D] x [D, S] product and an
argmax over a handful of shapes: microseconds, on the host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from adaptivespec.costmodel import COST_TERMS, PROFILE_DIR, CostModel
from adaptivespec.types import TreeShape

FORMAT = "adaptivespec-learned-policy/1"
FEATURES = ("p1", "entropy", "top4", "ema", "last", "context", "src_match", "src_nodes", "src_top", "saturated", "saturated_ema")
"""What the model reads: the draft's top-1 probability, entropy (nats) and top-4 probability at the root, the
accepted-length EMA and the last accepted length (-1 before the first step), committed positions,
the candidate sources' longest suffix match, node count and best root-child score, and whether the
last step accepted its whole depth (and the EMA of that: the trees were too shallow)."""
BASIS = ("1", "p1", "p1^2", "h", "h^2", "p1*h", "e", "e^2", "p1*e", "l", "last=0", "first", "log_ctx",
         "match", "has_src", "src_top", "match*p1", "sat", "sat_ema", "p1*sat_ema", "t4", "t4-p1", "(t4-p1)*e")
DEFAULT_MODEL = "learned-smollm2-135m-embedded.json"
"""The shipped fitted file of the embedded pair (head only) in :data:`PROFILE_DIR`."""


def basis(p1: float, entropy: float, ema: float, last: int, context: float, src_match: int, src_nodes: int,
          src_top: float, saturated: bool, saturated_ema: float, top4: float) -> list[float]:
    """``phi(x)``: the model's inputs, each scaled to about [0, 1] (names in :data:`BASIS`)."""
    p1 = min(max(p1, 0.0), 1.0) if p1 == p1 else 0.0
    t4 = min(max(top4, p1), 1.0) if top4 == top4 else p1
    h = min(max(entropy, 0.0), 8.0) / 8.0
    e = min(max(ema, 0.0), 6.0) / 6.0
    lc = math.log1p(max(context, 0.0)) / 8.0
    m = min(src_match, 8) / 8.0
    return [1.0, p1, p1 * p1, h, h * h, p1 * h, e, e * e, p1 * e, min(max(last, 0), 6) / 6.0,
            float(last == 0), float(last < 0), lc, m, float(src_nodes > 0), min(max(src_top, 0.0), 1.0), m * p1, float(saturated), saturated_ema, p1 * saturated_ema, t4, t4 - p1, (t4 - p1) * e]


def resolve(name: str | None) -> Path:
    """A fitted file: ``name`` as a path, or a shipped file in :data:`PROFILE_DIR` (default :data:`DEFAULT_MODEL`)."""
    name = name or DEFAULT_MODEL
    for p in (Path(name), PROFILE_DIR / name):
        if p.is_file():
            return p
    shipped = ", ".join(sorted(q.name for q in PROFILE_DIR.glob("learned-*.json")))
    raise ValueError(f"model: file {name!r} not found (a path, or one of the shipped fitted files: {shipped})")


class ShapeModel:
    """A loaded fitted file: the shape set, the weights and the cost model (see the module docstring)."""

    def __init__(self, data: dict[str, Any], source: str = "<dict>", cost: CostModel | None = None) -> None:
        self.data, self.source = data, source
        self.mode = self._get("mode", str)
        if self.mode not in ("head", "hybrid"):
            raise ValueError(f"{source}: mode: expected 'head' or 'hybrid', got {self.mode!r}")
        if tuple(self._get("basis", list)) != BASIS:
            raise ValueError(f"{source}: basis: expected {list(BASIS)}, got {data['basis']!r}")
        try:
            self.shapes = tuple(TreeShape(*s) for s in self._get("shapes", list))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: shapes: expected [[nsteps, topk, ndt], ...] of valid shapes ({exc})") from None
        w = np.asarray(self._get("weights", list), dtype=np.float64)
        if w.shape != (len(self.shapes), len(BASIS)) or not np.isfinite(w).all():
            raise ValueError(f"{source}: weights: expected {len(self.shapes)} x {len(BASIS)} finite numbers "
                             f"(one row per shape), got shape {list(w.shape)}")
        self.W = np.ascontiguousarray(w.T)  # [D, S]
        self.depth = np.array([s.nsteps for s in self.shapes], dtype=np.float64)
        self.static = TreeShape(*self._get("static", list))
        self.ema_alpha = float(data.get("ema_alpha", 0.3))
        self.ema_init = float(data.get("ema_init", 1.5))
        self.extra_slots = int(data.get("extra_slots", 0)) if self.mode == "hybrid" else 0
        if cost is None:
            coef = self._get("cost_ms", dict)
            missing = [k for k in ("fixed", "per_verified_token") if k not in coef]
            if missing:
                raise ValueError(f"{source}: cost_ms: missing {', '.join(missing)} (expected the coefficients {list(COST_TERMS)})")
            cost = CostModel(**{k: float(coef.get(k, 0.0)) for k in COST_TERMS})
        self.set_cost(cost)

    def _get(self, key: str, kind: type) -> Any:
        if key not in self.data:
            raise ValueError(f"{self.source}: missing key {key!r} (not a fitted file of adaptivespec train-policy?)")
        value = self.data[key]
        if not isinstance(value, kind):
            raise ValueError(f"{self.source}: {key}: expected a {kind.__name__}, got {value!r:.60}")
        return value

    @classmethod
    def load(cls, name: str | None = None, cost: CostModel | None = None) -> "ShapeModel":
        """Load a fitted file (a path or a shipped name); ``cost`` replaces its cost model."""
        path = resolve(name)
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: format: expected {FORMAT!r}, got {got!r}")
        return cls(data, str(path), cost)

    def set_cost(self, cost: CostModel) -> None:
        """Price the shapes with ``cost``: ``t_S(P) = a_S + b_S P`` and one source slot ``ta + tb P``."""
        self.cost = cost
        lv = np.array([s.nsteps - 1 for s in self.shapes], dtype=np.float64)
        nodes = np.array([(s.nsteps - 1) * s.topk for s in self.shapes], dtype=np.float64)
        ndt = np.array([s.ndt for s in self.shapes], dtype=np.float64)
        self.a = cost.fixed + cost.per_draft_level * lv + cost.per_draft_node * nodes + cost.per_verified_token * ndt
        self.b = cost.per_context + cost.per_verified_token_context * ndt
        self.ta, self.tb = cost.per_verified_token, cost.per_verified_token_context

    def step_ms(self, context: float, src_nodes: int = 0) -> np.ndarray:
        """[S] modelled step time of every shape at ``context`` positions."""
        m = min(src_nodes, self.extra_slots)
        return self.a + self.b * context + m * (self.ta + self.tb * context)

    def shape_ms(self, shape: TreeShape, context: float, src_nodes: int = 0) -> float:
        """Modelled step time of any ``shape`` (one of the set or not)."""
        c, m = self.cost, min(src_nodes, self.extra_slots)
        return c.step_ms(shape.ndt + m, shape.nsteps - 1, (shape.nsteps - 1) * shape.topk, context)

    def expected(self, phi: list[float]) -> np.ndarray:
        """[S] expected accepted drafted tokens of every shape."""
        return np.clip(np.asarray(phi) @ self.W, 0.0, self.depth)

    def choose(self, phi: list[float], context: float, src_nodes: int = 0) -> int:
        """Index of the shape with the most expected tokens per modelled millisecond."""
        return int(np.argmax((1.0 + self.expected(phi)) / self.step_ms(context, src_nodes)))
