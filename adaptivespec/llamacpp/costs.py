"""What a step costs on this runtime, measured here: a :class:`~adaptivespec.fastpath.costs.CostTable`
of llama.cpp's decode by rows and of the head's draft level, for the policies that price steps.

A tree pays only where its extra rows cost little beside the first. On llama.cpp that depends on
the file's type and the CPU (``llama-bench`` on an AVX2 EPYC, 2 threads: 16 rows cost 4.7x one row
on Q8_0, 9x on Q4_1), so the table is measured per file, thread count and CPU (~10-20 s, once) and
cached beside the torch runtime's (``<cache>/costs/``); ``cost_aware``'s ``costs: auto`` reads it
through :meth:`~adaptivespec.llamacpp.runtime.LlamaCppRuntime.cost_table`.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import attrs
import numpy as np
import torch

from adaptivespec import hardware
from adaptivespec.costmodel import cpu_name
from adaptivespec.fastpath.costs import VERSION, CostTable, _best_ms, _monotone
from adaptivespec.paths import cache_dir

ROWS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts the verify decode is measured at (a tree's, not a batch's: linear in between and beyond)."""
DRAFT_ROWS = (1, 4, 8, 16)
CONTEXTS = (128, 1024)


def machine_key(rt) -> dict:
    """What the table holds for: another file, thread count, head dtype, CPU or binding measures again."""
    from adaptivespec.llamacpp.binding import lib

    path = rt.model.path
    return {"cpu": cpu_name(), "isa": hardware.isa(), "target": f"{path.name}:{path.stat().st_size}", "runtime": "llamacpp",
            "binding": lib().version, "threads": rt.threads,
            "dtype": str(rt.dtype).removeprefix("torch.") if rt.drafter is not None else "none"}


def cost_path(key: dict) -> Path:
    """Where the table for ``key`` is cached: ``<cache>/costs/<cpu>-<isa>-llamacpp-<file>-<head dtype>-t<threads>.json``."""
    slug = "-".join(re.sub(r"[^A-Za-z0-9]+", "_", str(key[k])).strip("_") for k in ("cpu", "isa", "runtime", "target", "dtype"))
    return cache_dir() / "costs" / f"{slug}-t{key['threads']}.json"


@torch.inference_mode()
def measure(rt, reps: int = 3) -> CostTable:
    """Decode ``ROWS`` rows (a chain on seq 0) after each of ``CONTEXTS`` cached positions, and one
    head level of ``DRAFT_ROWS`` rows; the fastest of ``reps`` each (another process only adds time).
    Leaves the runtime's cache empty (the next prefill starts afresh)."""
    rt.reserve(CONTEXTS[-1] + ROWS[-1])
    ctx = rt.ctx
    short: list[float] = []
    long: list[float] = []
    for c, out in zip(CONTEXTS, (short, long)):
        ctx.clear()
        for start in range(0, c, ctx.n_batch):
            end = min(c, start + ctx.n_batch)
            ctx.decode(np.full(end - start, 100), np.arange(start, end), None, False)
        for r in ROWS:
            def run(r=r, c=c):
                ctx.decode(np.full(r, 100), np.arange(c, c + r), None, True)
                ctx.seq_rm(0, c)  # the rows' cells freed: the next run takes the same ones

            out.append(_best_ms(run, reps))
    ctx.clear()
    short_m, long_m = _monotone(short, long)
    draft_rows: tuple[int, ...] = ()
    draft: list[float] = []
    d = rt.drafter
    if d is not None:
        c = CONTEXTS[0]
        d.reset_cache(capacity=c + DRAFT_ROWS[-1] + 1)
        d.length = 0
        d.step(torch.full((c,), 100), torch.zeros(c, d.config.hidden_size, dtype=rt.dtype), torch.arange(c), None)
        for r in DRAFT_ROWS:
            mask = torch.zeros(1, 1, r, c + r, dtype=rt.dtype)

            def level(r=r, mask=mask):
                d.length = c
                d.log_probs(d.step(torch.full((r,), 100), torch.zeros(r, d.config.hidden_size, dtype=rt.dtype),
                                   torch.full((r,), c), mask))

            draft.append(_best_ms(level, reps))
        d.length = 0
        draft_rows = DRAFT_ROWS
    return CostTable(rows=ROWS, verify_short=short_m, verify_long=long_m, contexts=CONTEXTS, per_request=0.0,
                     draft_rows=draft_rows, draft=tuple(float(x) for x in np.maximum.accumulate(draft)) if draft else ())


def load_or_measure(rt, log=print) -> CostTable:
    """The cached table for this file, CPU, threads and head, or a fresh one (measured, then cached)."""
    key = machine_key(rt)
    path = cost_path(key)
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
            table = CostTable.from_dict(raw)
            if raw.get("version") == VERSION and table.machine == key:
                return table
        except (ValueError, TypeError, KeyError):
            pass  # an older or damaged file: measure again
    t0 = time.perf_counter()
    table = attrs.evolve(measure(rt), machine=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_dict(), indent=1))
    log(f"adaptivespec: llamacpp costs measured in {time.perf_counter() - t0:.1f} s ({table.summary()}); cached in {path}")
    return table
