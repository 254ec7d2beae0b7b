"""The served worker's per-step trace file (``adaptivespec serve --trace``). No sglang import."""

from __future__ import annotations

import json
import os
from typing import Any

from adaptivespec.sglang import TRACE_ENV


class StepTrace:
    """JSON lines, one per observed decode step, appended to the file ``ADAPTIVESPEC_SGLANG_TRACE``
    names (``adaptivespec serve --trace``): ``{"step", "shape": [nsteps, topk, ndt], "rows", "bs",
    "accepted", "ms", "gap_ms", "policy"}`` (``rows``: tokens verified per request, ``ndt`` or a
    merged tree's width (the draft stage's candidates added) or 1 (no drafting); ``accepted``: drafted tokens accepted, reduced over the
    batch as the policy sees it; ``ms``: host time from the shape's choice to the accept lengths,
    the draft and verify of the step; ``gap_ms``: from the previous step's accept lengths to this
    step's start when the batch is the same, i.e. the rest of the previous step -- its draft
    extension and the scheduler --, else null; ``shape`` ``[0, 0, 1]``: a step the load controls ran
    without drafting). Line-buffered: a reader sees every finished step."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get(TRACE_ENV, "").strip()
        return cls(path) if path else None

    def write(self, record, batch_size: int, gap_ms: float | None = None) -> None:
        s = record.shape
        shape = [s.nsteps, s.topk, s.ndt] if s is not None else [0, 0, 1]  # None: a step that drafted nothing
        line = {"step": record.step, "shape": shape, "rows": record.tree_size, "bs": batch_size, "accepted": record.accepted,
                "ms": round(record.verify_ms, 3), "gap_ms": None if gap_ms is None else round(gap_ms, 3),
                "policy": {k: v for k, v in (record.policy_state or {}).items() if _plain(v)}}
        sig = record.signals
        if sig is not None:  # what the policy saw at the root (entropy 0: not measured for this policy)
            line["signals"] = {"p1": round(sig.draft_top1_prob, 4), "entropy": round(sig.draft_entropy, 4),
                               "top4": round(sig.draft_top4_prob, 4)}
        self._file.write(json.dumps(line) + "\n")


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
