"""Tree attention over a long cache, per layer: what each available kernel costs (docs/speed.md).

A verify forward's rows attend over the whole committed context; at long prompts that attention is
what a row costs. This times one layer's attention of ``rows`` tree rows over ``keys`` cached keys
(SmolLM2-135M's 9 query heads on 3 KV heads, head size 64, bfloat16, a tree mask over the new
rows) with each way this project can compute it:

* ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)`` with the mask (what the fused
  forward ran before the fold);
* ``sdpa-folded``: the three query heads of a KV head folded into one block of rows
  (``adaptivespec.fastpath.forward._fold_mask``; the fused forward's choice where it pays);
* ``sgl-extend``: SGLang's CPU ``extend_attention_cpu`` with its tree mask (only where
  ``sgl_kernel`` imports), which reads the prefix and the new rows separately;
* ``bmm``: scores by batched matmul with the heads folded, softmax in float32;
* ``kernel``: this project's bfloat16 attention (``csrc/bf16_attention.cpp``, where the CPU has
  AVX512-BF16): the fused forward's choice wherever it builds.

and, for reference, one row without a mask (a plain decoding step). Medians of ``--repeat`` calls.

    python scripts/attention_bench.py [--keys 1024 4096] [--rows 1 8 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD = 9, 3, 64


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def variants(keys: int, rows: int):
    """name -> zero-argument callable computing [1, HEADS, rows, HEAD] (or None where it does not apply)."""
    from adaptivespec.fastpath.forward import _fold_mask, fold_rows

    g = HEADS // KV_HEADS
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, rows, HEAD, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, KV_HEADS, keys, HEAD, dtype=torch.bfloat16)
    parent = [-1] + [int(torch.randint(0, i, ())) for i in range(1, rows)]
    tree = torch.zeros(rows, rows, dtype=torch.bool)
    for i in range(rows):
        j = i
        while j >= 0:
            tree[i, j], j = True, parent[j]
    allowed = torch.cat([torch.ones(rows, keys - rows, dtype=torch.bool), tree], 1)
    mask = torch.zeros(1, 1, rows, keys, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))
    out: dict = {}
    if rows == 1:
        from adaptivespec.fastpath.forward import attend
        from adaptivespec.fastpath.native import attention_ops

        out["sdpa (one row, no mask)"] = lambda: attend(q, k, v, None, None)
        kernel = attention_ops()
        if kernel is not None:
            out["kernel (one row)"] = lambda: kernel.attend_bf16(q[0].transpose(0, 1), k[0], v[0], keys, None, False,
                                                                 HEAD ** -0.5)
        return out
    out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    folded = fold_rows(mask, rows, g, keys)  # what _fold_mask builds, at any size
    out["sdpa-folded" + ("" if _fold_mask(mask, rows, g, keys) is not None else " (not chosen)")] = (
        lambda: F.scaled_dot_product_attention(q.reshape(1, KV_HEADS, g * rows, HEAD), k, v, attn_mask=folded))

    def bmm():
        s = torch.matmul(q.reshape(KV_HEADS, g * rows, HEAD), k[0].transpose(1, 2)).float() * HEAD ** -0.5
        p = torch.softmax(s.view(KV_HEADS, g, rows, keys) + mask[0].float(), -1).to(torch.bfloat16)
        return torch.matmul(p.view(KV_HEADS, g * rows, keys), v[0])
    out["bmm"] = bmm
    from adaptivespec.fastpath.native import attention_ops

    kernel = attention_ops()
    if kernel is not None:  # the tree's part of the mask; q as the fused forward holds it, [rows, heads, D]
        vis, qn = allowed[:, keys - rows:], q[0].transpose(0, 1)
        out["kernel"] = lambda: kernel.attend_bf16(qn, k[0], v[0], keys - rows, vis, False, HEAD ** -0.5)
    try:
        import sgl_kernel  # noqa: F401

        ext = torch.ops.sgl_kernel.extend_attention_cpu
    except (ImportError, AttributeError, RuntimeError):
        return out
    qx = q[0].transpose(0, 1).contiguous()
    kb, vb = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [keys, KV_HEADS, HEAD] views of the cache
    o = torch.empty(rows, HEADS, HEAD, dtype=torch.bfloat16)
    r2t = torch.arange(keys, dtype=torch.int32)[None]
    meta = (torch.tensor([0]), torch.tensor([keys]), torch.tensor([rows], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    flat = tree.reshape(-1).contiguous()
    out["sgl-extend"] = lambda: ext(qx, kb[keys - rows:], vb[keys - rows:], o, kb, vb, r2t, *meta, rows, HEAD ** -0.5, 0.0,
                                    False, 0, None, None, flat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one layer's attention, ms (median of {args.repeat}), {args.threads} threads, bf16, "
          f"{HEADS} query heads on {KV_HEADS} KV heads of {HEAD}")
    print(f"| keys | rows | {'variant':<28} | ms |")
    print("|---:|---:|---|---:|")
    for keys in args.keys:
        for rows in args.rows:
            for name, fn in variants(keys, rows).items():
                print(f"| {keys} | {rows} | {name:<28} | {timed(fn, args.repeat):.3f} |", flush=True)


if __name__ == "__main__":
    main()
