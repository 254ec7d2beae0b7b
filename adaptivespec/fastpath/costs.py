"""What a step costs on the machine it runs on, measured: :class:`CostTable`.

The packed target forward by rows at two context lengths plus a per-request term, and one
draft-head level by rows, measured here and now (never shipped: a table measured on another CPU
prices rows wrongly) by ``adaptivespec calibrate --batch``, at the batch engine's start-up or when
a policy prices its steps with measured costs (``policy.costs``), and cached per CPU model, target,
dtype and thread count (:func:`cost_path`). The batch engine's row budget spends rows by it
(:mod:`adaptivespec.batch.budget`, which re-exports these names); the torch runtime hands it to a
tree policy (:meth:`~adaptivespec.runtime.TorchRuntime.cost_table`), which turns it into a
single-request :class:`~adaptivespec.costmodel.CostModel` (:meth:`~adaptivespec.costmodel.CostModel.from_table`).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Sequence

import attrs
import numpy as np
import torch

from adaptivespec import hardware
from adaptivespec.costmodel import cpu_name
from adaptivespec.fastpath.batched import DraftKV, DraftPart, KVSlab, Part, bound, layer_pieces, packed_draft_step, packed_forward
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.models import cache_dir

ROWS = (1, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Row counts the verify cost is measured at (linear in between, the last slope beyond)."""
DRAFT_ROWS = (1, 8, 32, 64, 128)
CONTEXTS = (128, 1024)
"""Cached keys per request the verify cost is measured at (linear in between and beyond)."""
VERSION = 2
"""Tables of an older version are measured again (2: attention by SGLang's kernels where installed;
the fastest of repeats, monotone)."""


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
def machine_key(target_name: str, dtype: str) -> dict:
    """What a cost table holds for: a table measured under another key is measured again (the
    attention path too: the bf16 kernel changes what a row costs at long context; in float32 the
    matmul, ``linear``: our kernel makes 2-16 rows cost about what one does, MKL's sgemm 2-3x)."""
    from adaptivespec.fastpath.native import attention_ops, f32_linear_ops

    attention = "kernel" if dtype == "bfloat16" and attention_ops() is not None else "sdpa"
    key = {"cpu": cpu_name(), "isa": hardware.isa(), "target": target_name, "dtype": dtype,
           "threads": torch.get_num_threads(), "torch": torch.__version__.split("+")[0], "attention": attention}
    if dtype == "float32":
        key["linear"] = "kernel" if f32_linear_ops() is not None else "torch"
    return key


def cost_path(key: dict) -> Path:
    """Where the table for ``key`` is cached: ``<cache>/costs/<cpu>-<target>-<dtype>-t<threads>.json``."""
    slug = "-".join(re.sub(r"[^A-Za-z0-9]+", "_", str(key[k])).strip("_") for k in ("cpu", "isa", "target", "dtype") if k in key)
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
        packed_forward(pieces, ids, pos, parts, torch.arange(R, device=device), slab=slab,
                       hidden=[i + 1 for i in drafter.aux_layers] if drafter is not None else False)

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

