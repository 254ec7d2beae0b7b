"""Measure a trained head's accepted length and write its model card (``README.md``).

    python -m adaptivespec.training.card RUN_DIR [--dest HEAD_DIR] [--prompts 8] [--max-new-tokens 128] [--bench RUN ...]

``RUN_DIR`` is a ``train-drafter --out`` folder. The head is decoded (bf16, static policy,
strict verifier) on the first ``--prompts`` held-out validation records of the run (the same
split as training) and on two fixed prompts that are not training prompts; the accepted length
is ``tau = new tokens / target forwards`` pooled over prompts. With ``--dest`` the head files
are copied there first and the card is written next to them (else into ``RUN_DIR``). ``--bench``
adds a per-category table (tau, speedup over ``ar``) from each ``adaptivespec bench`` run folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

#: an original passage (written for this project, in no training or evaluation set) for a long-context summary
LONG_PASSAGE = """\
Most towns draw their drinking water from a river, a lake or a well, and none of these sources is clean enough to
drink as it comes. A treatment plant works through a fixed sequence of steps, each one removing a different kind of
impurity, and the order matters because every step makes the next one easier.

The first step is screening. Water enters the plant through metal bars and fine screens that stop leaves, branches,
fish and plastic. The screens are cleaned by rakes that run on a timer, and the material they collect is taken to a
landfill. Screening removes nothing that is dissolved, but it protects the pumps and pipes further along.

The second step is coagulation. Small particles of clay, silt and organic matter carry a negative electric charge, so
they repel one another and stay suspended for days. Operators add a coagulant, usually aluminium sulphate or ferric
chloride, whose positive charge neutralises the particles. The water is mixed hard for a minute or two so that the
chemical reaches every part of it.

Next comes flocculation. In long basins the water is stirred slowly by paddles, and the neutralised particles bump into
one another and stick together. Over twenty to forty minutes they grow into soft clumps called floc, large enough to be
seen. Stirring too fast would tear the floc apart, so the paddles turn more slowly toward the end of the basin.

In the sedimentation tanks the water barely moves. The heavy floc sinks to the bottom over several hours and forms a
sludge that is scraped away and dried. The water drawn off the top is already much clearer, but it still holds fine
particles and most of the bacteria and viruses that were in the source.

Filtration removes much of what is left. The water trickles down through beds of sand, gravel and often activated
carbon. The sand traps fine particles, while the carbon adsorbs chemicals that cause bad tastes and smells. Filters
clog slowly, so every day or two they are backwashed: clean water is pumped upward through the bed to lift out the
trapped dirt.

The last treatment step is disinfection. Chlorine, chloramine, ozone or ultraviolet light kills the bacteria and
viruses that passed the filters. Chlorine has one advantage the others lack: a small amount stays in the water as it
travels through kilometres of pipes to homes, and it keeps protecting the water on the way. Many plants also adjust the
acidity of the water so that it does not corrode old pipes, and some add fluoride to protect teeth.

