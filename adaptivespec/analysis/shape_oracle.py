"""How much could *any* per-step tree-shape policy gain over the best static shape? An upper bound.

For each prompt, the greedy output ``Y`` is generated once; then, teacher-forced along ``Y``, at
every position ``i`` the drafter drafts the largest tree of each branching factor and the script
reads off ``a_S(i)``, the tokens shape ``S`` would accept there (a longest tree path matching
``Y[i+1:]``, exactly what strict verification accepts). Shapes with the same branching share their
levels (beam search does not depend on the depth), so one draft per branching serves every
``(nsteps, ndt)``. A self-check compares ``a_S`` with the accepted lengths of the real decode that
produced ``Y``. With a per-step cost ``t(S)`` (a linear model fitted to the measured step times of
static-shape sweeps, ``--sweep``), schedules are timed over the same tokens:

* ``best_static``: the best single shape;
* ``oracle``: the per-step choice that minimises total time (dynamic programming over positions),
  a bound no real policy reaches, since it knows the future;
* ``p1_bins``: a map from the draft's top-1 probability at the root (the signal DCS reads,
  ``--bins`` quantile bins) to a shape, fitted in-sample by coordinate descent (optimistic);
* ``p1_ema_bins``: the same over (p1 bin, tercile of the accepted-length EMA with alpha 0.3);
* ``policies``: each ``--policy`` config's tree policy replayed step by step (it reads p1 and
  observes accepted lengths as in decoding). Only policies that keep the default beam rules
  (``select_level`` / ``select_final``) can be replayed: the acceptances are those of beam trees.
  A policy with its own in-step rules that keeps EAGLE's beam (``cost_aware``: it only stops
  drafting early and verifies a subset) is replayed on the full teacher-forced trees of its
  branching instead (``--policy``, stored with ``--out``): at every position it sees the levels of
  the full tree one by one, exactly the candidates it would draft, its kept subtree's accepted
  length is read off the continuation, it learns from the result, and its step costs
  ``t(levels it drafted, topk, nodes it verified)`` in the same cost model (``in_step`` in the
  summary). ``--profile PROFILE.json`` (``adaptivespec calibrate``) may replace ``--sweep`` as
  the cost model.

    python -m adaptivespec.analysis.shape_oracle --sweep runs/shape/trees runs/shape/chains \\
        --data runs/tuning/gsm8k-train-heldout.jsonl --limit 8 --max-new-tokens 128 --out oracle.json

``--categories`` / ``--per-category`` pick the prompts ``adaptivespec bench`` picks with the same flags
(Spec-Bench, MT-Bench, MATH-500), and the saved ``.pt`` names each prompt's category, which
``adaptivespec.analysis.tau_ceiling`` reads to replay shapes per category.

Prints a JSON summary (and writes it with ``--out``, the acceptances beside it as ``.pt`` for
``--cached``). bfloat16 teacher forcing matches incremental decoding up to rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from adaptivespec.config import load_config
from adaptivespec.decode import Engine
from adaptivespec.evaluation.categories import category_of, parse_categories, select
from adaptivespec.evaluation.datasets import load_dataset
from adaptivespec.training.counterfactual import teacher_forced
from adaptivespec.types import TreeShape

DEPTH = 7
BRANCHING = (1, 2, 3, 4, 8)


def fit_cost(sweeps: list[Path]) -> tuple[list[float], list[tuple], float]:
    """Least-squares step time (s) ~ c0 + c1*nsteps + c2*nsteps*topk + c3*ndt from sweep records."""
    rows = []
    for d in sweeps:
        res = json.loads((d / "results.json").read_text())
        for r in res["configs"]:
            if "sweep" not in r or not r.get("target_forwards"):
                continue
            p = r["config"]["policy"]
            rows.append((p["nsteps"], p["topk"], p["ndt"], r["wall_seconds"] / r["target_forwards"]))
    X = torch.tensor([[1.0, n, n * k, m] for n, k, m, _ in rows], dtype=torch.float64)
    y = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    coef = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.squeeze(1)
    resid = (X @ coef - y) / y
    return coef.tolist(), rows, float(resid.abs().mean())


def profile_cost(path: str) -> tuple[list[float], list, float]:
    """The cost model of an ``adaptivespec calibrate`` profile, as ``fit_cost``'s coefficients (s):
    ``c0 + c1*nsteps + c2*nsteps*topk + c3*ndt`` plus ``c4*topk`` (the drafter runs ``nsteps - 1``
    levels of ``topk`` nodes each)."""
    from adaptivespec.costmodel import CostModel

    m = CostModel.load(path)
    c0 = m.fixed + m.per_context * m.context_ref - m.per_draft_level
    coef = [c0 / 1e3, m.per_draft_level / 1e3, m.per_draft_node / 1e3, m.per_verified_token / 1e3, -m.per_draft_node / 1e3]
    return coef, [], float(m.meta.get("fit", {}).get("mean_abs_rel_error", float("nan")))


def sh(s: TreeShape) -> list[int]:
    return [s.nsteps, s.topk, s.ndt]


def cost(coef, s: TreeShape) -> float:
    return tree_cost(coef, s.nsteps, s.topk, s.ndt)


def tree_cost(coef, nsteps: int, topk: int, ndt: int) -> float:
    """Step time (s) of a tree drafted ``nsteps`` deep with beam ``topk``, verifying ``ndt`` tokens."""
    extra = coef[4] * topk if len(coef) > 4 else 0.0
    return coef[0] + coef[1] * nsteps + coef[2] * nsteps * topk + coef[3] * ndt + extra


def simulate(choose, acc: list[dict], times: dict, observe=None) -> float:
    """Time to emit every token when shape ``choose(i)`` is used at position i; ``observe(a)``
    (optional) sees each step's accepted length, for schedules that keep state."""
    i, total, N = 0, 0.0, len(acc)
    while i < N:
        s = choose(i)
        a = acc[i][s]
        total += times[s]
        if observe is not None:
            observe(a)
        i += a + 1
    return total


