"""One verify step of a tree over a cached context: the fused forward against transformers' (docs/models.md).

Builds a target of a published shape with random weights (transformers' config class, random init,
nothing downloaded), prefills ``--context`` tokens once, then times one verify forward of ``rows``
tree rows (a random tree's mask, its positions, hidden states returned as the runtime asks for
them) with each contender, in turn within every round (so machine drift hits all alike), the rows'
cache entries cropped after each call so every call sees the same context:

* ``fused``: :class:`~adaptivespec.fastpath.forward.FastLlama` (SGLang's CPU kernels where
  ``sgl_kernel`` imports, else oneDNN with prepacked weights: the backend the runtime picks);
* ``transformers+prepack``: transformers' forward with prepacked linear layers and grouped tree
  attention: what the torch runtime runs where the fused forward does not apply;
* ``transformers``: transformers' forward as loaded.

Prints the median milliseconds per step of every contender and the ratios to the fused one.

    python scripts/fastforward_bench.py --shape qwen3-0.6b --context 384 --rows 8 16 --rounds 15
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

SHAPES = {
    # Qwen/Qwen3-0.6B's config.json: 28 layers, hidden 1024, 16 query heads on 8 KV heads of 128, tied embeddings
    "qwen3-0.6b": ("Qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # HuggingFaceTB/SmolLM2-135M-Instruct: 30 layers, hidden 576, 9 query heads on 3 KV heads of 64
    "smollm2-135m": ("Llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
}


def build(shape: str):
    import transformers

    arch, kw = SHAPES[shape]
    cfg = getattr(transformers, f"{arch}Config")(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def tree_mask(past: int, n: int, dtype):
    """A random tree of ``n`` nodes below the context: its additive mask [1, 1, n, past + n] and positions [1, n]."""
    gen = torch.Generator().manual_seed(n)
    parent = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i in range(n):
        j, d = i, -1
        while j >= 0:
            allowed[i, j], j, d = True, parent[j], d + 1
        depth.append(d)
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask, (past + torch.tensor(depth)).unsqueeze(0)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--context", type=int, default=384, help="cached tokens before the tree (default 384)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16], help="tree rows per verify step (default 8 16)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds; every contender runs once per round (default 15)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from adaptivespec.fastpath.attention import use_tree_sdpa
    from adaptivespec.fastpath.forward import fast_forward
    from adaptivespec.fastpath.kvcache import buffered_cache
    from adaptivespec.fastpath.prepack import prepack_linears
    from adaptivespec.models import cache_forward

    model = build(args.shape)
    packed = copy.deepcopy(model)
    prepack_linears(packed)
    use_tree_sdpa(packed)
    use_tree_sdpa(model)
    fused = fast_forward(model)
    if fused is None:
        raise SystemExit("the fused forward does not apply here (bfloat16 on a CPU with oneDNN needed)")
    contenders = {"fused": (fused, model), "transformers+prepack": (cache_forward(packed), packed),
                  "transformers": (cache_forward(model), model)}
    print(f"{args.shape} (random weights), bfloat16, {torch.get_num_threads()} threads, CPU {cpu_name()!r}, "
          f"torch {torch.__version__}, fused backend {fused.backend}; context {args.context}, {args.rounds} rounds")
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    caches = {}
    with torch.inference_mode():
        for name, (fwd, m) in contenders.items():
            caches[name] = buffered_cache(m.config, args.context + max(args.rows) + 1)
            fwd(input_ids=ids, cache=caches[name], use_cache=True, logits_to_keep=1)
    for n in args.rows:
        mask, pos = tree_mask(args.context, n, torch.bfloat16)
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        times = {name: [] for name in contenders}

        def step(name):
            fwd, _ = contenders[name]
            cache = caches[name]
            t = time.perf_counter()
            fwd(input_ids=tokens, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True,
                output_hidden_states=True)
            dt = time.perf_counter() - t
            cache.crop(-n)
            return dt

        with torch.inference_mode():
            for name in contenders:  # warm-up: every kernel meets this row count once
                step(name), step(name)
            for r in range(args.rounds):
                order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                for name in order:
                    times[name].append(step(name))
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        line = ", ".join(f"{name} {ms:.1f} ms ({ms / med['fused']:.2f}x fused)" for name, ms in med.items())
        print(f"{n} rows: {line}")


if __name__ == "__main__":
    main()
