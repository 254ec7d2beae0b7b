"""Fit the ``learned`` policy's shape model on counterfactual labels, and measure it on held-out prompts.

Labels (:mod:`adaptivespec.training.policy_data`) give, at every position of every training
prompt, the tokens each labelled shape would accept. A policy's history features (the accepted-
length EMA, the last accepted length) depend on the shapes it chose, so rows are made along
*trajectories*: a schedule is replayed over the prompt and every position gets the history as of
the last step started at or before it. Rows come from a few static schedules, then (DAgger) from
the fitted policy's own schedule.

1. Ridge regression, one output per labelled shape: accepted tokens ~ ``phi(x)``
   (:func:`adaptivespec.learned_model.basis`).
2. Shape set: greedy forward selection from the best static shape: add the shape whose addition
   most shortens the replayed time of the training prompts (a shape is one executor in the bank,
   so the set stays small), until no shape gains 0.3% or ``max_shapes`` is reached.
3. Refit on rows of the policy's own schedule, then tune one intercept offset per shape of the
   set directly on the replayed time (coordinate descent: the regression's errors matter only
   where they change a choice); replay it (the real :class:`LearnedPolicy`, hedge
   on and off) on the held-out prompts beside static shapes, the shipped DCS config and the oracle.

Times come from the calibrated cost model (``adaptivespec calibrate``), as the policy prices shapes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from adaptivespec.costmodel import COST_TERMS, CostModel
from adaptivespec.learned_model import BASIS, FORMAT, ShapeModel, basis
from adaptivespec.policies.learned import LearnedParams, LearnedPolicy
from adaptivespec.types import StepRecord, StepSignals, TreeShape

EMA_ALPHA, EMA_INIT = 0.3, 1.5
TRAJECTORY_SHAPES = ((3, 4, 8), (1, 4, 4), (5, 2, 8), (2, 2, 4), (6, 1, 7))
"""Static schedules whose histories make the first rows."""


class Prompts:
    """One mode's view of a list of labels: per prompt, accepted tokens [N, S] and the features."""

    def __init__(self, labels: list[dict], mode: str, extra_slots: int = 8) -> None:
        self.mode, self.extra_slots = mode, extra_slots
        self.shapes = [TreeShape(*s) for s in labels[0]["shapes"]]
        self.col = {s: i for i, s in enumerate(self.shapes)}
        self.items = []
        for lab in labels:
            A = lab["acc"].numpy().astype(np.int64)
            n = A.shape[0]
            src = mode == "hybrid"
            sacc = lab["src_acc"].numpy().astype(np.int64) if src else np.zeros(n, np.int64)
            self.items.append({
                "id": lab["id"], "kind": lab["kind"], "A": np.maximum(A, sacc[:, None]),
                "p1": lab["p1"].numpy(), "ent": lab["entropy"].numpy(), "top4": lab["top4"].numpy(), "ctx": lab["prompt_len"] + np.arange(n),
                "match": lab["src_match"].numpy() if src else np.zeros(n, np.int64),
                "nodes": lab["src_nodes"].numpy() if src else np.zeros(n, np.int64),
                "top": lab["src_top"].numpy() if src else np.zeros(n)})

    @property
    def positions(self) -> int:
        return sum(it["A"].shape[0] for it in self.items)

    def times(self, cost: CostModel, it: dict) -> np.ndarray:
        """[N, S] modelled ms of every labelled shape at every position of one prompt."""
        sh = self.shapes
        base = np.array([cost.step_ms(s.ndt, s.nsteps - 1, (s.nsteps - 1) * s.topk, 0.0) for s in sh])
        per_p = np.array([cost.per_context + cost.per_verified_token_context * s.ndt for s in sh])
        extra = np.minimum(it["nodes"], self.extra_slots) if self.mode == "hybrid" else np.zeros(len(it["ctx"]))
        tok = cost.per_verified_token + cost.per_verified_token_context * it["ctx"]
        return base[None, :] + it["ctx"][:, None] * per_p[None, :] + (extra * tok)[:, None]

    def signals(self, it: dict, i: int, step: int, last: int) -> StepSignals:
        return StepSignals(step=step, draft_top1_prob=float(it["p1"][i]), last_accepted=last, context=int(it["ctx"][i]),
                           draft_entropy=float(it["ent"][i]), draft_top4_prob=float(it["top4"][i]), source_match=int(it["match"][i]),
                           source_nodes=int(it["nodes"][i]), source_top=float(it["top"][i]))


