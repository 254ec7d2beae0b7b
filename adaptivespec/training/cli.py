"""``adaptivespec train-drafter``: self-distil, pick a draft vocabulary, train an EAGLE-3 head.

Output folder ``--out``::

    config.json, model.safetensors   the head (EAGLE-3 layout, bf16), rewritten at each checkpoint
    training/run.json                the run's settings (``--resume`` keeps the data-defining ones)
    training/distill.jsonl           generated self-distillation records (without --distilled)
    training/vocab.json              draft vocabulary and its coverage table
    training/records.txt             ids of the records the run used (the card reads these, not the data file now)
    training/validation.txt          ids of those held out for validation (``--val-ids``, else a seeded draw)
    training/checkpoint.pt           fp32 head + optimiser + data position
    training/log.jsonl               training and validation rows

``--feature-cache DIR`` stores the target's features (fused hidden states, top-k soft labels) of
every record once (built if missing, resumable; ``--build-cache-only`` stops there), and each
epoch then runs the head only (see ``adaptivespec.training.features``).

Run as ``python -m adaptivespec.training.cli --out DIR ...`` or through the adaptivespec CLI.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT

DEFAULT_SOURCES = ["gsm8k-train", "code-alpaca", "mbpp"]
# settings that define the data order and the model: a resumed run keeps the saved ones
KEPT_ON_RESUME = ("target", "data", "mix", "data_root", "distilled", "max_prompts", "max_new_tokens", "draft_vocab",
                  "batch_tokens", "max_len", "ttt_steps", "val_frac", "seed", "prompt_seed", "label_topk",
                  "init_from", "val_ids", "reserve_ids", "kind_weights")
COVERAGE_SIZES = [512, 1024, 2048, 3072, 4096, 6144, 8192, 10240, 12288]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-drafter", help="train an EAGLE-3 draft head by self-distillation",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--target", default="smollm2-135m-instruct", help="target model (embedded name, folder or HF id)")
    a("--out", required=True, type=Path, help="output folder (head + training/ state)")
    a("--data", nargs="+", default=DEFAULT_SOURCES, help=f"prompt sources: {', '.join(DEFAULT_SOURCES)} or jsonl files")
    a("--data-root", type=Path, default=DATA_ROOT, help="folder of the named prompt sources (default: $ADAPTIVESPEC_DATA or shared/data beside the checkout)")
    a("--distilled", type=Path, help="pre-generated {id, prompt_ids, response_ids} jsonl (skips generation)")
    a("--max-prompts", type=int, help="use only the first N prompts / records")
    a("--prompt-seed", type=int, default=20261129, help="shuffle seed of the pooled prompts")
    a("--mix", nargs="?", const="default", metavar="KIND=W,...",
      help="draw prompts from the broad training mix instead of --data: kinds math, code, instruct, qa, rag, "
           "summarize, translate, chat2 with these proportions (no value: the default mix); --max-prompts sets "
           "the total (default 20000)")
    a("--kind-weights", metavar="KIND=W,...", help="times per epoch each training record of a kind is seen (default 1; "
      "0.5 keeps a fixed half, 0 none), e.g. translate=3,rag=2: over-weights kinds at training time without "
      "generating more; validation is unweighted (kinds as in --mix)")
    a("--gen-batch", type=int, default=16, help="most rows decoding at once (continuous batching: a finished row's "
      "place goes to the next prompt)")
    a("--gen-tokens", type=int, default=16384, help="generation cache budget: rows * (cache width + --max-new-tokens)")
    a("--generate-only", action="store_true", help="stop after self-distillation (the data), before training")
    a("--max-new-tokens", type=int, default=384, help="response cap when generating")
    a("--draft-vocab", type=int, default=4096, help="draft vocabulary size N (most frequent response tokens)")
    a("--steps", type=int, help="optimiser steps")
    a("--epochs", type=float, help="passes over the training split")
    a("--budget", help="wall-clock (e.g. 90m, 2h, 3600s) or token (e.g. 2e6tok, 500ktok) budget")
    a("--batch-tokens", type=int, default=4096, help="rows * longest sequence per batch")
    a("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    a("--ttt-steps", type=int, default=7, help="TTT unroll depth K")
    a("--decay", type=float, default=0.8, help="loss weight of step j is decay**j")
    a("--lr", type=float, default=1e-3, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    a("--warmup", type=int, default=30, help="warmup steps")
    a("--clip", type=float, default=0.5, help="gradient-norm clip")
    a("--weight-decay", type=float, default=0.01)
    a("--val-frac", type=float, default=0.025, help="held-out validation fraction of the records")
    a("--val-ids", type=Path, metavar="FILE", help="hold out exactly the records with these ids (one per line) "
      "as validation instead of a seeded --val-frac draw, e.g. to keep a warm start's validation records out of training")
    a("--reserve-ids", type=Path, metavar="FILE", help="prompt ids (one per line) never generated, trained or "
      "validated on: prompts set aside for tuning (a two-turn prompt's first turn too), e.g. corpus/reserved-ids.txt")
    a("--val-max-tokens", type=int, default=12000, help="validation tokens evaluated per checkpoint")
    a("--checkpoint-minutes", type=float, default=15.0, help="minutes between checkpoints / exports")
    a("--resume", action="store_true", help="continue from <out>/training/checkpoint.pt")
    a("--init-from", metavar="HEAD", help="start from this head's weights instead of a random init (a head folder or "
      "'embedded'); its output rows are carried over by target token id into the new draft vocabulary")
    a("--threads", type=int, help="torch intra-op threads")
    a("--device", default="cpu", help="where the target and the head run: generation, the feature cache and training "
      "(cpu, cuda, cuda:1, ...; default cpu); the data, checkpoints and the exported head are the same either way")
    a("--seed", type=int, default=0, help="init, split and batch-order seed")
    a("--target-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the target forward")
    a("--no-bf16", dest="bf16", action="store_false", help="train the head without bf16 autocast")
    a("--quiet", action="store_true", help="no progress bars")
    a("--feature-cache", type=Path, help="folder of cached target features (built if missing, resumable); training then skips the target forward")
    a("--build-cache-only", action="store_true", help="build --feature-cache and stop (no training)")
    a("--label-topk", type=int, help="soft labels: the target's k most likely draft tokens, renormalised "
      "(default: the full distribution; with --feature-cache the cache's k, default 64)")


def parse_budget(text: str | None) -> tuple[float | None, int | None]:
    """``90m`` / ``2h`` / ``3600s`` -> (seconds, None); ``2e6tok`` / ``500ktok`` -> (None, tokens)."""
    if text is None:
        return None, None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(s|m|min|h|tok|ktok|mtok)\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise AdaptiveSpecError(f"--budget: {text!r} is not a budget; expected a positive number with a unit: "
                                "s, m, h (wall clock) or tok, ktok, Mtok (training tokens), e.g. 90m or 2e6tok")
    value, unit = float(m.group(1)), m.group(2)
    if unit in ("s", "m", "min", "h"):
        return value * {"s": 1, "m": 60, "min": 60, "h": 3600}[unit], None
    return None, int(value * {"tok": 1, "ktok": 1e3, "mtok": 1e6}[unit])


def check_args(args) -> None:
    positive = ["max_prompts", "gen_batch", "gen_tokens", "max_new_tokens", "draft_vocab", "steps", "batch_tokens",
                "max_len", "ttt_steps", "warmup", "val_max_tokens", "threads", "label_topk"]
    for name in positive:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise AdaptiveSpecError(f"--{name.replace('_', '-')}: {v} is not allowed; expected a positive integer")
    for name, lo, hi in [("lr", 0, 1), ("val_frac", 0, 0.5), ("decay", 0, 1), ("min_lr_ratio", 0, 1), ("clip", 0, 1e9),
                         ("checkpoint_minutes", 0, 1e9), ("epochs", 0, 1e9)]:
        v = getattr(args, name)
        if v is not None and not (lo < v <= hi or (name == "min_lr_ratio" and v == 0)):
            raise AdaptiveSpecError(f"--{name.replace('_', '-')}: {v} is not allowed; expected a number in ({lo}, {hi}]")
    if args.distilled is not None and not args.distilled.is_file():
        raise AdaptiveSpecError(f"--distilled: {str(args.distilled)!r} is not a file; expected a jsonl of "
                                "{id, prompt_ids, response_ids} records")
    if args.out.exists() and not args.out.is_dir():
        raise AdaptiveSpecError(f"--out: {str(args.out)!r} is a file; expected a folder")
    ckpt = args.out / "training" / "checkpoint.pt"
    if args.resume and not ckpt.is_file():
        raise AdaptiveSpecError(f"--resume: no checkpoint at {ckpt}; expected a folder written by train-drafter")
    if not args.resume and ckpt.is_file():
        raise AdaptiveSpecError(f"--out: {str(args.out)!r} already holds a run ({ckpt}); expected --resume or a new folder")
    parse_budget(args.budget)
    check_device(getattr(args, "device", "cpu"))
    for flag in ("val_ids", "reserve_ids"):
        if getattr(args, flag, None) is not None:
            from adaptivespec.training.data import read_ids

            read_ids(getattr(args, flag), f"--{flag.replace('_', '-')}")  # fails here, before the target loads
    if getattr(args, "init_from", None):
        from adaptivespec.drafter import resolve_drafter_path
        from adaptivespec.errors import ModelLoadError

        try:
            resolve_drafter_path(args.init_from)
        except ModelLoadError:
            raise AdaptiveSpecError(f"--init-from: {str(args.init_from)!r} is not a head; expected a folder with "
                                    "config.json + model.safetensors (EAGLE-3 layout) or 'embedded'") from None
    if args.build_cache_only and args.feature_cache is None:
        raise AdaptiveSpecError("--build-cache-only: no --feature-cache given; expected --feature-cache DIR to build")
    if args.feature_cache is not None and args.feature_cache.exists() and not args.feature_cache.is_dir():
        raise AdaptiveSpecError(f"--feature-cache: {str(args.feature_cache)!r} is a file; expected a folder")
    if args.kind_weights is not None:
        from adaptivespec.training.mix import parse_kind_weights

        parse_kind_weights(args.kind_weights)
    if args.mix is not None:
        from adaptivespec.training.mix import parse_mix

        parse_mix(args.mix)
    elif args.distilled is None:
        from adaptivespec.training.data import source_path

        for spec in args.data:
            source_path(spec, args.data_root)


def check_device(device: str) -> None:
    """A device torch knows and this machine has (one line naming --device otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise AdaptiveSpecError(f"--device: {device!r} is not a device; expected cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise AdaptiveSpecError(f"--device: {device!r} is not supported; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise AdaptiveSpecError(f"--device: {device!r} is not available on this machine (torch {torch.__version__} "
                                "sees no CUDA device); expected cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise AdaptiveSpecError(f"--device: {device!r} is not on this machine; expected an index below "
                                f"{torch.cuda.device_count()}")


def _settings(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("func", "build_cache_only")}


def _merge_resume(args) -> None:
    saved = json.loads((args.out / "training" / "run.json").read_text())
    if args.budget is None and args.steps is None and args.epochs is None:  # keep the saved limits
        args.budget, args.steps, args.epochs = saved.get("budget"), saved.get("steps"), saved.get("epochs")
    for key in KEPT_ON_RESUME:
        if key in saved:
            new = _settings(args).get(key)
            if new != saved[key] and new is not None:
                print(f"train-drafter: --resume keeps the saved {key}={saved[key]!r} (ignoring {new!r})", file=sys.stderr)
            value = saved[key]
            setattr(args, key, Path(value) if key in ("data_root", "distilled") and value else value)


def load_records(args, target, tok):
    from adaptivespec.training.data import distill, load_prompts, read_ids, read_records, unreserved

    reserved = read_ids(args.reserve_ids, "--reserve-ids") if getattr(args, "reserve_ids", None) else set()
    if args.distilled is not None:
        records = read_records(args.distilled)
        return unreserved(records[: args.max_prompts] if args.max_prompts else records, reserved)
    if args.mix is not None:
        from adaptivespec.training.mix import build_mix, mix_counts, parse_mix

        prompts = build_mix(args.max_prompts or 20000, parse_mix(args.mix), args.data_root, args.prompt_seed)
        print(f"train-drafter: mix {mix_counts(prompts)}", file=sys.stderr, flush=True)
    else:
        prompts = load_prompts(args.data, args.data_root, args.prompt_seed, args.max_prompts)
    prompts = unreserved(prompts, reserved)
    path = args.out / "training" / "distill.jsonl"
    records = distill(target, tok, prompts, path, batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens,
                      progress=not args.quiet, gen_tokens=args.gen_tokens)
    wanted = {p.id for p in prompts} | {f"{p.id}-t1" for p in prompts if p.follow_up is not None}
    return unreserved([r for r in records if r.id in wanted], reserved)


def build_drafter(target, vocab_ids: torch.Tensor, seed: int):
    """EAGLE-3 head in fp32, randomly initialised (``Eagle3Drafter.random_init``), over ``vocab_ids``.

    (Starting lm_head / norm from the target's rows was measured worse over the first steps:
    validation top-1 0.04 vs 0.15 after 12 steps of 2k tokens.)
    """
    from adaptivespec.drafter import Eagle3Drafter

    d = Eagle3Drafter.random_init(target, int(vocab_ids.shape[0]), seed=seed).float()
    d.set_vocab(vocab_ids)
    return d


def warm_start(drafter, source, what: str = "--init-from") -> dict:
    """Copy ``source``'s weights into ``drafter`` (same head geometry, draft vocabularies may differ).

    Every parameter but the output layer is copied as is; the output layer's row of each target
    token both draft vocabularies hold is copied, the others keep ``drafter``'s initialisation.
    Returns ``{"copied_rows", "new_rows"}``."""
    src = dict(source.named_parameters())
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name == "lm_head.weight":
                continue
            if name not in src or src[name].shape != p.shape:
                shape = None if name not in src else tuple(src[name].shape)
                raise AdaptiveSpecError(f"{what}: the head's {name} has shape {shape}; expected {tuple(p.shape)} "
                                        "(a head of the same geometry for this target)")
            p.copy_(src[name].to(p.dtype))
        new_ids = torch.arange(drafter.d2t.shape[0]) + drafter.d2t.cpu()
        src_ids = torch.arange(source.d2t.shape[0]) + source.d2t.cpu()
        row_of = torch.full((int(max(new_ids.max(), src_ids.max())) + 1,), -1, dtype=torch.long)
        row_of[src_ids] = torch.arange(src_ids.shape[0])
        rows = row_of[new_ids]
        have = rows >= 0  # on the host; the weights may be on an accelerator
        w, ws = drafter.lm_head.weight, source.lm_head.weight
        w[have.to(w.device)] = ws[rows[have].to(ws.device)].to(w)
    return {"copied_rows": int(have.sum()), "new_rows": int((~have).sum())}


def vocabulary(args, train, val, vocab_size: int, hidden: int) -> torch.Tensor:
    from adaptivespec.training.vocab import coverage_table, token_counts, top_ids

    counts = token_counts(train, vocab_size)
    ids = top_ids(counts, args.draft_vocab)
    table = coverage_table(counts, COVERAGE_SIZES + [args.draft_vocab], hidden)
    if val:
        vc = token_counts(val, vocab_size)
        for row in table:
            if isinstance(row["n"], int):
                row["val_coverage"] = float(vc[top_ids(counts, row["n"])].sum()) / max(int(vc.sum()), 1)
    info = {"draft_vocab": args.draft_vocab, "train_response_tokens": int(counts.sum()), "coverage": table, "ids": ids.tolist()}
    (args.out / "training" / "vocab.json").write_text(json.dumps(info) + "\n")
    return ids


def feature_cache(args, target, tok, records, vocab_ids):
    """Open ``--feature-cache`` (building or finishing it first); refuses a cache of other data."""
    from adaptivespec.drafter import default_aux_layers
    from adaptivespec.training import features

    tc = target.config
    key = features.cache_key(target=args.target, target_dtype=args.target_dtype, aux_layers=default_aux_layers(tc.num_hidden_layers),
                             target_hidden=tc.hidden_size, vocab_ids=vocab_ids, records=records, topk=args.label_topk,
                             max_len=args.max_len)
    state = features.status(args.feature_cache, key)
    if state != "complete":
        t0 = time.time()
        print(f"train-drafter: {'finishing' if state == 'partial' else 'building'} the feature cache {args.feature_cache} "
              f"({len(records)} records, k={key['label_topk']})", file=sys.stderr, flush=True)
        features.build(args.feature_cache, key, target, records, vocab_ids, batch_tokens=args.batch_tokens,
                       pad=tok.eos_token_id, progress=not args.quiet)
        print(f"train-drafter: feature cache built in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    cache = features.FeatureCache(args.feature_cache, key)
    tokens = len(cache.states) if cache.states is not None else 0
    print(f"train-drafter: feature cache {args.feature_cache}: {tokens} tokens, {cache.disk_bytes() / 1e9:.2f} GB "
          f"({cache.disk_bytes() / max(tokens, 1):.0f} bytes per token)", file=sys.stderr, flush=True)
    return cache


def run(args) -> int:
    from adaptivespec.models import load_target
    from adaptivespec.training.data import read_ids, split
    from adaptivespec.training.trainer import Trainer, TrainConfig

    check_args(args)
    if args.resume:
        _merge_resume(args)
    if args.feature_cache is not None and args.label_topk is None:
        from adaptivespec.training.features import DEFAULT_TOPK

        args.label_topk = DEFAULT_TOPK
    (args.out / "training").mkdir(parents=True, exist_ok=True)
    if not args.resume and not args.build_cache_only:
        (args.out / "training" / "run.json").write_text(json.dumps(_settings(args), indent=2) + "\n")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target, tok = load_target(args.target, args.target_dtype, getattr(args, "device", "cpu"))
    records = load_records(args, target, tok)
    if args.generate_only:
        print(f"train-drafter: --generate-only: {len(records)} records in {args.out / 'training' / 'distill.jsonl'}",
              file=sys.stderr, flush=True)
        return 0
    if len(records) < 2:
        raise AdaptiveSpecError(f"--data: {len(records)} usable records; expected at least 2")
    if not args.resume:
        (args.out / "training" / "records.txt").write_text("".join(f"{r.id}\n" for r in records))
    train, val = split(records, args.val_frac, args.seed, read_ids(args.val_ids, "--val-ids") if args.val_ids else None)
    if args.val_ids and not (val and train):
        raise AdaptiveSpecError(f"--val-ids: {str(args.val_ids)!r} holds out {len(val)} of {len(records)} records; "
                                "expected at least one record in each of training and validation")
    if not args.resume:
        (args.out / "training" / "validation.txt").write_text("".join(f"{r.id}\n" for r in val))
    vocab_ids = vocabulary(args, train, val, target.config.vocab_size, target.config.hidden_size)
    cache = feature_cache(args, target, tok, records, vocab_ids) if args.feature_cache is not None else None
    if args.build_cache_only:
        return 0
    drafter = build_drafter(target, vocab_ids, args.seed)
    if args.init_from and not args.resume:
        from adaptivespec.drafter import Eagle3Drafter
        from adaptivespec.errors import ModelLoadError

        try:
            source = Eagle3Drafter.from_pretrained(args.init_from, target, dtype=torch.float32)
        except ModelLoadError as e:
            raise AdaptiveSpecError(f"--init-from: {str(e).removeprefix('model.drafter: ')}") from None
        info = warm_start(drafter, source)
        print(f"train-drafter: --init-from {args.init_from}: weights copied, output rows {info['copied_rows']} carried "
              f"over by token id, {info['new_rows']} new", file=sys.stderr, flush=True)
    seconds, tokens = parse_budget(args.budget)
    epochs = args.epochs if (args.epochs or args.steps or args.budget) else 1.0
    cfg = TrainConfig(out=args.out, k_steps=args.ttt_steps, decay=args.decay, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
                      warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, batch_tokens=args.batch_tokens,
                      max_len=args.max_len, steps=args.steps, epochs=epochs, budget_seconds=seconds, budget_tokens=tokens,
                      checkpoint_minutes=args.checkpoint_minutes, val_max_tokens=args.val_max_tokens, bf16=args.bf16,
                      seed=args.seed, progress=not args.quiet, label_topk=args.label_topk)
    if args.kind_weights:
        from adaptivespec.training.mix import parse_kind_weights, weight_records

        train = weight_records(train, parse_kind_weights(args.kind_weights), args.seed)
        if not train:
            raise AdaptiveSpecError(f"--kind-weights: {args.kind_weights!r} leaves no training record; expected a "
                                    "weight > 0 for a kind the data has")
    trainer = Trainer(cfg, target, drafter, vocab_ids, train, val, pad=tok.eos_token_id, cache=cache)
    if args.resume:
        trainer.restore(args.out / "training" / "checkpoint.pt")
    trainer.log({"kind": "start", "resume": args.resume, "step": trainer.state.step, "budget": args.budget,
                 "steps": args.steps, "epochs": epochs, "threads": torch.get_num_threads(), "device": str(trainer.device),
                 "feature_cache": str(args.feature_cache) if cache else None, "label_topk": args.label_topk})
    print(f"train-drafter: {len(train)} train{' (weighted)' if args.kind_weights else ''} / {len(val)} validation records, "
          f"{sum(r.length for r in train)} train tokens, {len(trainer.groups)} batches per epoch, "
          f"draft vocabulary {args.draft_vocab}, K={args.ttt_steps}; starting at step {trainer.state.step}",
          file=sys.stderr, flush=True)
    state = trainer.run()
    print(f"train-drafter: done: step {state.step}, {state.tokens} tokens, {state.seconds:.0f} s training "
          f"({time.time() - t0:.0f} s wall); head in {args.out}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaptivespec train-drafter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except AdaptiveSpecError as exc:
        print(f"adaptivespec train-drafter: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
