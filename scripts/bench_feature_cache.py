"""Training throughput with and without ``--feature-cache``, interleaved step by step in one process.

Two trainers start from the same head (same seed) and see the same batches in the same order; each
step runs the uncached trainer (target forward + head) and then the cached one (cache read + head),
so a change in machine load hits both alike. Prints the build time and size of the cache, tokens/s of
both paths, the target forward's share of the uncached step, and the two loss trajectories.

    python scripts/bench_feature_cache.py --records 300 --steps 12 --threads 1

Defaults mirror the shipped head: draft vocabulary 6144, K = 6, 4096 batch tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distilled", type=Path, default=None, help="distilled records (default: DATA_ROOT/distill/smollm2-135m-instruct.jsonl)")
    p.add_argument("--records", type=int, default=300)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draft-vocab", type=int, default=6144)
    p.add_argument("--ttt-steps", type=int, default=6)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--label-topk", type=int, default=64)
    p.add_argument("--cache", type=Path, help="cache folder (default: a temporary one, removed after)")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from adaptivespec.models import load_target
    from adaptivespec.training import features
    from adaptivespec.training.cli import build_drafter
    from adaptivespec.training.data import DATA_ROOT, read_records, split
    from adaptivespec.training.trainer import Trainer, TrainConfig
    from adaptivespec.training.vocab import token_counts, top_ids

    distilled = a.distilled or DATA_ROOT / "distill" / "smollm2-135m-instruct.jsonl"
    target, tok = load_target("smollm2-135m-instruct", "bfloat16")
    records = read_records(distilled)[: a.records]
    train, val = split(records, 0.025, 0)
    vocab = top_ids(token_counts(train, target.config.vocab_size), a.draft_vocab)
    key = features.cache_key(target="smollm2-135m-instruct", target_dtype="bfloat16", aux_layers=[1, 14, 26],
                             target_hidden=target.config.hidden_size, vocab_ids=vocab, records=records, topk=a.label_topk,
                             max_len=1024)
    tmp = None
    if a.cache is None:
        tmp = Path(tempfile.mkdtemp(prefix="feature-cache-"))
        a.cache = tmp / "cache"
    t0 = time.perf_counter()
    features.build(a.cache, key, target, records, vocab, batch_tokens=a.batch_tokens, pad=tok.eos_token_id, progress=False)
    build_s = time.perf_counter() - t0
    cache = features.FeatureCache(a.cache, key)
    n_tok = cache.states.shape[0]
    out = Path(tempfile.mkdtemp(prefix="bench-out-"))

    def trainer(c, topk):
        cfg = TrainConfig(out=out, k_steps=a.ttt_steps, batch_tokens=a.batch_tokens, steps=10**6, warmup=5, progress=False,
                          label_topk=topk)
        return Trainer(cfg, target, build_drafter(target, vocab, 0), vocab, train, val, pad=tok.eos_token_id, cache=c)

    plain, cached = trainer(None, None), trainer(cache, a.label_topk)
    spent = {"target": 0.0}
    features_of = plain.features

    def timed(recs, batch):
        t = time.perf_counter()
        f = features_of(recs, batch)
        spent["target"] += time.perf_counter() - t
        return f

    plain.features = timed
    sec = {"plain": 0.0, "cached": 0.0}
    tokens, losses = 0, {"plain": [], "cached": []}
    it = plain.batches((0, 0))
    for step in range(a.steps + 1):
        _, _, recs, batch = next(it)
        for name, tr in (("plain", plain), ("cached", cached)):
            t = time.perf_counter()
            info = tr.train_step(batch, recs)
            dt = time.perf_counter() - t
            losses[name].append(round(info["loss"], 4))
            if step > 0:  # the first step warms up allocators and kernels
                sec[name] += dt
        if step > 0:
            tokens += batch.tokens
        else:
            spent["target"] = 0.0
        print(f"step {step}: {list(batch.ids.shape)} plain {losses['plain'][-1]} cached {losses['cached'][-1]}", flush=True)
    res = {"threads": a.threads, "records": len(records), "cache_tokens": n_tok, "cache_bytes": cache.disk_bytes(),
           "cache_bytes_per_token": cache.disk_bytes() / n_tok, "build_seconds": round(build_s, 1),
           "build_tok_per_s": round(n_tok / build_s, 1), "steps": a.steps, "train_tokens": tokens,
           "plain_tok_per_s": round(tokens / sec["plain"], 1), "cached_tok_per_s": round(tokens / sec["cached"], 1),
           "speedup": round(sec["plain"] / sec["cached"], 3), "target_share_of_plain_step": round(spent["target"] / sec["plain"], 3),
           "losses": losses}
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