def oracle(acc: list[dict], times: dict, shapes) -> float:
    N = len(acc)
    f = [0.0] * (N + 1)
    for i in range(N - 1, -1, -1):
        f[i] = min(times[s] + f[min(N, i + acc[i][s] + 1)] for s in shapes)
    return f[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", nargs="+", help="sweep run folders (results.json) for the cost model")
    ap.add_argument("--profile", help="cost profile of adaptivespec calibrate, instead of --sweep")
    ap.add_argument("--data", help="a JSON-lines file of --dataset's fields (default: the packaged file)")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--limit", type=int, help="at most N prompts (default 8 without --categories / --per-category)")
    ap.add_argument("--categories", help="only these categories (comma-separated), as in adaptivespec bench")
    ap.add_argument("--per-category", type=int, help="the first N prompts of each category, as in adaptivespec bench")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--bins", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--policy", action="append", default=[], metavar="FILE.yaml",
                    help="also simulate the tree policy of this config on the measured acceptances (repeatable)")
    ap.add_argument("--cached", help="reuse the acceptances saved by an earlier run (its --out with .pt)")
    args = ap.parse_args(argv)
    if (args.sweep is None) == (args.profile is None):
        ap.error("give the cost model as exactly one of --sweep or --profile")
    if args.profile:
        coef, rows, err = profile_cost(args.profile)
    else:
        coef, rows, err = fit_cost([Path(p) for p in args.sweep])
    print(f"cost model: t = {coef[0]*1e3:.1f} + {coef[1]*1e3:.2f}*nsteps + {coef[2]*1e3:.3f}*nsteps*topk + "
          f"{coef[3]*1e3:.3f}*ndt ms; mean |rel. error| {100*err:.1f}% " + (f"over {len(rows)} shapes" if rows else f"(profile {args.profile})"), file=sys.stderr)

    shapes = []
    for k in BRANCHING:
        for ns in range(1, DEPTH + 1):
            for ndt in range(2, 25):
                try:
                    shapes.append(TreeShape(ns, k, ndt))
                except ValueError:
                    continue
    times = {s: cost(coef, s) for s in shapes}

    if args.cached:
        blob = torch.load(args.cached)
        by_key = {tuple(sh(x)): x for x in shapes}
        acc_all = [[{by_key[k]: v for k, v in a.items() if k in by_key} for a in acc] for acc in blob["acc"]]
        p1_all = blob["p1"]
        trees_all = blob.get("trees", {})
    else:
        acc_all, p1_all, trees_all = measure(args, shapes)
    analyse(args, coef, err, shapes, times, acc_all, p1_all, trees_all)
    return 0


