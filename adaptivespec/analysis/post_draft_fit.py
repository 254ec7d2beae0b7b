"""``adaptivespec fit-post-draft``: the path calibration of the ``post_draft`` policy, fitted on
training prompts only, with a held-out card.

For every prompt the target's greedy output ``Y`` is generated once; teacher-forced along ``Y``
(:func:`~adaptivespec.training.counterfactual.teacher_forced`), at every position the head drafts
the generous tree the policy drafts at most (depth 6, beam 4: 85 nodes) and every node is labelled
by whether its path is ``Y``'s continuation (exactly what strict verification accepts); the
``retrieval`` source's trie at the same position is labelled the same way. Then, per depth:

* the head: a logistic regression of acceptance on the node's cumulative and own-edge draft log-prob;
* each source: a logistic regression on the log-odds of the source's own score;
* the continuation rate: how often an accepted, expanded node has an accepted child.

Every ``--heldout-every``-th prompt of each kind is held out (labelled, never fitted). The card
(``card.md``, ``card.json``, ``reliability.png``) gives the held-out expected calibration error
beside ``cost_aware``'s shipped map and the source's raw scores, and replays on the held-out trees,
priced by the cost profile: the best static beam-4 shape, ``eagle3.yaml``'s (3, 4, 8), the
per-step oracle over beam-4 shapes, ``cost-aware.yaml`` and ``post-draft.yaml`` with the new
calibration (its share of the oracle's gain).

    adaptivespec fit-post-draft --out runs/post-draft --per-file 4
    cp runs/post-draft/calibration.json adaptivespec/profiles/post-draft-smollm2-135m-embedded.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from adaptivespec.costmodel import (
    DEFAULT_COST_PROFILE,
    DEFAULT_PRIOR,
    HEAD,
    CalibrationMap,
    PathCalibration,
    expected_calibration_error,
    fit_logistic,
    head_features,
    resolve_profile,
    source_features,
)
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT
from adaptivespec.training.policy_data import DEFAULT_DATA, kind_of, pick_prompts
from adaptivespec.types import TreeShape

DEPTH, TOPK = 6, 4
FULL = TreeShape(DEPTH, TOPK, TOPK + (DEPTH - 1) * TOPK * TOPK + 1)
"""The generous tree labelled at every position (post_draft's default max_depth and topk)."""
SOURCE = "retrieval"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fit-post-draft", help="fit the post_draft policy's path calibration on training prompts",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--out", required=True, type=Path, help="output folder (labels/, calibration.json, card, reliability plot)")
    a("--data", nargs="+", default=list(DEFAULT_DATA), help="training prompts: 'reserved' (corpus/reserved-ids.txt) "
      "and/or jsonl training files; evaluation sets are refused")
    a("--data-root", type=Path, default=DATA_ROOT, help="folder of the training files")
    a("--per-file", type=int, default=4, help="prompts drawn from each file (reserved: from each kind)")
    a("--max-new-tokens", type=int, default=128, help="greedy tokens labelled per prompt")
    a("--heldout-every", type=int, default=4, help="every N-th prompt of each kind is held out (the card's figures)")
    a("--profile", help=f"cost profile for the replays (default the shipped {DEFAULT_COST_PROFILE})")
    a("--calibration-out", type=Path, help="where to write the fitted calibration (default OUT/calibration.json)")
    a("--l2", type=float, default=1.0, help="L2 penalty of the logistic fits")
    a("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def log(msg: str) -> None:
    print(f"fit-post-draft: {msg}", file=sys.stderr, flush=True)


# -- labels ------------------------------------------------------------------------------------------
def beam4_shapes() -> list[TreeShape]:
    out = []
    for ns in range(1, DEPTH + 1):
        for ndt in range(2, 25):
            try:
                out.append(TreeShape(ns, TOPK, ndt))
            except ValueError:
                continue
    return out


def path_ok(parents: np.ndarray, match: np.ndarray) -> np.ndarray:
    """Per node of a topologically ordered tree (root first): every node on its path matches."""
    ok = match.astype(bool).copy()
    for i in range(1, parents.shape[0]):
        if parents[i] >= 0:
            ok[i] &= ok[parents[i]]
    return ok


def label_prompt(eng, prompt, max_new_tokens: int, shapes: list[TreeShape]) -> dict:
    """One prompt's labels: the full trees along its greedy output, the retrieval tries, the shapes' acceptances."""
    from adaptivespec.training.counterfactual import teacher_forced
    from adaptivespec.training.policy_data import _retrieval_source

    ids = eng.encode(prompt.text)
    with torch.inference_mode():
        Y = eng.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids
        if len(Y) < DEPTH + 3:
            return {"id": prompt.id, "kind": kind_of(prompt.id), "empty": True}
        tf = teacher_forced(eng, ids, Y, {TOPK: FULL}, shapes)
    src = _retrieval_source()
    src.reset(ids)
    src.extend([Y[0]])
    tries = []
    for j in range(len(Y) - 1):
        trie = src.propose()
        rec = None
        if trie is not None and len(trie):
            depth = np.array(trie.depths())
            want = np.array([Y[j + d] if j + d < len(Y) else -1 for d in depth])
            rec = {"depth": depth, "score": np.array(trie.scores), "parents": np.array(trie.parents),
                   "acc": path_ok(np.array(trie.parents), np.array(trie.tokens) == want)}
            src.observe(trie, Y[j + 1 : j + 1 + int(depth.max()) + 1])
        tries.append(rec)
        src.extend([Y[j + 1]])
    return {"id": prompt.id, "kind": kind_of(prompt.id), "tokens": len(Y), "trees": tf["trees"][TOPK], "p1": tf["p1"],
            "acc": [{(s.nsteps, s.topk, s.ndt): v for s, v in a.items()} for a in tf["acc"]], "tries": tries}


def build_labels(folder: Path, prompts: list, max_new_tokens: int, progress: bool) -> None:
    from tqdm import tqdm

    from adaptivespec.training.policy_data import labelling_engine

    folder.mkdir(parents=True, exist_ok=True)
    todo = [p for p in prompts if not (folder / f"{p.id}.pt").is_file()]
    if not todo:
        return
    eng, _ = labelling_engine()
    shapes = beam4_shapes()
    for p in tqdm(todo, desc="labels", unit="prompt", disable=not progress, file=sys.stderr):
        lab = label_prompt(eng, p, max_new_tokens, shapes)
        tmp = folder / f"{p.id}.tmp"
        torch.save(lab, tmp)
        tmp.rename(folder / f"{p.id}.pt")


# -- rows and fits -----------------------------------------------------------------------------------
def head_rows(labels: list[dict]) -> dict[str, np.ndarray]:
    """Every labelled head node (positions whose continuation covers the whole tree): depth,
    cumulative and edge log-prob, accepted, its parent's row (-1: the root), its position's id."""
    cols = {k: [] for k in ("depth", "logp", "edge", "acc", "parent", "pos", "expanded_acc", "child_acc")}
    off, pos = 0, 0
    for lab in labels:
        trees = lab["trees"]
        for j, t in enumerate(trees):
            if j + DEPTH + 1 >= lab["tokens"]:
                break
            depth, parents = t["depth"].long().numpy(), t["parents"].long().numpy()
            logp, match = t["logp"].float().numpy(), t["match"].numpy()
            acc = path_ok(parents, match)
            edge = logp - np.where(parents >= 0, logp[np.maximum(parents, 0)], 0.0)
            has_child = np.bincount(parents[1:], minlength=depth.shape[0]) > 0
            acc_child = np.bincount(parents[1:], weights=acc[1:], minlength=depth.shape[0]) > 0
            sel = slice(1, None)
            cols["depth"].append(depth[sel]), cols["logp"].append(logp[sel]), cols["edge"].append(edge[sel])
            cols["acc"].append(acc[sel])
            cols["parent"].append(np.where(parents[sel] > 0, parents[sel] - 1 + off, -1))
            cols["pos"].append(np.full(depth.shape[0] - 1, pos))
            # continuation: accepted expanded nodes (the root included, depth index 0 -> cont[1])
            e = acc & has_child
            cols["expanded_acc"].append(np.stack([depth[e] + 1, acc_child[e]], -1))
            off += depth.shape[0] - 1
            pos += 1
    out = {k: np.concatenate(v) for k, v in cols.items() if k not in ("expanded_acc", "child_acc")}
    out["cont"] = np.concatenate(cols["expanded_acc"]) if cols["expanded_acc"] else np.zeros((0, 2))
    return out


def source_rows(labels: list[dict]) -> dict[str, np.ndarray]:
    depth, score, acc = [], [], []
    for lab in labels:
        for j, r in enumerate(lab["tries"]):
            if r is None or j + int(r["depth"].max()) >= lab["tokens"]:
                continue
            depth.append(r["depth"]), score.append(r["score"]), acc.append(r["acc"])
    if not depth:
        return {"depth": np.zeros(0, int), "score": np.zeros(0), "acc": np.zeros(0, bool)}
    return {"depth": np.concatenate(depth), "score": np.concatenate(score), "acc": np.concatenate(acc)}


def fit_by_depth(depth: np.ndarray, X: np.ndarray, y: np.ndarray, max_depth: int, l2: float, min_rows: int = 50) -> np.ndarray:
    """One logistic fit per depth 1..max_depth (a depth with fewer than ``min_rows`` rows takes the one above's)."""
    rows = []
    for d in range(1, max_depth + 1):
        m = depth == d
        if m.sum() >= min_rows and 0 < y[m].sum() < m.sum():
            rows.append(fit_logistic(X[m], y[m].astype(np.float64), l2))
        elif rows:
            rows.append(rows[-1])
        else:
            rows.append(fit_logistic(X, y.astype(np.float64), l2))
    return np.array(rows)


def capped(values: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Each value capped by its parent's capped value (what the policy ranks by)."""
    v = values.copy()
    for d in range(2, int(depth.max()) + 1):
        m = depth == d
        v[m] = np.minimum(v[m], v[parent[m]])
    return v


def fit(train: list[dict], l2: float) -> PathCalibration:
    h = head_rows(train)
    X = np.stack(head_features(h["logp"].astype(np.float64), h["edge"].astype(np.float64)), -1)
    weights = {HEAD: fit_by_depth(h["depth"], X, h["acc"], DEPTH, l2)}
    s = source_rows(train)
    if s["depth"].shape[0] >= 50:
        Xs = np.stack(source_features(s["score"]), -1)
        weights[SOURCE] = fit_by_depth(s["depth"], Xs, s["acc"], int(s["depth"].max()), l2)
    n = np.bincount(h["cont"][:, 0].astype(int), minlength=DEPTH + 2).astype(np.float64)
    a = np.bincount(h["cont"][:, 0].astype(int), weights=h["cont"][:, 1], minlength=DEPTH + 2)
    cont = (a + 1.0) / (n + 2.0)
    return PathCalibration(weights=weights, continuation=cont, meta={"nodes": int(h["acc"].shape[0]),
                                                                    "source_nodes": int(s["acc"].shape[0])})


# -- held-out evaluation --------------------------------------------------------------------------------
def evaluate_calibration(cal: PathCalibration, held: list[dict]) -> dict:
    h = head_rows(held)
    v = capped(cal.head_values_np(h["depth"], h["logp"], h["edge"]), h["parent"], h["depth"])
    prior = CalibrationMap.load(resolve_profile(None, DEFAULT_PRIOR, "prior")).values(h["depth"], h["logp"])
    # the nodes a selection weighs: each position's 24 best by value
    order = np.lexsort((-v, h["pos"]))
    rank = np.empty_like(order)
    starts = np.r_[0, np.flatnonzero(np.diff(h["pos"][order])) + 1]
    rank[order] = np.arange(order.shape[0]) - np.repeat(starts, np.diff(np.r_[starts, order.shape[0]]))
    top = rank < 24
    out = {"nodes": int(v.shape[0])}
    for name, p, m in (("post_draft", v, slice(None)), ("cost_aware_prior", prior, slice(None)),
                       ("post_draft_top24", v, top), ("cost_aware_prior_top24", prior, top)):
        ece, table = expected_calibration_error(p[m], h["acc"][m])
        out[name] = {"ece": ece, **table}
    out["by_depth"] = {int(d): {"ece": expected_calibration_error(v[h["depth"] == d], h["acc"][h["depth"] == d])[0],
                                "observed": float(h["acc"][h["depth"] == d].mean())} for d in range(1, DEPTH + 1)}
    s = source_rows(held)
    if s["depth"].shape[0] and SOURCE in cal.weights:
        sv = cal.source_values(SOURCE, s["depth"], s["score"])
        out["retrieval"] = {"ece": expected_calibration_error(sv, s["acc"])[0], "nodes": int(sv.shape[0]),
                            **expected_calibration_error(sv, s["acc"])[1]}
        out["retrieval_raw_score"] = {"ece": expected_calibration_error(np.clip(s["score"], 0, 1), s["acc"])[0],
                                      **expected_calibration_error(np.clip(s["score"], 0, 1), s["acc"])[1]}
    return out


def replay(held: list[dict], cal_path: Path, profile: str | None, workdir: Path) -> dict:
    """Modelled tokens/s on the held-out trees: static shapes, the oracle, cost-aware and post-draft."""
    import yaml

    from adaptivespec.analysis.shape_oracle import cost, oracle, profile_cost, replay_in_step, simulate

    coef, _, _ = profile_cost(str(resolve_profile(profile, DEFAULT_COST_PROFILE, "profile")))
    shapes = beam4_shapes()
    times = {s: cost(coef, s) for s in shapes}
    acc_all = [[{TreeShape(*k): v for k, v in a.items()} for a in lab["acc"]] for lab in held]
    tokens = sum(len(acc) for acc in acc_all)
    static = {s: sum(simulate(lambda i, s=s: s, acc, times) for acc in acc_all) for s in shapes}
    best = min(static, key=static.get)
    eagle = TreeShape(3, 4, 8)
    orc = sum(oracle(acc, times, shapes) for acc in acc_all)
    paths = {}
    for name, file in (("cost_aware", "cost-aware.yaml"), ("post_draft", "post-draft.yaml")):
        cfg = yaml.safe_load((CONFIGS / file).read_text())
        cfg["policy"]["profile"] = profile and str(Path(profile).resolve())  # the policies price steps as the replay does
        if name == "post_draft":
            cfg["policy"]["calibration"] = str(cal_path.resolve())
        paths[name] = workdir / f"{name}-replay.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
    trees = {TOPK: [lab["trees"] for lab in held]}
    p1 = [lab["p1"] for lab in held]
    out = {"positions": tokens, "best_static": {"shape": [best.nsteps, best.topk, best.ndt], "tok_per_s": tokens / static[best]},
           "eagle3": {"tok_per_s": tokens / static[eagle]}, "oracle": {"tok_per_s": tokens / orc}}
    for name, path in paths.items():
        r = replay_in_step(str(path), trees, p1, coef)
        out[name] = {"tok_per_s": r["accept_length"] * r["steps"] / r["seconds"], **r}
    gain = out["oracle"]["tok_per_s"] / out["best_static"]["tok_per_s"] - 1.0
    for k in ("eagle3", "cost_aware", "post_draft", "oracle"):
        out[k]["vs_eagle3"] = out[k]["tok_per_s"] / out["eagle3"]["tok_per_s"]
        out[k]["oracle_gain_captured"] = (out[k]["tok_per_s"] / out["best_static"]["tok_per_s"] - 1.0) / gain if gain > 0 else None
    return out


# -- card ------------------------------------------------------------------------------------------
def plot(ev: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    panels = [("head: all drafted nodes", ("post_draft", "cost_aware_prior")),
              ("head: each position's 24 best", ("post_draft_top24", "cost_aware_prior_top24"))]
    if "retrieval" in ev:
        panels[1] = ("head (24 best) and retrieval", ("post_draft_top24", "retrieval", "retrieval_raw_score"))
    for ax, (title, keys) in zip(axes, panels):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for k in keys:
            t = ev[k]
            m = np.array(t["count"]) > 0
            ax.plot(np.array(t["predicted"])[m], np.array(t["observed"])[m], marker="o", label=f"{k} (ECE {t['ece']:.3f})")
        ax.set_xlabel("predicted acceptance")
        ax.set_ylabel("observed acceptance")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("post_draft path calibration on held-out training prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def card_markdown(card: dict) -> str:
    ev, rp = card["heldout_calibration"], card["replay"]
    lines = [f"# post_draft path calibration: card", "", f"Command: `{card['command']}`  ", f"Created: {card['created']}  ",
             f"Prompts: {card['prompts']['fitted']} fitted, {card['prompts']['held_out']} held out (training prompts: "
             f"{', '.join(card['data'])}); {card['nodes']} head nodes, {card['source_nodes']} retrieval nodes fitted.", "",
             "## Held-out calibration (expected calibration error, 10 bins)", "",
             "| nodes | post_draft fit | cost_aware's shipped map |", "|---|---:|---:|",
             f"| every drafted node | {ev['post_draft']['ece']:.4f} | {ev['cost_aware_prior']['ece']:.4f} |",
             f"| each position's 24 best | {ev['post_draft_top24']['ece']:.4f} | {ev['cost_aware_prior_top24']['ece']:.4f} |"]
    if "retrieval" in ev:
        lines += [f"| retrieval candidates (fit / raw score) | {ev['retrieval']['ece']:.4f} | {ev['retrieval_raw_score']['ece']:.4f} |"]
    lines += ["", "Per depth (post_draft fit): " + ", ".join(f"{d}: ECE {v['ece']:.3f}, observed {v['observed']:.3f}"
                                                       for d, v in ev["by_depth"].items()), "",
              "![reliability](reliability.png)", "",
              f"## Replay on the held-out trees ({rp['positions']} positions, modelled by the cost profile)", "",
              "| schedule | tok/s | vs (3,4,8) | share of the oracle's gain |", "|---|---:|---:|---:|"]
    lines += [f"| best static beam-4 shape {tuple(rp['best_static']['shape'])} | {rp['best_static']['tok_per_s']:.2f} | "
              f"{rp['best_static']['tok_per_s'] / rp['eagle3']['tok_per_s']:.3f}x | 0% |"]
    for k in ("eagle3", "cost_aware", "post_draft", "oracle"):
        r = rp[k]
        extra = f" ({r['mean_levels']:.2f} levels, {r['mean_verified']:.2f} verified, accept {r['accept_length']:.2f})" if "mean_levels" in r else ""
        lines.append(f"| {k}{extra} | {r['tok_per_s']:.2f} | {r['vs_eagle3']:.3f}x | {100 * r['oracle_gain_captured']:.0f}% |")
    lines += ["", "tok/s: tokens per modelled second (the cost profile's step times). The oracle is the per-step best "
              "beam-4 shape knowing the continuation, a bound no policy reaches."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    if args.per_file < 1 or args.heldout_every < 2:
        raise AdaptiveSpecError(f"--per-file: expected >= 1 and --heldout-every >= 2, got {args.per_file}, {args.heldout_every}")
    prompts = pick_prompts(args.data, args.per_file, args.data_root)
    held, seen = [], {}
    for p in prompts:
        seen[kind_of(p.id)] = n = seen.get(kind_of(p.id), 0) + 1
        held.append(n % args.heldout_every == 0)
    labels_dir = args.out / "labels"
    build_labels(labels_dir, prompts, args.max_new_tokens, not args.no_progress)
    load = lambda ps: [lab for lab in (torch.load(labels_dir / f"{p.id}.pt", weights_only=False) for p in ps) if not lab.get("empty")]
    train = load([p for p, h in zip(prompts, held) if not h])
    test = load([p for p, h in zip(prompts, held) if h])
    if not train or not test:
        raise AdaptiveSpecError(f"--per-file {args.per_file}: too few prompts to fit and hold out ({len(train)}, {len(test)})")
    cal = fit(train, args.l2)
    command = "adaptivespec " + " ".join(sys.argv[1:]) if "fit-post-draft" in sys.argv else "adaptivespec fit-post-draft"
    created = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ev = evaluate_calibration(cal, test)
    cal.meta.update({"model": {"target": "smollm2-135m-instruct", "drafter": "embedded"}, "data": list(args.data),
                     "prompts": len(train), "heldout_ece": round(ev["post_draft_top24"]["ece"], 5), "command": command,
                     "created": created})
    cal_path = args.calibration_out or args.out / "calibration.json"
    cal.save(cal_path)
    log(f"wrote {cal_path} ({cal.meta['nodes']} head nodes, {cal.meta['source_nodes']} retrieval nodes)")
    card = {"command": command, "created": created, "data": list(args.data), "prompts": {"fitted": len(train), "held_out": len(test)},
            "nodes": cal.meta["nodes"], "source_nodes": cal.meta["source_nodes"], "heldout_calibration": ev,
            "replay": replay(test, Path(cal_path), args.profile, args.out)}
    plot(ev, args.out / "reliability.png")
    (args.out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (args.out / "card.md").write_text(card_markdown(card))
    log(f"wrote {args.out / 'card.md'}: held-out ECE {ev['post_draft_top24']['ece']:.4f} (24 best per position; "
        f"cost_aware's map {ev['cost_aware_prior_top24']['ece']:.4f}); replay post_draft "
        f"{card['replay']['post_draft']['vs_eagle3']:.3f}x (3,4,8), cost_aware {card['replay']['cost_aware']['vs_eagle3']:.3f}x")
    return 0
