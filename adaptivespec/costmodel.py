"""A measured step-cost model, calibrated path values, and the value/cost ranking of candidates.

Three pieces, used by the ``cost_aware`` tree policy and reusable on any candidate set:

* :class:`CostModel`: the wall time of one speculative step as a linear function of what the step
  does, fitted by least squares to measured steps (``adaptivespec calibrate``) and stored as a
  small JSON *profile*::

      t(step) = fixed + per_context * P + per_draft_level * L + per_draft_node * E
                + (per_verified_token + per_verified_token_context * P) * n + tree_step * [n >= 2]

  (``P`` committed positions, ``L`` drafter forwards, ``E`` nodes run through the drafter, ``n``
  tokens verified, the root included). Every verified row attends over the whole context, so a
  row costs more as the prompt grows: ``per_verified_token_context`` is that growth (0 in a
  profile fitted on prompts of one length, or written before the term existed). ``tree_step`` is
  what a verify of two or more rows costs beyond the line through one row: measured, the second
  row of a llama.cpp decode on a CPU costs 0.8-0.9 of the first, the third and later ones far less
  (docs/llamacpp.md; 0 on the torch runtime, in a fitted profile, and in older files).
* :class:`CalibrationMap`: an online map from a drafted node's (depth, cumulative draft
  log-probability) to the probability that strict verification accepts it, updated from every
  verify result (which nodes were verified, which were on the accepted path), starting from a
  prior measured on training prompts. Its values are monotone: non-increasing in depth and
  non-decreasing in log-probability, so a child never scores above its parent and every prefix of
  a value ranking is closed under ancestors. It keeps a reliability table of its own predictions.
* :func:`rank_by_value`: which candidates to verify, given their calibrated values (expected
  accepted tokens) and the cost model: the prefix of the value ranking that maximises expected
  tokens per millisecond. It takes any candidate set (draft-tree nodes, retrieved continuations).
"""

from __future__ import annotations

import json
import logging
import math
import platform
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch

from adaptivespec.errors import AdaptiveSpecError

PROFILE_DIR = Path(__file__).parent / "profiles"
"""Shipped profiles: the cost model and calibration prior of the embedded model on CPU."""
DEFAULT_COST_PROFILE = "cpu-smollm2-135m-bf16.json"
DEFAULT_PRIOR = "calibration-smollm2-135m-embedded.json"

COST_TERMS = ("fixed", "per_context", "per_draft_level", "per_draft_node", "per_verified_token",
              "per_verified_token_context", "tree_step")

LOGP_EDGES = (-0.05, -0.15, -0.3, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.5, -7.0)
"""Bin edges of the cumulative draft log-probability (bin 0 is the most likely, > -0.05)."""
RELIABILITY_BINS = 10


