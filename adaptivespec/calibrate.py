"""``adaptivespec calibrate``: measure the step-cost model (and a calibration prior) on this machine.

Decodes a few prompts with a set of static tree shapes (interleaved: prompt by prompt, every
shape in turn, so machine drift hits all alike), times every speculative step, and fits by least
squares::

    step_ms = fixed + per_context * P + per_draft_level * L + per_draft_node * E
              + (per_verified_token + per_verified_token_context * P) * n

(``P`` committed positions, ``L = nsteps - 1`` drafter forwards, ``E = L * topk`` nodes run through
the drafter, ``n`` tokens verified with the root; the per-row growth with ``P`` is fitted only
when the prompts' lengths differ by 256 tokens or more: give long and short ones to size trees
for long prompts). The profile (JSON) records the machine, dtype,
model, the coefficients, the fit error, the median step time of every shape measured (on a GPU
with CUDA graphs: per captured shape) and the command. With ``--prior-out`` the same decodes also
give the calibration prior: accepted / verified drafted nodes per (depth, cumulative draft
log-probability) cell. Use training prompts (``--data``), never an evaluation set.

    adaptivespec calibrate --config configs/cost-aware.yaml --out my-profile.json \\
        --data runs/tuning/gsm8k-train-heldout.jsonl --prior-out my-prior.json

Any target and head the engine loads: ``--target`` / ``--drafter`` replace the config's
``model.target`` / ``model.drafter`` (a folder, or a Hugging Face id already in the local cache), and
the profile records them and this machine's CPU (``machine.cpu``): the policies that read a profile
warn once when it was fitted on another target, head or CPU (docs/models.md).

    adaptivespec calibrate --config configs/cost-aware.yaml --target Qwen/Qwen3-0.6B \\
        --drafter ./qwen3-0.6b-eagle3 --out qwen3-profile.json --prior-out qwen3-prior.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from adaptivespec.cli import positive_int

DEFAULT_SHAPES = ("1,2,3", "1,4,5", "2,2,4", "2,4,8", "3,1,4", "3,2,6", "3,4,8", "3,4,12",
                  "4,2,8", "5,1,6", "5,4,8", "5,4,16", "6,2,12", "6,4,24")
PROMPTS = [  # generic prompts (none from an evaluation set) when --data is not given
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "Tom reads 12 pages a day. How many pages does he read in three weeks?",
    "Translate to French: The library opens at nine and closes at six.",
]


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure the step-cost model (and a calibration prior) on this machine")
    p.add_argument("--config", required=True, help="YAML config: model, drafter, runtime and dtype to time")
    p.add_argument("--target", help="target model folder or cached Hugging Face id (default: the config's model.target)")
    p.add_argument("--drafter", help="EAGLE-3 head folder or cached Hugging Face id (default: the config's model.drafter)")
    p.add_argument("--out", default="cost-profile.json", metavar="PROFILE.json", help="cost profile to write")
    p.add_argument("--prior-out", metavar="PRIOR.json", help="also write a calibration prior (use training prompts)")
    p.add_argument("--data", metavar="FILE.jsonl", help="prompts (--dataset fields); default: four built-in prompts")
    p.add_argument("--dataset", default="gsm8k", help="field layout of --data (default gsm8k)")
    p.add_argument("--limit", type=positive_int, default=4, help="prompts (default 4)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens per prompt and shape (default 64)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="N,K,NDT",
                   help="static shapes to time (default: 14 shapes, depth 1-6, topk 1-4, ndt 3-24)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--batch", action="store_true",
                   help="measure the batch engine's cost table instead (verify cost by rows and context, draft cost "
                        "by rows: what batch.row_budget: goodput spends rows by) and cache it for this CPU, target, "
                        "dtype and thread count, where serve and the bench read it; --out is ignored")
    p.set_defaults(func=run_calibrate)


def parse_shapes(texts):
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.types import TreeShape

    shapes = []
    for t in texts:
        try:
            shapes.append(TreeShape(*(int(x) for x in t.split(","))))
        except (ValueError, TypeError) as exc:
            raise AdaptiveSpecError(f"--shapes: expected NSTEPS,TOPK,NDT (a valid tree shape), got {t!r} ({exc})") from None
    return shapes


def step_rows(prompt_len: int, records) -> list[tuple[int, int, int, int, float]]:
    """``(P, L, E, n, step_ms)`` per speculative step; the first step of a generation is skipped (warm-up)."""
    rows, P = [], prompt_len
    for r in records:
        if r.shape is not None and r.step > 0:
            L = r.shape.nsteps - 1
            rows.append((P, L, L * r.shape.topk, r.tree_size, r.draft_ms + r.verify_ms + r.other_ms))
        P += r.new_tokens
    return rows


def run_calibrate(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from adaptivespec.config import load_config
    from adaptivespec.costmodel import LOGP_EDGES, CalibrationMap, CostModel, machine_info, save_prior
    from adaptivespec.decode import Engine
    from adaptivespec.errors import AdaptiveSpecError

    shapes = parse_shapes(args.shapes)
    models = [f"model.{k}={v}" for k, v in (("target", args.target), ("drafter", args.drafter)) if v is not None]
    config = load_config(args.config, [*models, *args.overrides])
    if getattr(args, "batch", False):
        return calibrate_batch(config)
    if config.model.drafter is None:
        raise AdaptiveSpecError(f"--config {args.config}: model.drafter is null; calibrate needs a drafter (--drafter)")
    if args.data is not None:
        from adaptivespec.evaluation.datasets import load_dataset
        from adaptivespec.training.data import check_not_eval

        check_not_eval(Path(args.data))
        prompts = [p.prompt for p in load_dataset(args.dataset, args.data, args.limit)]
    else:
        prompts = PROMPTS[: args.limit]
    engine = Engine(config)
    engine.runtime.prepare([*shapes, *engine.policy.shapes()], capacity=2 * args.max_new_tokens + 1024)
    depth = max(s.nsteps for s in shapes)
    size = (depth + 1) * (len(LOGP_EDGES) + 1)
    cells = np.zeros((2, size))  # accepted, verified
    counter = CalibrationMap(np.zeros((depth + 1, len(LOGP_EDGES) + 1)))

    def count(tree, result):
        onpath = np.zeros(tree.size)
        onpath[result.path] = 1.0
        idx = counter.cells(tree.depth[1:], tree.draft_logp[1:])
        cells[0] += np.bincount(idx, weights=onpath[1:], minlength=size)
        cells[1] += np.bincount(idx, minlength=size)

    static = engine.host.policies.get("static")  # the registered static policy times each shape
    rows, per_shape = [], {s: [] for s in shapes}
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    bar = tqdm(total=len(prompts) * len(shapes), desc="calibrate", unit="gen", disable=args.no_progress, file=sys.stderr)
    t0 = time.time()
    for text in prompts:
        ids = engine.encode(text)
        for s in shapes:
            engine.policy = static.cls(static.cls.Params(nsteps=s.nsteps, topk=s.topk, ndt=s.ndt))
            engine.policy.observe_tree = count
            res = engine.generate_ids(ids, max_new_tokens=args.max_new_tokens)
            got = step_rows(len(ids), res.records)
            rows += got
            per_shape[s] += [r[-1] for r in got]
            bar.update()
    bar.close()
    command = "adaptivespec " + " ".join(sys.argv[1:]) if sys.argv and "calibrate" in sys.argv else "adaptivespec calibrate"
    model = CostModel.fit(
        [r for r in rows],
        machine=machine_info(), device=config.runtime.device, dtype=config.runtime.dtype, runtime=config.runtime.name,
        model={"target": config.model.target, "drafter": config.model.drafter},
        per_shape_ms={str(s): statistics.median(v) for s, v in per_shape.items() if v},
        prompts=len(prompts), max_new_tokens=args.max_new_tokens, seconds=round(time.time() - t0, 1),
        created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=command,
    )
    model.save(args.out)
    c, fit = model, model.meta["fit"]
    print(f"step_ms = {c.fixed:.2f} + {c.per_context * 1e3:.3f}e-3 * P + {c.per_draft_level:.3f} * levels + "
          f"{c.per_draft_node:.4f} * drafted nodes + ({c.per_verified_token:.3f} + {c.per_verified_token_context * 1e3:.4f}e-3 * P) "
          f"* verified tokens; mean |rel. error| "
          f"{100 * fit['mean_abs_rel_error']:.1f}% over {fit['steps']} steps; wrote {args.out}")
    if args.prior_out:
        save_prior(args.prior_out, cells[0].reshape(depth + 1, -1), cells[1].reshape(depth + 1, -1),
                   model={"target": config.model.target, "drafter": config.model.drafter}, dtype=config.runtime.dtype,
                   data=args.data or "built-in prompts", prompts=len(prompts), command=command,
                   created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        print(f"calibration prior from {int(cells[1].sum())} verified nodes; wrote {args.prior_out}")
    return 0


def calibrate_batch(config) -> int:
    """``calibrate --batch``: measure the batch engine's cost table here and cache it (replacing a cached one)."""
    from adaptivespec.batch.budget import cost_path, load_or_measure, machine_key
    from adaptivespec.decode import Engine

    engine = Engine(config)
    table = load_or_measure(engine.target, engine.runtime.drafter, config.model.target, config.runtime.precision,
                            engine.runtime.dtype, engine.runtime.device, remeasure=True)
    print(f"calibrate --batch: {table.summary()}")
    print(f"calibrate --batch: wrote {cost_path(machine_key(config.model.target, config.runtime.precision))}")
    return 0
