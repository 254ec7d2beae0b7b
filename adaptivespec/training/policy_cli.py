"""``adaptivespec train-policy``: counterfactual labels on training prompts, fit, held-out card.

Output folder ``--out``::

    labels/<prompt id>.pt        counterfactual labels per prompt (resumable: existing ones are kept)
    learned-<model>.json         the fitted file of the head-only policy (configs/learned.yaml)
    learned-hybrid-<model>.json  the fitted file with the retrieval source (configs/learned-hybrid.yaml)
    card.md, card.json           data, features, shape sets and held-out figures

Every ``--heldout-every``-th prompt (interleaved across the training files) is held out: it is
labelled but never fitted on, and the card's figures are replays on those prompts, priced by the
calibrated cost model (``--profile``). Training prompts only: evaluation sets are refused.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from adaptivespec.config import load_config
from adaptivespec.costmodel import DEFAULT_COST_PROFILE, CostModel, resolve_profile
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.learned_model import BASIS, FEATURES, ShapeModel
from adaptivespec.plugins import get_plugin_host
from adaptivespec.training.data import DATA_ROOT
from adaptivespec.training.policy_data import DEFAULT_DATA, build_labels, kind_of, load_labels, pick_prompts
from adaptivespec.types import TreeShape
from adaptivespec.training.policy_fit import TRAJECTORY_SHAPES, Fitter, Prompts, evaluate, fitted_file
from adaptivespec.training.policy_plots import plot

MODEL_TAG = "smollm2-135m-embedded"
DCS_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "adaptivespec-dynamic.yaml"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-policy", help="fit the learned tree-shape policy on counterfactual labels",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--out", required=True, type=Path, help="output folder (labels/, fitted files, card)")
    a("--data", nargs="+", default=list(DEFAULT_DATA), help="training prompts: 'reserved' (the broad-mix prompts the head "
      "never saw, corpus/reserved-ids.txt) and/or jsonl files (relative to --data-root, or paths)")
    a("--data-root", type=Path, default=DATA_ROOT, help="folder of the training files")
    a("--per-file", type=int, default=20, help="prompts drawn from each file (reserved: from each kind)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens labelled per prompt")
    a("--heldout-every", type=int, default=4, help="every N-th prompt of each file is held out (card figures)")
    a("--mode", choices=("head", "hybrid", "both"), default="both", help="which fitted files to write")
    a("--profile", help=f"cost profile (adaptivespec calibrate; default the shipped {DEFAULT_COST_PROFILE})")
    a("--max-shapes", type=int, default=8, help="most shapes in a fitted file's set (one bank executor each)")
    a("--label-budget", type=float, help="stop labelling after this many seconds (rerun to resume)")
    a("--labels-only", action="store_true", help="stop after labelling")
    a("--evaluate", nargs="+", type=Path, metavar="FITTED", help="fit nothing: replay these fitted files (e.g. the "
      "shipped ones in adaptivespec/profiles/) on the held-out prompts, labelling only those, and write their card")
    a("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def log(msg: str) -> None:
    print(f"train-policy: {msg}", flush=True)


def run(args) -> int:
    if args.per_file < 1 or args.heldout_every < 2 or args.max_shapes < 1:
        raise AdaptiveSpecError(f"--per-file, --max-shapes: expected >= 1 and --heldout-every >= 2, got "
                                f"{args.per_file}, {args.max_shapes}, {args.heldout_every}")
    prompts = pick_prompts(args.data, args.per_file, args.data_root)
    fitted_files = [_read_fitted(path) for path in args.evaluate or ()]
    held_out, seen = [], {}  # every N-th prompt of each kind
    for p in prompts:
        seen[kind_of(p.id)] = n = seen.get(kind_of(p.id), 0) + 1
        held_out.append(n % args.heldout_every == 0)
    train_p = [p for p, h in zip(prompts, held_out) if not h]
    held_p = [p for p, h in zip(prompts, held_out) if h]
    to_label = held_p if fitted_files else prompts
    labels_dir = args.out / "labels"
    deadline = time.time() + args.label_budget if args.label_budget else None
    build_labels(labels_dir, to_label, args.max_new_tokens, progress=not args.no_progress, deadline=deadline)
    missing = [p.id for p in to_label if not (labels_dir / f"{p.id}.pt").is_file()]
    if missing:
        log(f"{len(missing)} of {len(to_label)} prompts still to label: run the same command again to resume")
        return 0
    if args.labels_only:
        return 0
    if fitted_files:
        return evaluate_files(args, fitted_files, load_labels(labels_dir, held_p))
    train, held = load_labels(labels_dir, train_p), load_labels(labels_dir, held_p)
    if not train or not held:
        raise AdaptiveSpecError(f"--per-file {args.per_file}: too few labelled prompts to fit and hold out "
                                f"({len(train)} training, {len(held)} held out)")
    cost, card = _new_card(args, train, held)
    modes = ("head", "hybrid") if args.mode == "both" else (args.mode,)
    for mode in modes:
        card["models"][mode] = fit_mode(mode, train, held, cost, args, card["data"])
    return _write_card(args, card)


def fit_mode(mode: str, train: list, held: list, cost: CostModel, args, data: dict) -> dict:
    t0 = time.time()
    P, H = Prompts(train, mode), Prompts(held, mode)
    f = Fitter(P, cost)
    for s in TRAJECTORY_SHAPES:
        c = P.col[TreeShape(*s)]
        f.add_rows(lambda k, c=c: (lambda i, h: c))
    f.fit()
    static = f.static_ms()
    best = int(static.argmin())
    log(f"{mode}: best static on the training prompts {P.shapes[best]}; selecting the shape set")
    cols = f.select(best, args.max_shapes, log=lambda m: log(f"{mode}: {m}"))
    f.add_rows(f.chooser(cols))  # DAgger: the policy's own histories
    f.fit()
    train_ms = f.tune_offsets(cols)
    name = f"learned-{MODEL_TAG}.json" if mode == "head" else f"learned-hybrid-{MODEL_TAG}.json"
    meta = {"model": MODEL_TAG, "target": "smollm2-135m-instruct", "drafter": "embedded",  # the labels' pair
            "machine": {"cpu": (cost.meta.get("machine") or {}).get("cpu")},  # where cost_ms was measured
            "data": {k: v for k, v in data.items() if not k.endswith("prompts")},
            "train_vs_best_static": float(static[best] / train_ms)}
    fitted = fitted_file(P, f, cols, best, cost, meta)
    dcs = _dcs_policy() if mode == "head" else None
    fig = evaluate(H, cost, fitted, H.col[P.shapes[best]], dcs)
    fitted["heldout"] = {k: fig[k]["vs_ref"] for k in fig if isinstance(fig[k], dict) and "vs_ref" in fig[k]}
    (args.out / name).write_text(json.dumps(fitted, indent=1) + "\n")
    plots = [p.name for p in plot(H, cost, ShapeModel(fitted, name), P.shapes[best], args.out, mode)]
    log(f"{mode}: held out: learned {fig['learned']['vs_ref']:.3f}x the best static, oracle {fig['oracle']['vs_ref']:.3f}x "
        f"({time.time() - t0:.0f} s); wrote {args.out / name}")
    return {"file": name, "shapes": fitted["shapes"], "static": fitted["static"], "plots": plots,
            "train_vs_best_static": meta["train_vs_best_static"], "heldout": fig}


def _new_card(args, train: list[dict], held: list[dict]) -> tuple[CostModel, dict]:
    """The cost model (``--profile``) and a card without models yet: its data and features."""
    cost_path = resolve_profile(args.profile, DEFAULT_COST_PROFILE, "--profile")
    labels = train + held
    data = {"files": list(args.data), "per_file": args.per_file, "max_new_tokens": args.max_new_tokens,
            "train_prompts": [lab["id"] for lab in train], "heldout_prompts": [lab["id"] for lab in held],
            "train_positions": sum(lab["acc"].shape[0] for lab in train),
            "heldout_positions": sum(lab["acc"].shape[0] for lab in held),
            "labelled_shapes": len(labels[0]["shapes"]),
            "selfcheck_steps_equal": [sum(lab["selfcheck"][j] for lab in labels) for j in (0, 1)],
            "cost_profile": cost_path.name}
    return CostModel.load(cost_path), {"data": data, "features": list(FEATURES), "basis": list(BASIS), "models": {}}


def _write_card(args, card: dict) -> int:
    (args.out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    log(f"card: {args.out / 'card.md'}")
    return 0


def _read_fitted(path: Path) -> tuple[Path, dict]:
    try:
        fitted = json.loads(path.read_text())
        ShapeModel(fitted, str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdaptiveSpecError(f"--evaluate {path}: expected a fitted policy file (train-policy writes them): {exc}") from None
    if fitted.get("mode") not in ("head", "hybrid"):
        raise AdaptiveSpecError(f"--evaluate {path}: mode {fitted.get('mode')!r}, expected 'head' or 'hybrid'")
    return path, fitted


def evaluate_files(args, fitted_files: list[tuple[Path, dict]], held: list[dict]) -> int:
    """``--evaluate``: the card of already fitted files, replayed on the held-out prompts (per kind too)."""
    if not held:
        raise AdaptiveSpecError(f"--per-file {args.per_file}: no held-out prompt to replay on")
    cost, card = _new_card(args, [], held)
    for path, fitted in fitted_files:
        mode = fitted["mode"]
        H = Prompts(held, mode, extra_slots=int(fitted.get("extra_slots") or 8))
        static = TreeShape(*fitted["static"])
        dcs = _dcs_policy() if mode == "head" else None
        fig = evaluate(H, cost, fitted, H.col[static], dcs)
        plots = [p.name for p in plot(H, cost, ShapeModel(fitted, path.name), static, args.out, mode)]
        card["models"][mode] = {"file": str(path), "shapes": fitted["shapes"], "static": fitted["static"], "plots": plots,
                                "train_vs_best_static": fitted.get("train_vs_best_static", float("nan")), "heldout": fig}
        log(f"{mode}: {path.name} held out: learned {fig['learned']['vs_eagle3']:.3f}x (3,4,8), "
            f"oracle {fig['oracle']['vs_eagle3']:.3f}x")
    return _write_card(args, card)


def _dcs_policy():
    cfg = load_config(DCS_CONFIG, [])
    return get_plugin_host().policies.get(cfg.policy.name).cls(cfg.policy.params)


def card_markdown(card: dict) -> str:
    d = card["data"]
    lines = ["# Learned tree-shape policy: card", "",
             f"Data: {len(d['train_prompts'])} training + {len(d['heldout_prompts'])} held-out prompts "
             f"({d['per_file']} per file or kind of {', '.join(d['files'])}), {d['max_new_tokens']} greedy tokens each, "
             f"{d['train_positions']} + {d['heldout_positions']} positions, {d['labelled_shapes']} shapes labelled; "
             f"labels' self-check: {d['selfcheck_steps_equal'][1]}/{d['selfcheck_steps_equal'][0]} decoded steps predicted exactly. "
             f"Cost model: {d['cost_profile']}.", "",
             f"Features: {', '.join(card['features'])}; basis: {', '.join(card['basis'])}.", ""]
    for mode, m in card["models"].items():
        h = m["heldout"]
        lines += [f"## {mode} ({m['file']})", "",
                  f"Shapes: {', '.join(map(str, map(tuple, m['shapes'])))}; static (hedge): {tuple(m['static'])}; "
                  f"in-sample {m['train_vs_best_static']:.3f}x the best static.", "",
                  "| held out | tok/s (modelled) | vs best static (train-chosen) | vs (3,4,8) |", "|---|---|---|---|"]
        e3 = h["eagle3_static"]["tok_per_s"]
        for k, v in h.items():
            if isinstance(v, dict) and "tok_per_s" in v:
                label = f"{k} {v.get('shape', '')}".strip()
                lines.append(f"| {label} | {v['tok_per_s']:.1f} | {v.get('vs_ref', 1.0):.3f}x | {v['tok_per_s'] / e3:.3f}x |")
        lines += [""] + [f"![{p}]({p})" for p in m["plots"]]
        lines += ["", f"Decision cost: {h['learned']['decide_us']:.1f} µs per step (replay, this machine); "
                  f"shapes used (held out): {h['learned']['shapes_used']}", ""]
        if h.get("per_kind"):
            lines += ["Per kind, held out (tokens per modelled second against (3,4,8) on the same prompts; the oracle "
                      "knows each step's outcome: a bound no policy reaches):", "",
                      "| kind | prompts | (3,4,8) tok/s | learned | learned, hedge off | DCS | oracle on the learned set | oracle |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for kind, f in h["per_kind"].items():
                r = lambda key: f"{f[key]['vs_eagle3']:.3f}x" if key in f else "–"  # noqa: E731
                lines.append(f"| {kind} | {f['prompts']} | {f['eagle3_static']['tok_per_s']:.1f} | {r('learned')} | "
                             f"{r('learned_no_hedge')} | {r('dcs_config')} | {r('oracle_on_learned_set')} | {r('oracle')} |")
            lines.append("")
    return "\n".join(lines) + "\n"