def resolve_profile(name: str | None, default: str, key: str) -> Path:
    """A profile path: ``name`` as a file, or a file of the shipped profiles; ``default`` if None."""
    name = name or default
    for p in (Path(name), PROFILE_DIR / name):
        if p.is_file():
            return p
    shipped = ", ".join(sorted(q.name for q in PROFILE_DIR.glob("*.json")))
    prefix = f"{key}: " if key else ""
    raise ValueError(f"{prefix}file {name!r} not found (a path, or one of the shipped profiles: {shipped})")


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` shows it (``/proc/cpuinfo``'s ``model name``: "AMD EPYC",
    "Intel(R) Xeon(R) Processor"), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    from adaptivespec import hardware

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_name(), "isa": hardware.isa(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- where a fitted file was measured --------------------------------------------------------------
log = logging.getLogger("adaptivespec.profiles")
_warned: set[str] = set()


def model_name(name: Any) -> str | None:
    """A target or head as a profile and a config name it, compared by its last path component in
    lower case: a folder, an HF id and the embedded alias of one model agree
    (``HuggingFaceTB/SmolLM2-135M-Instruct`` ~ ``~/.cache/adaptivespec/smollm2-135m-instruct``)."""
    if name is None:
        return None
    return str(name).rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].lower()


@attrs.frozen(kw_only=True)
class ProfileOrigin:
    """What one fitted file a policy reads was measured on (read from the file itself)."""

    key: str
    """The config key naming the file (``policy.profile``, ``policy.prior``, ...)."""
    path: str
    target: str | None = None
    """``model.target`` of the run that fitted it (None: not recorded)."""
    drafter: str | None = None
    """``model.drafter`` of that run (None: not recorded)."""
    cpu: str | None = None
    """The CPU's model name (:func:`cpu_name`) where timings were measured; None: not recorded."""
    device: str | None = None
    """``runtime.device`` of the measurement (None: not recorded)."""
    timed: bool = False
    """The file holds timings (a cost model): the CPU and device matter; acceptance counts do not."""
    runtime: str | None = None
    """The runtime the timings are of (a file that names none: ``torch``'s, the only one calibrated then)."""
    dtype: str | None = None
    """The torch dtype the timings ran in (None: not recorded)."""
    isa: str | None = None
    """The instruction-set level the timings ran at (:func:`adaptivespec.hardware.isa`; None: not recorded)."""

    @classmethod
    def read(cls, key: str, path: str | Path, timed: bool) -> "ProfileOrigin":
        """The origin recorded in the JSON file at ``path``: ``model`` ({target, drafter}; or top-level
        ``target`` / ``drafter``), ``machine.cpu`` and ``device`` (missing keys: not recorded)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        model = data.get("model") if isinstance(data.get("model"), dict) else data
        machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
        return cls(key=key, path=str(path), target=model.get("target"), drafter=model.get("drafter"),
                   cpu=machine.get("cpu"), device=data.get("device"), timed=timed,
                   runtime=data.get("runtime") or machine.get("runtime"), dtype=data.get("dtype") or machine.get("dtype"),
                   isa=machine.get("isa"))

    def timed_elsewhere(self, running: "RunningSetup | None") -> list[str]:
        """What about the running setup makes this file's timings another machine's: the CPU's name, and
        where ``running`` says (the engine's cost source does) the runtime, the dtype and the ISA level
        (two "AMD EPYC" CPUs, one with AVX-512 and one without, share a name), each a short phrase."""
        cpu = self._other_cpu()
        out = [cpu] if cpu else []
        if running is None:
            return out
        if (self.runtime or "torch") != running.runtime:
            out.append(f"runtime {self.runtime or 'torch'} (running {running.runtime})")
        elif self.dtype is not None and running.dtype is not None and self.dtype != running.dtype:
            out.append(f"dtype {self.dtype} (running {running.dtype})")
        if self.isa is not None and running.isa is not None and self.isa != running.isa:
            out.append(f"ISA {self.isa} (running {running.isa})")
        return out

    def differences(self, target: str | None, drafter: str | None, device: str) -> list[str]:
        """What differs between this file's run and the running one (``model.target``,
        ``model.drafter``, ``runtime.device`` and this machine's CPU), each as a short phrase."""
        out = []
        if self.target is not None and model_name(self.target) != model_name(target):
            out.append(f"target {self.target} (running {target})")
        if self.drafter is not None and drafter is not None and model_name(self.drafter) != model_name(drafter):
            out.append(f"drafter {self.drafter} (running {drafter})")
        if self.timed and self.device is not None and self.device != device:
            out.append(f"device {self.device} (running {device})")
        elif self.timed and device == "cpu" and (cpu := self._other_cpu()):
            out.append(cpu)
        return out

    def _other_cpu(self) -> str | None:
        """``CPU '<file's>' (running '<this one>')`` where the file names another CPU, else None."""
        return f"CPU {self.cpu!r} (running {cpu_name()!r})" if self.cpu is not None and self.cpu != cpu_name() else None


@attrs.frozen
class RunningSetup:
    """What runs, for :func:`measured_costs` to tell a fitted file's timings from this machine's."""

    runtime: str
    dtype: str | None = None
    isa: str | None = None


class CostSource:
    """The engine's ``measure`` for :meth:`TreePolicy.bind_costs`: calling it returns the runtime's
    measured cost table (or None); ``running`` says what runs (a plain callable works too)."""

    def __init__(self, measure: Callable[[], Any], running: RunningSetup) -> None:
        self.measure, self.running = measure, running

    def __call__(self) -> Any:
        return self.measure()


def warn_if_fitted_elsewhere(policy_name: str, origins: Sequence[ProfileOrigin], *, target: str | None,
                             drafter: str | None, device: str) -> str | None:
    """Log one line (once per process for the same message) when a file the policy reads was fitted
    on another target, head, device or CPU, naming what differs and how to measure this one
    (``adaptivespec calibrate``); returns the line, or None when everything matches."""
    groups: dict[tuple[str, ...], list[str]] = {}  # the same differences: the files named together
    for o in origins:
        diff = o.differences(target, drafter, device)
        if diff:
            groups.setdefault(tuple(diff), []).append(f"{o.key} ({Path(o.path).name})")
    if not groups:
        return None
    parts = [f"{' and '.join(files)} {'was' if len(files) == 1 else 'were'} fitted on {', '.join(diff)}"
             for diff, files in groups.items()]
    fixes = [o.key for o in origins if o.key in ("policy.profile", "policy.prior")] or ["policy.profile"]
    head = f" --drafter {drafter}" if drafter is not None else ""
    line = (f"policy {policy_name}: {'; '.join(parts)}: its choices are priced for that setup (still lossless); "
            f"measure this one with `adaptivespec calibrate --config CONFIG --target {target}{head} --out profile.json "
            f"--prior-out prior.json` and set {' / '.join(dict.fromkeys(fixes))} to what it writes")
    _say_once(line)
    return line