def measure(args, shapes):
    eng = Engine(load_config(None, ["policy.nsteps=4", "policy.topk=4", "policy.ndt=8", "runtime.dtype=bfloat16"]))
    rt = eng.runtime
    full = {k: TreeShape(DEPTH, k, k + (DEPTH - 1) * k * k + 1) for k in BRANCHING}
    rt.prepare([*full.values(), *eng.policy.shapes()], capacity=4096)
    if args.categories is None and args.per_category is None:
        problems = load_dataset(args.dataset, args.data, 8 if args.limit is None else args.limit)
    else:  # the prompts adaptivespec bench picks with the same flags
        problems = select(load_dataset(args.dataset, args.data), parse_categories(args.categories),
                          args.per_category, args.dataset)[: args.limit]
    args.prompt_categories = [category_of(p) or args.dataset for p in problems]
    acc_all, p1_all = [], []
    trees_all: dict[int, list] = {k: [] for k in BRANCHING}  # branching -> prompt -> position -> tree_record
    checked = [0, 0]  # steps compared, steps equal
    with torch.inference_mode():
        for pi, prob in enumerate(problems):
            ids = eng.encode(prob.prompt)
            res = eng.generate_ids(ids, max_new_tokens=args.max_new_tokens)
            Y = res.token_ids
            tf = teacher_forced(eng, ids, Y, full, shapes)
            acc = tf["acc"]
            p1_all.extend(tf["p1"])
            for k in BRANCHING:
                trees_all[k].append(tf["trees"][k])
            acc_all.append(acc)
            # self-check: the decode that made Y used the engine's static shape; its real accepted
            # lengths must match the teacher-forced ones at the positions it visited
            i = 0
            for rec in res.records:
                if i >= len(acc):
                    break
                checked[0] += 1
                checked[1] += acc[i][rec.shape] == rec.accepted
                i += rec.accepted + 1
            print(f"prompt {pi + 1}/{len(problems)}: {len(Y)} tokens; self-check {checked[1]}/{checked[0]} steps "
                  f"of {rec.shape} predicted exactly", file=sys.stderr)
    return acc_all, p1_all, trees_all


def in_step_policy(path: str) -> bool:
    """Whether the config's policy sizes trees while drafting on EAGLE's beam (``eagle_beam``)."""
    from adaptivespec.plugins import get_plugin_host

    cfg = load_config(path, [])
    return bool(getattr(get_plugin_host().policies.get(cfg.policy.name).cls, "eagle_beam", False))


def simulate_policy(path: str, acc_all, p1_by, times) -> float:
    """Total time of the tree policy of config ``path`` replayed on the measured acceptances: it
    reads the draft top-1 probability at each step and observes the accepted length, as in decoding."""
    from adaptivespec.plugins import get_plugin_host
    from adaptivespec.strategies import TreePolicy
    from adaptivespec.types import StepRecord, StepSignals

    cfg = load_config(path, [])
    policy = get_plugin_host().policies.get(cfg.policy.name).cls(cfg.policy.params)
    cls = type(policy)
    if cls.select_level is not TreePolicy.select_level or cls.select_final is not TreePolicy.select_final:
        raise SystemExit(f"--policy {path}: policy {cfg.policy.name!r} drafts with its own level rules; the "
                         "measured acceptances are those of beam trees, so it cannot be replayed")
    missing = [s for s in policy.shapes() if s not in times]
    if missing:
        raise SystemExit(f"--policy {path}: shapes {', '.join(map(str, missing))} were not measured "
                         f"(branching {BRANCHING}, depth <= {DEPTH}, ndt <= 24)")
    total = 0.0
    for acc, pp in zip(acc_all, p1_by):
        policy.reset()
        step = [0, -1, None]  # step index, last accepted, shape of the step

        def choose(i):
            step[2] = policy.next_shape(StepSignals(step=step[0], draft_top1_prob=pp[i], last_accepted=step[1]))
            return step[2]

        def observe(a):
            shape = step[2]
            policy.observe(StepRecord(step=step[0], shape=shape, tree_size=shape.ndt, accepted=a, promoted=0,
                                      new_tokens=a + 1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0))
            step[0], step[1] = step[0] + 1, a

        total += simulate(choose, acc, times, observe)
    return total