Throughout the process, laboratory staff test samples every few hours for turbidity, chlorine level, acidity and
bacteria. If a result falls outside its limits, operators can change the chemical doses, take a filter out of service,
or in the worst case warn residents to boil their water until the problem is fixed."""

#: two prompts of different kinds that no training mix contains: a long-passage summary and a math word problem
FIXED_PROMPTS = [
    "Summarize the following text in a few sentences.\n\n" + LONG_PASSAGE,
    "A baker makes 24 muffins in each batch. She bakes 7 batches and sells all but 18 muffins. "
    "How many muffins does she sell? Explain briefly.",
]
SHAPES = [(3, 4, 8), (5, 1, 6), (5, 4, 8)]  # eagle3.yaml's shape first (a test checks)


def measure(head: Path, prompts: list[list[int]], max_new_tokens: int, shape: tuple[int, int, int]) -> dict:
    """Pooled and per-prompt tau of ``head`` for one static shape (bf16, strict)."""
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    n, k, d = shape
    eng = Engine(load_config(None, [f"model.drafter={head}", "runtime.dtype=bfloat16", "policy.name=static",
                                    f"policy.nsteps={n}", f"policy.topk={k}", f"policy.ndt={d}", "verifier.name=strict"]))
    new = fwd = 0
    taus, t0 = [], time.perf_counter()
    for ids in prompts:
        st = eng.generate_ids(ids, max_new_tokens=max_new_tokens).stats
        new, fwd = new + st["new_tokens"], fwd + st["target_forwards"]
        taus.append(round(st["accept_length_mean"], 3))
    return {"shape": list(shape), "tau": round(new / fwd, 3), "tau_per_prompt": taus, "new_tokens": new,
            "tokens_per_second": round(new / (time.perf_counter() - t0), 1)}


def _machine() -> str:
    from adaptivespec.evaluation.report import machine_info

    m = machine_info(["cuda"] if torch.cuda.is_available() else [])
    gpus = ", ".join(m.get("gpus", {}).values())
    return f"{m['cpu']}, {m['usable_cpus']} usable CPUs" + (f", {gpus}" if gpus else ", no GPU")


def log_rows(run: Path) -> list[dict]:
    """Every row of a train-drafter run's ``training/log.jsonl`` (empty when it has none)."""
    path = run / "training" / "log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _shown(path: str) -> str:
    """A path as the card shows it: relative to the repository or the data root, never a machine's absolute path."""
    from adaptivespec.training.data import DATA_ROOT

    p = Path(path)
    for base, label in ((Path(__file__).resolve().parents[2], ""), (DATA_ROOT, "shared/data/")):
        try:
            return label + str(p.resolve().relative_to(base.resolve()))
        except ValueError:
            pass
    return p.name