def _say_once(line: str) -> None:
    if line not in _warned:
        _warned.add(line)
        log.warning("adaptivespec: %s", line)


COST_SOURCES = ("auto", "measured", "profile")
"""Values of ``policy.costs``: what a cost-pricing policy prices steps with."""
MEASURED_SOURCE = "measured batch cost table"
"""``meta["source"]`` of a cost model made from a measured table (:meth:`CostModel.from_table`)."""


def measured_costs(policy_name: str, mode: str, origin: ProfileOrigin, measure: Callable[[], Any], device: str, *,
                   topk: int, rows: int, context_ref: float = 256.0) -> "CostModel | None":
    """The cost model of this machine's measured cost table when ``policy.costs`` (``mode``) asks
    for it, else None (price with the fitted file ``origin``).

    ``profile``: None. ``measured``: the table's model (:meth:`CostModel.from_table`). ``auto``:
    the table's model when the file's timings are another machine's (on a ``cpu`` device: another
    CPU name, or where ``measure.running`` says, another runtime, dtype or ISA level:
    :meth:`ProfileOrigin.timed_elsewhere`), else None. ``measure()`` returns the table or None (a runtime that cannot
    measure one: the file is kept, said once); the switch away from the file is said once too."""
    elsewhere = origin.timed_elsewhere(getattr(measure, "running", None)) if device.split(":")[0] == "cpu" else []
    if mode == "profile" or (mode == "auto" and not elsewhere):
        return None
    table = measure()
    name = Path(origin.path).name
    if table is None:
        _say_once(f"policy {policy_name}: costs: {mode}: this runtime measures no cost table; "
                  f"pricing steps with {origin.key} ({name})")
        return None
    if mode == "auto":
        _say_once(f"policy {policy_name}: {origin.key} ({name}) was fitted on {', '.join(elsewhere)}: "
                  f"pricing steps with this machine's measured cost table instead (policy.costs: auto; "
                  f"policy.costs: profile keeps the file)")
    return CostModel.from_table(table, topk=topk, rows=rows, context_ref=context_ref)