HIST0 = (EMA_INIT, -1, False, 0.0)
"""History before the first step: (accepted EMA, last accepted, last step saturated, saturation EMA)."""


def advance(hist: tuple, a: int, depth: int) -> tuple:
    """The history after a step of ``depth`` levels that accepted ``a`` tokens (as the policy keeps it)."""
    sat = a >= depth
    return (EMA_ALPHA * a + (1 - EMA_ALPHA) * hist[0], a, sat, EMA_ALPHA * sat + (1 - EMA_ALPHA) * hist[3])


def walk(P: Prompts, it: dict, choose: Callable[[int, tuple], int], T: np.ndarray) -> tuple[float, list]:
    """Replay one prompt: ``choose(i, history)`` -> column; returns total ms and per-step
    ``(position, column, accepted, history)``."""
    i, total, hist, steps, N = 0, 0.0, HIST0, [], it["A"].shape[0]
    while i < N:
        c = choose(i, hist)
        a = int(it["A"][i, c])
        total += T[i, c]
        steps.append((i, c, a, hist))
        hist, i = advance(hist, a, P.shapes[c].nsteps), i + a + 1
    return total, steps


def phi_at(it: dict, i: int, hist: tuple) -> list[float]:
    return basis(float(it["p1"][i]), float(it["ent"][i]), hist[0], hist[1], float(it["ctx"][i]), int(it["match"][i]),
                 int(it["nodes"][i]), float(it["top"][i]), hist[2], hist[3], float(it["top4"][i]))


def rows_along(it: dict, steps: list) -> tuple[list, np.ndarray]:
    """Features at every position with the history of the last step started at or before it."""
    X, k = [], 0
    for i in range(it["A"].shape[0]):
        while k + 1 < len(steps) and steps[k + 1][0] <= i:
            k += 1
        X.append(phi_at(it, i, steps[k][3]))
    return X, it["A"]


def ridge(X: np.ndarray, Y: np.ndarray, lam: float = 1.0) -> np.ndarray:
    """[D, S] weights of ``Y ~ X W`` with an L2 penalty ``lam`` (the intercept unpenalised)."""
    reg = lam * np.eye(X.shape[1])
    reg[0, 0] = 0.0
    return np.linalg.solve(X.T @ X + reg, X.T @ Y)