def replay_in_step(path: str, trees_all: dict, p1_by, coef) -> dict:
    """Replay a policy that sizes the tree while drafting (keeping EAGLE's beam) on the full
    teacher-forced trees of its branching; returns total seconds and its decisions' means."""
    from adaptivespec.plugins import get_plugin_host
    from adaptivespec.tree import ancestor_matrix, make_tree
    from adaptivespec.types import StepRecord, StepSignals, VerifyResult

    cfg = load_config(path, [])
    policy = get_plugin_host().policies.get(cfg.policy.name).cls(cfg.policy.params)
    shape = policy.shapes()[0]
    if shape.topk not in trees_all or not trees_all[shape.topk]:
        raise SystemExit(f"--policy {path}: no full trees of branching {shape.topk} were measured ({sorted(trees_all)})")
    if shape.nsteps > DEPTH:
        raise SystemExit(f"--policy {path}: depth {shape.nsteps} > the measured {DEPTH}")
    total, steps, tokens, levels, verified = 0.0, 0, 0, 0, 0
    for trees, pp in zip(trees_all[shape.topk], p1_by):
        policy.reset()
        i, step, last = 0, 0, -1
        while i < len(trees):
            shape = policy.next_shape(StepSignals(step=step, draft_top1_prob=pp[i], last_accepted=last))
            t = trees[i]
            depth, parents, logp, match = t["depth"].long(), t["parents"].long(), t["logp"], t["match"]
            pool, used, visited = 0, 0, []
            lvl = (depth == 1).nonzero().squeeze(1)
            for d in range(1, shape.nsteps + 1):
                if lvl.numel() == 0:
                    break
                _, beam = policy.select_level(logp[lvl], d, shape, pool)
                pool, used = pool + lvl.numel(), d
                visited.append(lvl)
                if beam.numel() == 0:
                    break
                # the next level: the children of the nodes the policy expanded (a policy may expand
                # fewer than EAGLE's beam), in the order of its beam, as the drafter would propose them
                rank = torch.full((depth.shape[0],), -1, dtype=torch.long)
                rank[lvl[beam]] = torch.arange(beam.numel())
                nxt = (depth == d + 1).nonzero().squeeze(1)
                r = rank[parents[nxt]]
                lvl = nxt[r >= 0][torch.sort(r[r >= 0], stable=True).indices]
            cand = torch.cat(visited) if visited else torch.zeros(0, dtype=torch.long)  # pool order
            kept = torch.sort(cand[policy.select_final(logp[cand], shape)]).values
            nodes = torch.cat([torch.zeros(1, dtype=torch.long), kept])
            sub_parents = parents[nodes]
            remap = torch.full((depth.shape[0],), -1, dtype=torch.long)
            remap[nodes] = torch.arange(nodes.shape[0])
            sub_parents = torch.where(sub_parents >= 0, remap[sub_parents.clamp(min=0)], sub_parents)
            anc = ancestor_matrix(sub_parents, used or 1)
            good = match[nodes]
            ok = (~anc | good.unsqueeze(0)).all(1)
            sub_depth = anc.sum(-1) - 1
            deepest = int(torch.where(ok, sub_depth, -1).argmax())
            a = int(sub_depth[deepest])
            sub = make_tree(torch.zeros(nodes.shape[0], dtype=torch.long), sub_parents, draft_logp=logp[nodes])
            path_nodes = anc[deepest].nonzero().squeeze(1).tolist()
            policy.observe_tree(sub, VerifyResult(path=path_nodes, tokens=[0] * len(path_nodes)))
            policy.observe(StepRecord(step=step, shape=shape, tree_size=nodes.shape[0], accepted=a, promoted=0,
                                      new_tokens=a + 1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0))
            total += tree_cost(coef, max(used, 1), shape.topk, nodes.shape[0])
            steps, tokens, levels, verified = steps + 1, tokens + a + 1, levels + used, verified + nodes.shape[0]
            i, step, last = i + a + 1, step + 1, a
    rel = policy.calib.reliability() if hasattr(policy, "calib") else None
    return {"seconds": total, "steps": steps, "accept_length": tokens / steps, "mean_levels": levels / steps,
            "mean_verified": verified / steps, "calibration_ece": rel["ece"] if rel else None}