# -- cost model ------------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class CostModel:
    """Step time in milliseconds, linear in what the step does (see the module docstring)."""

    fixed: float
    per_context: float = 0.0
    per_draft_level: float = 0.0
    per_draft_node: float = 0.0
    per_verified_token: float = 0.0
    per_verified_token_context: float = 0.0
    """Extra milliseconds per verified token per committed position (attention over the context)."""
    tree_step: float = 0.0
    """Extra milliseconds of a verify of two or more rows over the line through one row (llama.cpp on a
    CPU: its second row costs nearly a first); what a plain step saves beside a tree."""
    context_ref: float = 256.0
    """Typical committed context (positions) when a caller does not know ``P``."""
    meta: dict[str, Any] = attrs.field(factory=dict, eq=False)
    """Everything else the profile file holds (machine, model, fit error, command)."""

    def step_ms(self, verified: float, levels: float = 0, nodes: float = 0, context: float | None = None) -> float:
        P = self.context_ref if context is None else context
        return (self.fixed + self.per_context * P + self.per_draft_level * levels
                + self.per_draft_node * nodes + self.token_ms(P) * verified + self.tree_step * (np.asarray(verified) >= 2))

    def token_ms(self, context: float | None = None) -> float:
        """Cost of one more verified token at ``context`` committed positions (default ``context_ref``)."""
        P = self.context_ref if context is None else context
        return self.per_verified_token + self.per_verified_token_context * P

    def base_ms(self, context: float | None = None) -> float:
        """Fixed part of a step: nothing drafted below depth 1, nothing verified."""
        return self.step_ms(0, 0, 0, context)

    @classmethod
    def fit(cls, rows: Sequence[Sequence[float]], **meta: Any) -> "CostModel":
        """Least squares over rows ``(P, L, E, n, step_ms)`` (and the product ``n * P``); terms no
        row varies are fixed at 0.

        Adds ``fit`` (mean and max relative error, rows) to ``meta``.
        """
        if len(rows) < 2:
            raise AdaptiveSpecError(f"cost model: need at least 2 timed steps to fit, got {len(rows)}")
        data = torch.tensor([list(map(float, r)) for r in rows], dtype=torch.float64)
        X, y = torch.cat([data[:, :4], data[:, 3:4] * data[:, :1]], dim=1), data[:, 4]  # P, L, E, n, n * P
        # n * P varies with n alone when P does not: keep it only when the contexts differ enough
        spread = float(X[:, 0].max() - X[:, 0].min())
        varies = [j for j in range(5) if float(X[:, j].max() - X[:, j].min()) > 0 and (j < 4 or spread >= 256)]
        dropped, pinned = [], None
        while True:  # a negative cost per unit is noise (or collinearity): drop that term and refit
            A = torch.cat([torch.ones(len(rows), 1, dtype=torch.float64), X[:, varies]], dim=1)
            if pinned is None:
                sol = torch.linalg.lstsq(A, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
            else:  # the intercept held at its floor, the per-unit terms fitted to the rest
                rest = torch.linalg.lstsq(A[:, 1:], (y - pinned).unsqueeze(1), driver="gelsd").solution.squeeze(1)
                sol = torch.cat([torch.tensor([pinned], dtype=torch.float64), rest])
            if pinned is None and float(sol[0]) <= 0:
                # steps timed on a busy machine (a descheduled thread adds a whole time slice to a few of
                # them) can pull the intercept to or below zero, which no profile may hold (load refuses
                # it): keep it at 1 % of the median step, the bound a constrained fit would reach
                pinned = 0.01 * float(y.median())
                continue
            if not varies or float(sol[1:].min()) >= 0:
                break
            worst = int(sol[1:].argmin())
            dropped.append(COST_TERMS[1 + varies.pop(worst)])
        coef = [0.0] * len(COST_TERMS)
        coef[0] = float(sol[0])
        for i, j in enumerate(varies):
            coef[1 + j] = float(sol[1 + i])
        rel = ((A @ sol - y) / y).abs()
        meta = dict(meta)
        meta["fit"] = {"mean_abs_rel_error": float(rel.mean()), "max_abs_rel_error": float(rel.max()), "steps": len(rows),
                       "dropped_negative_terms": dropped}
        if pinned is not None:
            meta["fit"]["fixed_pinned_ms"] = pinned  # the free fit put the intercept at or below 0
        return cls(**dict(zip(COST_TERMS, coef)), context_ref=float(X[:, 0].median()), meta=meta)

    @classmethod
    def from_table(cls, table: Any, *, topk: int, rows: int = 64, context_ref: float = 256.0) -> "CostModel":
        """The single-request model of a measured cost table (:class:`~adaptivespec.fastpath.costs.CostTable`,
        read duck-typed: ``verify(rows, context)``, ``contexts``, ``draft_level(rows)``, ``draft_rows``,
        ``machine``), measured on the machine that runs.

        The verify forward is taken as one row's cost at ``rows`` = 1 and, from two rows on, the line
        through ``rows`` = 2 and ``rows`` at each of the table's two contexts (the rows a single
        request's tree uses); where two rows cost more than that line says one more row should
        (llama.cpp on a CPU), the difference is ``tree_step`` (the mean of the two contexts'). The context terms come from how the line moves
        between the contexts, so ``step_ms(n, context=P)`` is the table's ``verify(n, P)`` at ``n`` = 1
        and ``rows`` for every ``P`` (and at 2, up to the two contexts' ``tree_step`` differing), plus
        one draft-head forward of one row (the root's, which every step runs: in ``fixed`` as in a
        calibrated profile). A draft level forwards the beam, ``topk`` rows: ``per_draft_level +
        topk * per_draft_node`` is ``draft_level(topk)``, ``per_draft_node`` the slope from 1 row to
        ``topk``. A term the table makes negative is 0, ``fixed`` at least 1 % of the one-row verify.
        ``context_ref``: the context assumed where a caller gives none."""
        R = max(3, int(rows))
        c0, c1 = (float(c) for c in table.contexts)
        one = [float(table.verify(1, c)) for c in (c0, c1)]
        two = [float(table.verify(2, c)) for c in (c0, c1)]
        top = [float(table.verify(R, c)) for c in (c0, c1)]
        slope = [(t - w) / (R - 2) for w, t in zip(two, top)]  # ms per verified row from two rows on, per context
        jump = float(np.mean([max(w - s - o, 0.0) for o, w, s in zip(one, two, slope)]))  # two rows above the line
        at0 = [o - s for o, s in zip(one, slope)]  # the line at 0 rows
        span = c1 - c0
        token_ctx = (slope[1] - slope[0]) / span
        ctx = (at0[1] - at0[0]) / span
        draft = bool(getattr(table, "draft_rows", ())) and topk >= 1
        d1 = float(table.draft_level(1)) if draft else 0.0
        dk = float(table.draft_level(topk)) if draft else 0.0
        node = (dk - d1) / (topk - 1) if draft and topk > 1 else 0.0
        terms = {"fixed": at0[0] - c0 * ctx + d1, "per_context": ctx, "per_draft_level": dk - topk * node,
                 "per_draft_node": node, "per_verified_token": slope[0] - c0 * token_ctx,
                 "per_verified_token_context": token_ctx, "tree_step": jump}
        terms = {k: max(v, 0.0) for k, v in terms.items()}
        terms["fixed"] = max(terms["fixed"], 0.01 * one[0])
        machine = dict(getattr(table, "machine", None) or {})
        meta = {"source": MEASURED_SOURCE, "machine": machine, "model": {"target": machine.get("target")},
                "table": {"contexts": [c0, c1], "rows": R, "topk": topk}}
        return cls(**terms, context_ref=float(context_ref), meta=meta)

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, **self.meta, "coefficients_ms": {k: getattr(self, k) for k in COST_TERMS},
                "context_ref": self.context_ref}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            data = json.loads(Path(path).read_text())
            coef = data["coefficients_ms"]
            values = {k: float(coef.get(k, 0.0)) for k in COST_TERMS}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a cost profile (expected JSON with coefficients_ms: {exc})") from None
        if not all(math.isfinite(v) for v in values.values()) or values["fixed"] <= 0:
            raise ValueError(f"{path}: cost profile coefficients must be finite and fixed > 0, got {values}")
        meta = {k: v for k, v in data.items() if k not in ("coefficients_ms", "context_ref", "format")}
        return cls(**values, context_ref=float(data.get("context_ref", 256.0)), meta=meta)


