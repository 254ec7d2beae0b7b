"""Per-step traces: JSONL records written by ``generate --trace`` and their plot."""

from __future__ import annotations

import json
from pathlib import Path

from adaptivespec.errors import AdaptiveSpecError


def read_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise AdaptiveSpecError(f"plot-trace: {path}: file not found")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise AdaptiveSpecError(f"plot-trace: {path}:{n}: invalid JSON ({exc.msg})") from None
    if not rows:
        raise AdaptiveSpecError(f"plot-trace: {path}: no step records (was it written by generate --trace with a drafter?)")
    return rows


def plot_trace(path: str | Path, output: str | Path) -> None:
    """Draw the tree shape (nsteps, topk, ndt) and the accepted length over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_trace(path) if r.get("shape")]
    if not rows:
        raise AdaptiveSpecError(f"plot-trace: {path}: no speculative steps (autoregressive trace?)")
    x = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for i, label in enumerate(("nsteps (depth)", "topk (branching)", "ndt (verified)")):
        ax1.step(x, [r["shape"][i] for r in rows], where="mid", label=label)
    ax1.set_ylabel("tree shape")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.bar(x, [r["accepted"] for r in rows], color="tab:green", label="accepted drafted tokens")
    promoted = [r.get("promoted", 0) for r in rows]
    if any(promoted):
        ax2.bar(x, promoted, color="tab:red", label="of which promoted")
    dcs = [r.get("policy_state", {}).get("dcs") for r in rows]
    if any(v is not None for v in dcs):
        ax3 = ax2.twinx()
        ax3.plot(x, [v if v is not None else float("nan") for v in dcs], color="tab:purple", lw=1, label="DCS")
        ax3.set_ylim(0, 1.05)
        ax3.set_ylabel("DCS")
    ax2.set_xlabel("decode step")
    ax2.set_ylabel("accepted")
    ax2.legend(loc="upper left", fontsize=8)
    ids = {r.get("id") for r in rows}
    fig.suptitle(f"{Path(path).name}: {len(rows)} steps" + (f", {len(ids)} prompts" if len(ids) > 1 else ""))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