class Fitter:
    """Rows, weights over every labelled shape, and the replay of a candidate shape set."""

    def __init__(self, P: Prompts, cost: CostModel) -> None:
        self.P, self.cost = P, cost
        self.T = [P.times(cost, it) for it in P.items]
        self.X: list = []
        self.Y: list = []
        self.depth = np.array([s.nsteps for s in P.shapes], dtype=np.float64)

    def add_rows(self, choose_for: Callable[[int], Callable]) -> None:
        for k, it in enumerate(self.P.items):
            _, steps = walk(self.P, it, choose_for(k), self.T[k])
            X, Y = rows_along(it, steps)
            self.X += X
            self.Y.append(Y)

    def fit(self, lam: float = 1.0) -> None:
        self.W = ridge(np.asarray(self.X), np.concatenate(self.Y).astype(np.float64), lam)

    def chooser(self, cols: list[int]) -> Callable[[int], Callable]:
        W, depth = self.W[:, cols], self.depth[cols]

        def for_prompt(k: int):
            it, T = self.P.items[k], self.T[k]

            def choose(i, hist):
                e = np.clip(np.asarray(phi_at(it, i, hist)) @ W, 0.0, depth)
                return cols[int(np.argmax((1.0 + e) / T[i, cols]))]
            return choose
        return for_prompt

    def replay_ms(self, cols: list[int]) -> float:
        ch = self.chooser(cols)
        return sum(walk(self.P, it, ch(k), self.T[k])[0] for k, it in enumerate(self.P.items))

    def tune_offsets(self, cols: list[int], grid=(-1.0, -0.5, -0.25, 0.25, 0.5, 1.0), sweeps: int = 2) -> float:
        """Decision-aware correction: per shape of ``cols``, the intercept offset (added to its
        expected tokens) that most shortens the replayed time, by coordinate descent; returns the time."""
        cur = self.replay_ms(cols)
        for _ in range(sweeps):
            improved = False
            for c in cols:
                base = keep = self.W[0, c]
                for g in grid:
                    self.W[0, c] = base + g
                    t = self.replay_ms(cols)
                    if t < cur * (1 - 1e-4):
                        cur, keep, improved = t, base + g, True
                self.W[0, c] = keep
            if not improved:
                break
        return cur

    def static_ms(self) -> np.ndarray:
        """[S] total ms of every static shape over the prompts."""
        out = np.zeros(len(self.P.shapes))
        for k, it in enumerate(self.P.items):
            for c in range(len(out)):
                out[c] += walk(self.P, it, lambda i, h, c=c: c, self.T[k])[0]
        return out

    def select(self, start: int, max_shapes: int, min_gain: float = 0.003, log=print) -> list[int]:
        cols, cur = [start], self.replay_ms([start])
        while len(cols) < max_shapes:
            trials = {c: self.replay_ms(cols + [c]) for c in range(len(self.P.shapes)) if c not in cols}
            best = min(trials, key=trials.get)
            if trials[best] > cur * (1 - min_gain):
                break
            cols, cur = cols + [best], trials[best]
            log(f"shape set + {self.P.shapes[best]}: {cur / self.replay_ms([start]):.4f} of the best static's time")
        return cols


def fitted_file(P: Prompts, fitter: Fitter, cols: list[int], static: int, cost: CostModel, meta: dict) -> dict:
    return {"format": FORMAT, "mode": P.mode, "basis": list(BASIS),
            "shapes": [[*map(int, (P.shapes[c].nsteps, P.shapes[c].topk, P.shapes[c].ndt))] for c in cols],
            "weights": [[round(float(v), 6) for v in fitter.W[:, c]] for c in cols],
            "static": [P.shapes[static].nsteps, P.shapes[static].topk, P.shapes[static].ndt],
            "cost_ms": {k: getattr(cost, k) for k in COST_TERMS}, "ema_alpha": EMA_ALPHA, "ema_init": EMA_INIT,
            "extra_slots": P.extra_slots if P.mode == "hybrid" else 0, **meta}


def replay_policy(policy, P: Prompts, cost: CostModel, on_step: Callable | None = None) -> dict[str, Any]:
    """Replay a tree policy object step by step on the labels (signals in, records out);
    ``on_step(prompt index, signals, shape, accepted)`` sees every step."""
    total, chosen = 0.0, {}
    for k, it in enumerate(P.items):
        policy.reset()
        i, step, last, N = 0, 0, -1, it["A"].shape[0]
        while i < N:
            signals = P.signals(it, i, step, last)
            shape = policy.next_shape(signals)
            a = int(it["A"][i, P.col[shape]])
            if on_step is not None:
                on_step(k, signals, shape, a)
            m = min(int(it["nodes"][i]), P.extra_slots) if P.mode == "hybrid" else 0
            total += cost.step_ms(shape.ndt + m, shape.nsteps - 1, (shape.nsteps - 1) * shape.topk, float(it["ctx"][i]))
            policy.observe(StepRecord(step=step, shape=shape, tree_size=shape.ndt, accepted=a, promoted=0, new_tokens=a + 1,
                                      draft_ms=0.0, verify_ms=0.0, other_ms=0.0))
            chosen[str(shape)] = chosen.get(str(shape), 0) + 1
            i, step, last = i + a + 1, step + 1, a
    return {"ms": total, "steps": sum(chosen.values()), "shapes_used": dict(sorted(chosen.items(), key=lambda kv: -kv[1]))}