# -- calibration map -------------------------------------------------------------------------------
def _np(x: Any) -> np.ndarray:
    """A host numpy view of a tensor (a copy from an accelerator), or ``x`` as an array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class CalibrationMap:
    """P(accepted | depth, cumulative draft log-prob bin), online, from a prior.

    Cells are ``[max_depth + 1, bins]`` (row 0, the root, unused; deeper nodes use the last row).
    ``value = (acc + w * prior) / (n + w)`` per cell, where ``acc`` / ``n`` are decayed counts of
    accepted / verified nodes and ``w`` the prior's weight in pseudo-observations; then made
    monotone (cumulative max towards likelier bins, cumulative min down the depths).

    The map is a few dozen cells, so it lives on the host as numpy arrays: each call costs
    microseconds where a chain of small device ops would cost tens of them. Inputs may be tensors
    (copied to the host: one transfer per call on an accelerator) or arrays.
    """

    def __init__(self, prior: Any, *, prior_weight: float = 8.0, decay: float = 1.0,
                 edges: Sequence[float] = LOGP_EDGES) -> None:
        self.edges = np.array(sorted(-e for e in edges), dtype=np.float64)  # ascending -logp
        self.bins = len(edges) + 1
        prior = _np(prior).astype(np.float64)
        if prior.ndim != 2 or prior.shape[1] != self.bins or prior.shape[0] < 2:
            raise ValueError(f"calibration prior: expected [depths + 1, {self.bins}] values, got {list(prior.shape)}")
        self.prior = prior.clip(0.0, 1.0)
        self.max_depth = prior.shape[0] - 1
        self.prior_weight, self.decay = float(prior_weight), float(decay)
        self.reset()

    def reset(self) -> None:
        """Forget every observation (back to the prior)."""
        self.acc = np.zeros(self.prior.shape)
        self.n = np.zeros(self.prior.shape)
        self.rel = np.zeros((3, RELIABILITY_BINS))  # count, sum predicted, sum accepted
        self._table: np.ndarray | None = None

    def cells(self, depth: Any, logp: Any) -> np.ndarray:
        """Flat cell index of nodes at ``depth`` (array-like or one int) with cumulative log-prob ``logp``."""
        b = self.edges.searchsorted(-_np(logp).astype(np.float64), side="left")
        if isinstance(depth, int):
            return min(max(depth, 1), self.max_depth) * self.bins + b
        d = np.minimum(np.maximum(_np(depth), 1), self.max_depth)
        return d * self.bins + b

    def table(self) -> np.ndarray:
        """[depths + 1, bins] monotone values (cached until the next update)."""
        if self._table is None:
            w = self.prior_weight
            v = (self.acc + w * self.prior) / (self.n + w)
            v = np.maximum.accumulate(v[:, ::-1], axis=1)[:, ::-1]  # likelier bin >= less likely
            v[1:] = np.minimum.accumulate(v[1:], axis=0)  # deeper <= shallower
            self._table = np.ascontiguousarray(v)
        return self._table

    def values(self, depth: Any, logp: Any) -> np.ndarray:
        return self.table().ravel()[self.cells(depth, logp)]

    def update(self, depth: Any, logp: Any, accepted: Any) -> None:
        """One verify result: ``depth``/``logp`` of every verified drafted node, ``accepted`` [bool]
        whether it was on the accepted path."""
        idx = self.cells(depth, logp)
        pred = self.table().ravel()[idx]
        hit = _np(accepted).astype(np.float64)
        if self.decay < 1.0:
            self.acc *= self.decay
            self.n *= self.decay
        size = self.n.size
        self.n += np.bincount(idx, minlength=size).reshape(self.n.shape)
        self.acc += np.bincount(idx, weights=hit, minlength=size).reshape(self.n.shape)
        rb = np.minimum((pred * RELIABILITY_BINS).astype(np.int64), RELIABILITY_BINS - 1)
        self.rel[0] += np.bincount(rb, minlength=RELIABILITY_BINS)
        self.rel[1] += np.bincount(rb, weights=pred, minlength=RELIABILITY_BINS)
        self.rel[2] += np.bincount(rb, weights=hit, minlength=RELIABILITY_BINS)
        self._table = None

    def reliability(self) -> dict[str, Any]:
        """Predicted vs observed acceptance per bin of predicted value, and the expected
        calibration error (count-weighted mean |predicted - observed|), over every update."""
        n, p, a = self.rel
        total = float(n.sum())
        ece = float(np.abs(p - a).sum() / total) if total else None
        return {
            "bins": [[i / RELIABILITY_BINS, (i + 1) / RELIABILITY_BINS] for i in range(RELIABILITY_BINS)],
            "count": [int(c) for c in n],
            "predicted": [float(p[i] / n[i]) if n[i] > 0 else None for i in range(RELIABILITY_BINS)],
            "observed": [float(a[i] / n[i]) if n[i] > 0 else None for i in range(RELIABILITY_BINS)],
            "ece": ece,
            "nodes": int(total),
        }

    # -- prior files -------------------------------------------------------------------------------
    @staticmethod
    def prior_from_counts(acc: Any, n: Any, fallback: float = 0.0) -> np.ndarray:
        acc, n = _np(acc).astype(np.float64), _np(n).astype(np.float64)
        return np.where(n > 0, acc / np.maximum(n, 1e-12), fallback)

    @classmethod
    def load(cls, path: str | Path, **kw: Any) -> "CalibrationMap":
        try:
            data = json.loads(Path(path).read_text())
            prior = np.array(data["values"], dtype=np.float64)
            edges = tuple(float(e) for e in data["logp_edges"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a calibration prior (expected JSON with values, logp_edges: {exc})") from None
        return cls(prior, edges=edges, **kw)


def save_prior(path: str | Path, acc: Any, n: Any, shrink: float = 4.0, **meta: Any) -> None:
    """Write a calibration prior from accepted / verified counts per (depth, bin) cell.

    Sparse cells are shrunk towards their bin's rate over all depths (``shrink`` pseudo-counts):
    acceptance depends mostly on the cumulative probability, and deep cells see few nodes."""
    acc, n = _np(acc).astype(np.float64), _np(n).astype(np.float64)
    pooled = CalibrationMap.prior_from_counts(acc[1:].sum(0), n[1:].sum(0))
    values = (acc + shrink * pooled[None, :]) / (n + shrink) if shrink > 0 else CalibrationMap.prior_from_counts(acc, n)
    doc = {"format": 1, **meta, "logp_edges": list(LOGP_EDGES), "values": [[round(float(x), 5) for x in row] for row in values],
           "counts": [[int(x) for x in row] for row in n]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc) + "\n")


# -- ranking ---------------------------------------------------------------------------------------
def rank_by_value(
    values: Any,
    *,
    base_ms: float,
    per_token_ms: float,
    min_keep: int = 0,
    max_keep: int | None = None,
    forced: Any = None,
    ancestors: Any = None,
    tree_ms: float = 0.0,
) -> tuple[np.ndarray, int, float]:
    """Which candidates to verify: ``(order, k, rate)``; verify ``order[:k]``.

    ``values``: [c] expected accepted tokens of each candidate (calibrated acceptance). The step
    emits ``1 + sum(values)`` tokens in expectation and costs ``base_ms + per_token_ms * (k + 1)``
    (the root is verified too), plus ``tree_ms`` when ``k >= 1`` (:attr:`CostModel.tree_step`), so
    the best ``k`` maximises that ratio over prefixes of the ranking by value: a candidate is worth verifying while its value exceeds ``per_token_ms`` times the
    tokens per millisecond already reached (the marginal cost of one more verified token).
    ``forced`` [c] bool: candidates ranked first whatever their value (the root's best children);
    ``min_keep <= k <= max_keep``. ``ancestors`` [c, c] bool (optional, for candidate sets whose
    values are not already monotone along paths): each value is first replaced by the smallest on
    its path, so every prefix of the ranking is closed under ancestors when candidates are in
    topological order (ties keep candidate order). ``rate``: expected tokens per ms at ``k``.
    Works on host arrays (tensors are copied over: one transfer); ``order`` is a numpy array.
    """
    v = _np(values).astype(np.float64)
    c = v.shape[0]
    cap = c if max_keep is None else max(0, min(max_keep, c))
    alone = 1.0 / (base_ms + per_token_ms)
    if c == 0 or cap == 0:
        return np.zeros(0, dtype=np.int64), 0, alone
    if ancestors is not None:
        v = np.where(_np(ancestors), v[None, :], np.inf).min(-1)
    key = v if forced is None else v + 2.0 * _np(forced)  # values are <= 1: forced ones sort first
    order = np.argsort(-key, kind="stable")
    gain = 1.0 + np.cumsum(v[order])  # expected tokens with the first j + 1 candidates
    rate = gain / (base_ms + tree_ms + per_token_ms * np.arange(2, c + 2))
    lo = min(max(min_keep, 0), cap)
    if lo > 1:
        rate[: lo - 1] = -1.0
    rate[cap:] = -1.0
    j = int(rate.argmax())
    if lo == 0 and rate[j] <= alone:  # verifying nothing drafted is better
        return order, 0, alone
    return order, j + 1, float(rate[j])


# -- fitted path calibration (per depth, per source) ----------------------------------------------
DEFAULT_PATH_CALIBRATION = "post-draft-smollm2-135m-embedded.json"
"""Shipped path calibration of the embedded pair (``adaptivespec fit-post-draft``, training prompts)."""
HEAD = "head"
"""The draft head's name in a :class:`PathCalibration` (candidate sources go by their registered names)."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30.0, 30.0)))


def _logit(p: Any) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1.0 - 1e-6)
    return np.log(p / (1.0 - p))


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1.0, iters: int = 25) -> np.ndarray:
    """Weights ``w`` of ``P(y = 1 | x) = sigmoid(X @ w)`` by Newton's method with an L2 penalty
    ``l2`` (the intercept, column 0, unpenalised). ``X``: [n, f] with a column of ones first."""
    w = np.zeros(X.shape[1])
    reg = np.full(X.shape[1], l2)
    reg[0] = 1e-6
    for _ in range(iters):
        p = _sigmoid(X @ w)
        grad = X.T @ (p - y) + reg * w
        hess = (X * (p * (1.0 - p))[:, None]).T @ X + np.diag(reg)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def head_features(logp: Any, edge: Any) -> list:
    """Features of a drafted node: 1, its cumulative draft log-prob, the log-prob of its own edge."""
    return [np.ones_like(logp), logp, edge]


