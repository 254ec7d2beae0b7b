"""The card's two plots of a fitted shape model, replayed on held-out prompts.

* ``choices.png``: the shape the model chose at every step (hedge off) against what it read: the
  draft's top-1 probability at the root (x) and the accepted-length EMA (y), one colour per shape.
* ``vs_oracle.png``: per held-out prompt, realised tokens per step and tokens per modelled second
  of the learned policy beside the best static shape (chosen on the training prompts) and the
  per-step oracle (which knows the future).
"""

from __future__ import annotations

from pathlib import Path

from adaptivespec.costmodel import CostModel
from adaptivespec.learned_model import ShapeModel
from adaptivespec.policies.learned import LearnedParams, LearnedPolicy
from adaptivespec.training.policy_fit import Fitter, Prompts, oracle_path, replay_policy, walk
from adaptivespec.types import TreeShape


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def per_prompt(H: Prompts, cost: CostModel, model: ShapeModel, static: TreeShape) -> dict[str, list]:
    """Per held-out prompt: (tokens per step, tokens per modelled second) of learned, static, oracle;
    and every learned step's (p1, ema, shape)."""
    f = Fitter(H, cost)
    steps: dict[int, int] = {}
    ms: dict[int, float] = {}
    choices = []
    pol = LearnedPolicy(LearnedParams(hedge=False), model)

    def on_step(k, signals, shape, a):
        steps[k] = steps.get(k, 0) + 1
        ms[k] = ms.get(k, 0.0) + model.shape_ms(shape, signals.context, signals.source_nodes)
        choices.append((signals.draft_top1_prob, pol.state()["ema_accept"], str(shape)))

    replay_policy(pol, H, cost, on_step)
    out: dict[str, list] = {"learned": [], "static": [], "oracle": [], "choices": choices}
    cols = list(range(len(H.shapes)))
    for k, it in enumerate(H.items):
        n = it["A"].shape[0]
        out["learned"].append((n / steps[k], 1000 * n / ms[k]))
        t, st = walk(H, it, lambda i, h: H.col[static], f.T[k])
        out["static"].append((n / len(st), 1000 * n / t))
        acc = [{c: int(it["A"][i, c]) for c in cols} for i in range(n)]
        t, n_steps = oracle_path(acc, f.T[k], cols)
        out["oracle"].append((n / n_steps, 1000 * n / t))
    return out


def plot(H: Prompts, cost: CostModel, model: ShapeModel, static: TreeShape, folder: Path, tag: str) -> list[Path]:
    """Write ``<tag>-choices.png`` and ``<tag>-vs_oracle.png`` under ``folder``; returns their paths."""
    plt = _plt()
    data = per_prompt(H, cost, model, static)
    paths = [Path(folder) / f"{tag}-choices.png", Path(folder) / f"{tag}-vs_oracle.png"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for name in sorted({c[2] for c in data["choices"]}):
        pts = [(p, e) for p, e, s in data["choices"] if s == name]
        ax.scatter([p for p, _ in pts], [e for _, e in pts], s=8, alpha=0.6, label=f"{name} ({len(pts)})")
    ax.set_xlabel("draft top-1 probability at the root")
    ax.set_ylabel("accepted-length EMA")
    ax.set_title(f"{tag}: shape chosen per step (held-out prompts, hedge off)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(len(H.items)))
    for j, label in enumerate(("tokens per step", "tokens per modelled second")):
        for name, style in (("oracle", "^"), ("learned", "o"), ("static", "s")):
            axes[j].plot(x, [v[j] for v in data[name]], style, label=name if name != "static" else f"static {static}")
        axes[j].set_xlabel("held-out prompt")
        axes[j].set_ylabel(label)
        axes[j].legend(fontsize=8)
    fig.suptitle(f"{tag}: realised vs the per-step oracle")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