def data_section(run: Path, settings: dict, vocab: dict) -> list[str]:
    """The card's data paragraph: the sources or the broad mix with its proportions and realised counts."""
    if settings.get("val_ids"):
        held = run / "training" / "validation.txt"
        n = f", {len(held.read_text().split()):,} held out" if held.is_file() else ""
        split = f"Held-out validation: the records named in `{_shown(settings['val_ids'])}` (`--val-ids`){n}; "
    else:
        split = (f"Records split {100 * (1 - settings['val_frac']):.1f} / {100 * settings['val_frac']:.1f} % "
                 f"(seed {settings['seed']}) into training and held-out validation; ")
    split += f"{vocab['train_response_tokens']:,} training response tokens."
    if settings.get("reserve_ids"):
        split += (f" The prompts named in `{_shown(settings['reserve_ids'])}` (`--reserve-ids`) are set aside for "
                  "tuning: never generated, trained or validated on.")
    if settings.get("mix") is None:
        return [f"Self-distillation: `{_shown(settings['distilled']) if settings.get('distilled') else 'generated'}` — "
                "the target's own greedy answers (chat template, one user message) to GSM8K *train*, CodeAlpaca and "
                "MBPP non-test prompts; no evaluation set. " + split]
    from adaptivespec.training.mix import kind_of, parse_mix

    counts: dict[str, list[int]] = {}
    for r in _records(run, settings):
        c = counts.setdefault(kind_of(r.id), [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + len(r.response_ids)
    rows = ["Self-distillation on the broad training mix (`train-drafter --mix "
            f"{settings['mix']}`, {settings.get('max_prompts') or 20000} prompts drawn, prompt seed "
            f"{settings.get('prompt_seed')}): the target's own greedy answers to training-split prompts of every kind "
            "users send (`adaptivespec/training/mix.py` lists the sources); no evaluation set. " + split, "",
            "| kind | share asked | records | response tokens |", "|---|---:|---:|---:|"]
    for kind, share in parse_mix(settings["mix"]).items():
        n, t = counts.get(kind, [0, 0])
        rows.append(f"| {kind} | {share:.2f} | {n:,} | {t:,} |")
    if settings.get("kind_weights"):
        rows += ["", f"Training weights (`--kind-weights {settings['kind_weights']}`): each training record of a listed kind "
                 "is seen that many times per epoch (others once); validation is unweighted."]
    return rows


def _records(run: Path, settings: dict):
    from adaptivespec.training.data import read_records

    src = Path(settings["distilled"]) if settings.get("distilled") else run / "training" / "distill.jsonl"
    if not src.is_file():
        return []
    records = read_records(src)
    used = run / "training" / "records.txt"
    if used.is_file():  # the records the run trained on, though the data file may have grown since
        ids = set(used.read_text().split())
        return [r for r in records if r.id in ids]
    return records[: settings["max_prompts"]] if settings.get("max_prompts") else records


def _split(run: Path, settings: dict, records):
    """(train, validation) as the run split them: its ``training/validation.txt`` when written, else the seeded draw."""
    from adaptivespec.training.data import read_ids, split

    held = run / "training" / "validation.txt"
    return split(records, settings["val_frac"], settings["seed"], read_ids(held, "validation") if held.is_file() else None)


def kind_coverage(run: Path, settings: dict, vocab: dict) -> list[str]:
    """Rows of the per-kind coverage table of the chosen vocabulary (broad-mix runs only)."""
    if settings.get("mix") is None or "ids" not in vocab:
        return []
    from adaptivespec.training.mix import kind_of
    from adaptivespec.training.vocab import coverage_by_kind

    records = _records(run, settings)
    if not records:
        return []
    train, val = _split(run, settings, records)
    ids = torch.tensor(vocab["ids"], dtype=torch.long)
    tr, va = (coverage_by_kind(x, ids, kind_of) for x in (train, val))
    rows = ["", f"Coverage of the chosen N = {settings['draft_vocab']} per kind of prompt:", "",
            "| kind | training response tokens | train coverage | validation coverage |", "|---|---:|---:|---:|"]
    for kind, c in tr.items():
        v = va.get(kind, {}).get("coverage")
        rows.append(f"| {kind} | {c['tokens']:,} | {c['coverage']:.4f} | " + (f"{v:.4f}" if v is not None else "-") + " |")
    return rows


def kind_validation(by_step: dict[int, dict], k: int) -> list[str]:
    """Rows of the per-kind validation table: the last validation by draft step, and where the run began at j=0."""
    steps = [s for s in sorted(by_step) if by_step[s].get("val_acc_by_kind")]
    if not steps:
        return []
    first, last = by_step[steps[0]], by_step[steps[-1]]
    rows = ["", f"Per kind of record (held-out rows labelled at j=0; j=0 at step {steps[0]} beside the last validation, "
            f"step {steps[-1]}):", "",
            "| kind | rows | j=0 at step " + f"{steps[0]} | " + " | ".join(f"j={j}" for j in range(k)) + " |",
            "|---|---:|---:|" + "---:|" * k]
    for kind, acc in last["val_acc_by_kind"].items():
        start = first["val_acc_by_kind"].get(kind)
        rows.append(f"| {kind} | {last['val_rows_by_kind'].get(kind, 0):,} | " + (f"{start[0]:.3f}" if start else "-")
                    + " | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
    return rows


def bench_section(path: Path, head: str | None = None) -> list[str]:
    """Per-category accepted length and speedup over plain decoding from ``adaptivespec bench`` results.

    ``head``: the contender that ran this card's head, listed first (default: the run's reference)."""
    res = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    ar, ref = res.get("ar"), head or res.get("reference")
    meta = res["meta"]
    rows = [f"`{ref}` (and any other contender) against `{ar}` in one `adaptivespec bench` run, contenders alternating per prompt "
            f"({meta.get('dataset')}, {meta.get('max_new_tokens')} new tokens, "
            f"{meta['machine'].get('cpu')}, {meta['machine'].get('torch_threads')} threads):", "",
            "| category | prompts | config | tau | speedup vs AR | tok/s | AR tok/s |", "|---|---:|---|---:|---:|---:|---:|"]
    cats = res.get("categories") or {meta.get("dataset"): {"prompts": meta.get("prompts"), "configs": res["configs"]}}
    for cat, c in cats.items():  # a dataset without categories (gsm8k, humaneval) is one row
        by = {x["name"]: x for x in c["configs"]}
        if ar not in by:
            continue
        a = by[ar]
        for name in [ref] + sorted(n for n in by if n not in (ar, ref)):  # the reference first, then the others
            if name in by:
                e = by[name]
                rows.append(f"| {cat} | {c['prompts']} | `{name}` | {e['accept_length_mean']:.2f} | "
                            f"{e['tokens_per_second'] / a['tokens_per_second']:.2f}x | {e['tokens_per_second']:.1f} | "
                            f"{a['tokens_per_second']:.1f} |")
    return rows + [""]


def card(run: Path, evals: dict, n_val: int, max_new: int, command: str, benches: list[Path] = (),
         bench_head: str | None = None) -> str:
    settings = json.loads((run / "training" / "run.json").read_text())
    vocab = json.loads((run / "training" / "vocab.json").read_text())
    rows = log_rows(run)
    val = [r for r in rows if r["kind"] == "val"]
    last = val[-1] if val else {}
    first_time, last_time = (rows[0]["time"], rows[-1]["time"]) if rows else ("?", "?")
    k = settings["ttt_steps"]
    out = ["# SmolLM2-135M-Instruct EAGLE-3 draft head", "",
           "An EAGLE-3 draft head (one decoder layer, fc over target layers 1 / 14 / 26, draft vocabulary "
           f"{settings['draft_vocab']}) for the embedded SmolLM2-135M-Instruct, in the EAGLE-3 / SpecForge checkpoint "
           "layout (`config.json` + `model.safetensors`, bf16). Trained with `adaptivespec train-drafter`.", "",
           "## Data", "",
           *data_section(run, settings, vocab), "",
           "## Draft vocabulary", "",
           "The N most frequent response tokens of the training split. Coverage = fraction of response tokens "
           "inside the vocabulary (training split / held-out validation split); lm_head size in bf16.", "",
           "| N | train coverage | validation coverage | lm_head MB |", "|---|---|---|---|"]
    seen = set()
    for r in vocab["coverage"]:
        if isinstance(r["n"], int) and r["n"] not in seen:
            seen.add(r["n"])
            out.append(f"| {r['n']} | {r['coverage']:.4f} | {r.get('val_coverage', float('nan')):.4f} | {r['lm_head_mb']:.1f} |")
    chosen = next((r for r in vocab["coverage"] if r["n"] == settings["draft_vocab"]), {})
    out += kind_coverage(run, settings, vocab)
    out += ["", f"Chosen N = {settings['draft_vocab']} (held-out coverage {chosen.get('val_coverage', float('nan')):.4f}, "
            f"lm_head {chosen.get('lm_head_mb', float('nan')):.1f} MB): the rows beyond it are tokens seen only a few "
            "times in training, while the lm_head's training and drafting cost grows linearly with N.", "",
            "## Training", "",
            f"EAGLE-3 recipe: training-time-test unroll K = {k} with loss weights {settings['decay']}^j, soft "
            "cross-entropy against the target's distribution restricted to the draft vocabulary"
            + (f" (its top {settings['label_topk']} entries, renormalised)" if settings.get("label_topk") else "")
            + (", target hidden states and labels computed once per record (no-grad bf16 forward) and read from a "
               "feature cache" if settings.get("feature_cache") else
               ", target hidden states recomputed each batch (no-grad bf16 forward)")
            + ", head trained in fp32 under bf16 autocast; "
            f"AdamW (peak lr {settings['lr']}, warmup {settings['warmup']} steps, cosine to "
            f"{settings['min_lr_ratio']}x), gradient clip {settings['clip']}, {settings['batch_tokens']} tokens per batch."
            + (f" Initialised from the head `{_shown(settings['init_from']) if settings['init_from'] != 'embedded' else 'embedded'}` "
               "(output rows carried over by target token id) instead of a random init." if settings.get("init_from") else ""), "",
            f"- steps {last.get('step', '?')}, training tokens {last.get('tokens', 0):,} "
            f"(epoch {last.get('epoch', '?')}, batch {last.get('index', '?')}), "
            f"{last.get('seconds', 0) / 3600:.2f} h of training steps; log from {first_time} to {last_time}",
            f"- machine writing this card: {_machine()}; Python {platform.python_version()}, torch {torch.__version__}",
            f"- budget `{settings.get('budget')}`, command settings in `training/run.json` of the run"
            + "".join(f"; resumed at step {r['step']} (budget `{r.get('budget')}`)"
                      for r in rows if r["kind"] == "start" and r.get("resume")), "",
            "## Validation (held-out records, teacher-forced)", "",
            "Top-1 agreement of draft step j with the target's greedy token (restricted to the draft vocabulary):", "",
            "| step | training tokens | " + " | ".join(f"j={j}" for j in range(k)) + " |", "|---|---:|" + "---|" * k]
    by_step = {r["step"]: r for r in val}  # a resumed run may validate a step twice: keep the last
    for step in sorted(by_step):
        r = by_step[step]
        out.append(f"| {step} | {r.get('tokens', 0):,} | " + " | ".join(f"{a:.3f}" for a in r["val_acc"]) + " |")
    out += kind_validation(by_step, k)
    out += ["", "## Mean accepted length", "",
            "tau = generated tokens / target forwards (bf16, static policy, strict verifier, "
            f"max {max_new} new tokens).", "", "| prompts | shape (nsteps, topk, ndt) | tau | per prompt |", "|---|---|---|---|"]
    for name, res in evals.items():
        for e in res:
            out.append(f"| {name} | {tuple(e['shape'])} | {e['tau']:.3f} | {e['tau_per_prompt']} |")
    out += ["", f"Measured with `{command}`.",
            "Validation prompts: the first held-out records of the split above. Fixed prompts: "
            "`adaptivespec.training.card.FIXED_PROMPTS` (a 658-token passage to summarise and a word problem).", ""]
    if benches:
        out += ["## Per task category (evaluation prompts)", ""]
    for b in benches:
        out += bench_section(b, bench_head)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from adaptivespec.models import encode_prompt, load_target

    p = argparse.ArgumentParser(prog="python -m adaptivespec.training.card", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--dest", type=Path)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bench", type=Path, nargs="*", default=[],
                   help="results.json of adaptivespec bench runs to table per category")
    p.add_argument("--bench-head", metavar="NAME", help="the bench contender that ran this head, listed first "
                   "(default: each run's reference, eagle3 when present)")
    args = p.parse_args(argv)
    for b in args.bench:
        if not (b / "results.json" if b.is_dir() else b).is_file():
            p.error(f"--bench: {str(b)!r} is neither a bench run folder nor its results.json")
    torch.set_num_threads(args.threads)
    head = args.run
    if args.dest:
        args.dest.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(args.run / name, args.dest / name)
        head = args.dest
    settings = json.loads((args.run / "training" / "run.json").read_text())
    records = _records(args.run, settings)
    _, val = _split(args.run, settings, records)
    _, tok = load_target(settings["target"], "bfloat16")
    sets = {f"{min(args.prompts, len(val))} validation": [r.prompt_ids for r in val[: args.prompts]],
            "2 fixed": [encode_prompt(tok, t) for t in FIXED_PROMPTS]}
    evals = {name: [measure(head, ids, args.max_new_tokens, s) for s in SHAPES] for name, ids in sets.items()}
    print(json.dumps(evals), flush=True)
    command = "python -m adaptivespec.training.card " + " ".join(sys.argv[1:] if argv is None else argv)
    text = card(args.run, evals, args.prompts, args.max_new_tokens, command, args.bench, args.bench_head)
    (head / "README.md").write_text(text)
    print(f"wrote {head / 'README.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