def source_features(score: Any) -> list:
    """Features of a source's candidate: 1, the log-odds of the source's own score."""
    return [np.ones_like(score), _logit(score)]


def expected_calibration_error(p: Any, y: Any, bins: int = RELIABILITY_BINS) -> tuple[float, dict[str, list]]:
    """Count-weighted mean |predicted - observed| over equal-width bins of the prediction, and the
    reliability table (per bin: count, mean predicted, observed rate)."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    b = np.minimum((p * bins).astype(np.int64), bins - 1)
    n = np.bincount(b, minlength=bins)
    sp = np.bincount(b, weights=p, minlength=bins)
    sy = np.bincount(b, weights=y, minlength=bins)
    ece = float(np.abs(sp - sy).sum() / max(n.sum(), 1))
    safe = np.maximum(n, 1)
    return ece, {"count": n.tolist(), "predicted": (sp / safe).tolist(), "observed": (sy / safe).tolist()}


@attrs.define(eq=False, kw_only=True)
class PathCalibration:
    """P(strict verification accepts the path to a node), fitted offline on training prompts, per
    depth and per proposer (``adaptivespec fit-post-draft``).

    One logistic regression per (proposer, depth): the head's drafted nodes on
    :func:`head_features` (cumulative and own-edge draft log-prob), a candidate source's on
    :func:`source_features` (its own score's log-odds); a depth deeper than the fitted ones uses
    the deepest. A source without a fit keeps its own score. ``continuation[d]``: the fitted
    probability that an accepted node at depth ``d - 1`` that was expanded has an accepted child
    (the look-ahead of the level rule). Nothing here learns online: the map does not drift with
    the traffic (docs/tuning.md, "Known problem")."""

    weights: dict[str, np.ndarray]
    """Proposer -> [depths, features] logistic weights (row ``d - 1``: depth ``d``)."""
    continuation: np.ndarray
    """[depths + 2] fitted continuation rate per depth index (0 and 1 unused)."""
    meta: dict[str, Any] = attrs.field(factory=dict)

    def head_values_np(self, depth: Any, logp: Any, edge: Any) -> np.ndarray:
        """Calibrated acceptance of drafted nodes (host arrays; ``depth`` one int or one per node)."""
        w = self.weights[HEAD]
        rows = w[np.minimum(np.maximum(np.asarray(depth), 1), w.shape[0]) - 1]
        X = np.stack(head_features(np.asarray(logp, dtype=np.float64), np.asarray(edge, dtype=np.float64)), -1)
        return _sigmoid((rows * X).sum(-1))

    def source_values(self, name: str, depth: Any, score: Any) -> np.ndarray | None:
        """Calibrated acceptance of a source's candidates (host arrays); None: no fit for ``name``."""
        w = self.weights.get(name)
        if w is None:
            return None
        rows = w[np.minimum(np.maximum(np.asarray(depth), 1), w.shape[0]) - 1]
        X = np.stack(source_features(np.asarray(score, dtype=np.float64)), -1)
        return _sigmoid((rows * X).sum(-1))

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, "kind": "path-calibration", **self.meta,
                "weights": {k: np.round(v, 6).tolist() for k, v in self.weights.items()},
                "continuation": np.round(self.continuation, 6).tolist()}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PathCalibration":
        try:
            data = json.loads(Path(path).read_text())
            weights = {k: np.array(v, dtype=np.float64) for k, v in data["weights"].items()}
            cont = np.array(data["continuation"], dtype=np.float64)
            if data.get("kind") != "path-calibration" or HEAD not in weights or weights[HEAD].shape[1] != 3:
                raise ValueError("not a path calibration with head weights [depths, 3]")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"{path}: not a path calibration (expected JSON from `adaptivespec fit-post-draft`: {exc})") from None
        meta = {k: v for k, v in data.items() if k not in ("weights", "continuation", "format", "kind")}
        return cls(weights=weights, continuation=cont, meta=meta)