def analyse(args, coef, err, shapes, times, acc_all, p1_all, trees_all=None) -> None:
    trees_all = trees_all or {}
    if args.out:
        torch.save({"acc": [[{tuple(sh(k)): v for k, v in a.items()} for a in acc] for acc in acc_all], "p1": p1_all,
                    "trees": trees_all, "categories": getattr(args, "prompt_categories", None)}, Path(args.out).with_suffix(".pt"))

    static = {s: sum(simulate(lambda i: s, acc, times) for acc in acc_all) for s in shapes}
    best = min(static, key=static.get)
    orc = sum(oracle(acc, times, shapes) for acc in acc_all)
    p1_by, off = [], 0
    for acc in acc_all:
        p1_by.append(p1_all[off : off + len(acc)])
        off += len(acc)
    qs = sorted(p1_all)
    edges = [qs[int(len(qs) * b / args.bins)] for b in range(1, args.bins)]
    ema_edges = [1.0, 2.0]  # EMA of accepted tokens per step: < 1, [1, 2), >= 2

    def run_policy(table) -> float:
        """Total time of the policy shape = table[p1 bin][EMA bin] (a one-column table ignores the
        EMA); EMA (alpha 0.3) of the accepted lengths of its own steps, starting at 1.5."""
        total = 0.0
        for acc, pp in zip(acc_all, p1_by):
            ema = [1.5]

            def choose(i):
                row = table[sum(pp[i] >= e for e in edges)]
                return row[min(sum(ema[0] >= e for e in ema_edges), len(row) - 1)]

            def observe(a):
                ema[0] = 0.3 * a + 0.7 * ema[0]

            total += simulate(choose, acc, times, observe)
        return total

    def descend(cells_p1: int, cells_ema: int) -> tuple[float, list]:
        table = [[best] * cells_ema for _ in range(cells_p1)]
        cur = run_policy(table)
        for _ in range(3):
            improved = False
            for b in range(cells_p1):
                for e in range(cells_ema):
                    for s in shapes:
                        trial = [row[:] for row in table]
                        trial[b][e] = s
                        t = run_policy(trial)
                        if t < cur - 1e-12:
                            cur, table, improved = t, trial, True
            if not improved:
                break
        return cur, table

    t_p1, pick = descend(args.bins, 1)
    t_p1ema, pick2 = descend(args.bins, 3)
    tokens = sum(len(a) for a in acc_all)
    top = sorted(static, key=static.get)[:5]
    policies = {}
    gain = static[best] / orc - 1.0
    for path in args.policy:
        if in_step_policy(path):
            r = replay_in_step(path, trees_all, p1_by, coef)
            t = r.pop("seconds")
            policies[path] = {"tok_per_s": tokens / t, "vs_best_static": static[best] / t, "in_step": r}
        else:
            t = simulate_policy(path, acc_all, p1_by, times)
            policies[path] = {"tok_per_s": tokens / t, "vs_best_static": static[best] / t}
        policies[path]["oracle_gain_captured"] = (static[best] / t - 1.0) / gain if gain > 0 else None
    summary = {
        "prompts": len(acc_all), "positions": tokens,
        "cost_model_ms": [c * 1e3 for c in coef], "cost_model_mean_rel_error": err,
        "best_static": {"shape": sh(best), "seconds": static[best], "tok_per_s": tokens / static[best]},
        "top_static": [{"shape": sh(s), "tok_per_s": tokens / static[s]} for s in top],
        "oracle": {"seconds": orc, "tok_per_s": tokens / orc, "vs_best_static": static[best] / orc},
        "p1_bins": {"edges": edges, "shapes": [sh(r[0]) for r in pick], "seconds": t_p1, "tok_per_s": tokens / t_p1,
                    "vs_best_static": static[best] / t_p1},
        "p1_ema_bins": {"p1_edges": edges, "ema_edges": ema_edges, "shapes": [[sh(c) for c in r] for r in pick2],
                        "seconds": t_p1ema, "tok_per_s": tokens / t_p1ema, "vs_best_static": static[best] / t_p1ema},
        "policies": policies,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