def evaluate(P: Prompts, cost: CostModel, model: dict, train_static: int, dcs_policy=None,
             per_kind: bool = True) -> dict[str, Any]:
    """Held-out figures: tokens per modelled second of the learned policy (hedge on, off), static
    shapes, the DCS config and the oracle; ratios against the best static shape chosen on training
    prompts. ``per_kind``: the same figures for each kind of prompt apart (``out["per_kind"]``)."""
    f = Fitter(P, cost)
    static = f.static_ms()
    tokens = P.positions
    rate = lambda ms: 1000.0 * tokens / ms  # noqa: E731
    shape_model = ShapeModel(model, "<fitted>")
    out: dict[str, Any] = {"prompts": len(P.items), "positions": tokens}
    ref = static[train_static]
    out["static_train_best"] = {"shape": str(P.shapes[train_static]), "tok_per_s": rate(ref)}
    hind = int(static.argmin())
    out["static_heldout_best"] = {"shape": str(P.shapes[hind]), "tok_per_s": rate(static[hind]), "vs_ref": ref / static[hind]}
    e3 = P.col[TreeShape(3, 4, 8)]
    out["eagle3_static"] = {"shape": "(3,4,8)", "tok_per_s": rate(static[e3]), "vs_ref": ref / static[e3]}
    for name, hedge in (("learned", True), ("learned_no_hedge", False)):
        pol = LearnedPolicy(LearnedParams(hedge=hedge), shape_model)
        r = replay_policy(pol, P, cost)
        out[name] = {"tok_per_s": rate(r["ms"]), "vs_ref": ref / r["ms"], "vs_eagle3": static[e3] / r["ms"],
                     "tokens_per_step": tokens / r["steps"], "shapes_used": r["shapes_used"],
                     "decide_us": pol.decide_us}
    if dcs_policy is not None:
        r = replay_policy(dcs_policy, P, cost)
        out["dcs_config"] = {"tok_per_s": rate(r["ms"]), "vs_ref": ref / r["ms"], "vs_eagle3": static[e3] / r["ms"]}
    for name, cols in (("oracle", list(range(len(P.shapes)))), ("oracle_on_learned_set", [P.col[s] for s in shape_model.shapes])):
        ms = 0.0
        for k, it in enumerate(P.items):
            acc = [{c: int(it["A"][i, c]) for c in cols} for i in range(it["A"].shape[0])]
            ms += oracle_ms(acc, f.T[k], cols)
        out[name] = {"tok_per_s": rate(ms), "vs_ref": ref / ms, "vs_eagle3": static[e3] / ms}
    if per_kind:
        kinds = sorted({it["kind"] for it in P.items})
        out["per_kind"] = {k: evaluate(_subset(P, [it for it in P.items if it["kind"] == k]), cost, model, train_static,
                                       dcs_policy, per_kind=False) for k in kinds}
    return out


def _subset(P: Prompts, items: list[dict]) -> Prompts:
    Q = copy.copy(P)
    Q.items = items
    return Q


def oracle_ms(acc: list[dict], T: np.ndarray, cols: list[int]) -> float:
    """The per-step oracle's total ms over one prompt (context-dependent step times)."""
    return oracle_path(acc, T, cols)[0]


def oracle_path(acc: list[dict], T: np.ndarray, cols: list[int]) -> tuple[float, int]:
    """The per-step oracle's total ms and number of steps over one prompt (dynamic programming
    from the end: it knows the future, a bound no policy reaches)."""
    N = len(acc)
    f, steps = [0.0] * (N + 1), [0] * (N + 1)
    for i in range(N - 1, -1, -1):
        c = min(cols, key=lambda c: T[i, c] + f[min(N, i + acc[i][c] + 1)])
        nxt = min(N, i + acc[i][c] + 1)
        f[i], steps[i] = T[i, c] + f[nxt], 1 + steps[nxt]
    return f[0], steps[0]
