"""SGLang's CPU kernels checked against plain torch: do they compute the right thing on this CPU?

Every ``torch.ops.sgl_kernel`` op that SGLang 0.5.23's CPU backend runs when it serves the embedded
pair (target SmolLM2-135M: hidden 576, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, bf16;
the shipped EAGLE-3 head: the same attention and MLP, a 1152-wide QKV input, a 576 x 1728 ``fc``, an
8192-token draft vocabulary), and every op adaptivespec's own torch fast path calls
(``fastpath/prepack.py``, ``forward.py``, ``drafter.py``), is run on random inputs with a fixed seed
at those shapes and compared with a float32 torch reference computed from the same bf16 inputs.

The yardstick is bf16 rounding: the same computation written in bf16 torch (what the torch runtime or
transformers computes: ``F.linear`` in bf16, ``LlamaRMSNorm`` in bf16, ``scaled_dot_product_attention``
in bf16) is compared with the same reference. A kernel passes when, for every output, its largest
absolute error is at most ``factor`` (2 for every check here) times torch's plus half a bf16 ulp of the
reference's largest magnitude, its RMS error (relative to the reference's RMS, which sees errors spread
over all elements that the largest one, set by the output's own rounding, hides) at most ``factor``
times torch's plus 2^-12, and both its and torch's RMS errors are under
:data:`SANE_RMS` (a few ulps: torch far from the reference means the reference is wrong, and a limit
scaled from it would pass anything). Kernels that only move data (the KV-cache write) must be exact.

What the served path computes in plain torch, not in these kernels, is listed in :data:`PLAIN_TORCH`.

Which code runs: ``sgl_kernel``'s own library has AVX-512 (bf16 ``vdpbf16ps``) code and no AMX
instruction. Its matmuls of more than 4 rows (``weight_packed_linear``) and the extend attention's
score and value products go through ``at::native::cpublas::brgemm``, oneDNN's brgemm ukernel, which
uses AMX where the CPU has it; matmuls of 1-4 rows, the decode attention, the norms, RoPE and SiLU run
sgl_kernel's own AVX-512 code (no oneDNN call: checked with ``ONEDNN_VERBOSE=1``). ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (oneDNN's documented cap, read
when oneDNN first runs: set it before the process starts, or use ``--onednn-isa`` which re-runs this
module with it) makes that ukernel take its AVX-512-bf16 code, the one an AVX-512-bf16 CPU without AMX
(the project's AMD EPYC machines) runs.

    python -m adaptivespec.analysis.sglang_kernels [--json PATH] [--markdown] [--only SUBSTRING]... \
        [--onednn-isa AVX512_CORE_BF16]

Prints the CPU, then one line per check; exit status 1 when any check fails, 2 when SGLang's CPU
kernels cannot run here (one line says why). ``sgl_kernel`` is imported only inside :func:`sgl_ops`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

# -- the embedded pair's shapes ------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152
DRAFT_VOCAB = 8192  # the shipped head's draft_vocab_size
EPS = 1e-5  # rms_norm_eps of the target and of the head (9.9999997e-06)
ROPE_THETA = 100000.0
MAX_POS = 8192
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

BF16 = torch.bfloat16
HALF_ULP = 2.0 ** -9  # half of bf16's relative spacing (8 significant bits)
SANE_RMS = 2.0 ** -6
"""Whatever the factor, the kernel's and torch's bf16 RMS errors must be under this (a few bf16 ulps,
relative): torch's bf16 computation far from the reference means the reference is wrong, and a limit
scaled from it would pass anything."""

PLAIN_TORCH = (
    "EAGLE draft top-k: sglang.srt.utils.common.fast_topk is torch.max (topk 1) / torch.topk; no sgl_kernel op",
    "target logits: SmolLM2 ties its embeddings, so SGLang's lm_head is the embedding (not a ParallelLMHead, "
    "not packed): LogitsProcessor runs torch.matmul",
    "EAGLE-3 fc (576 x 1728): a torch.nn.Linear in llama_eagle3.py, F.linear (the torch fast path packs it: checked)",
    "embedding lookups, the draft's softmax, organize_draft_results' torch.topk/gather",
)
"""What the served forward computes in plain torch on a CPU (listed, not checked)."""

NOT_CHECKED = (
    "build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu, build_draft_decode_metadata_cpu, "
    "assign_*_cpu: integer index kernels (the tree layout is tested against them in tests/test_sglang_draft_stage.py)",
)


def sgl_ops():
    """``torch.ops.sgl_kernel`` with SGLang's CPU kernels registered, else a one-line reason (str)."""
    try:
        import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
    except Exception as exc:  # not installed, or built for another torch / CPU
        return f"SGLang's CPU kernels cannot run here: import sgl_kernel failed ({type(exc).__name__}: {exc})".splitlines()[0]
    ops = torch.ops.sgl_kernel
    missing = [n for n in ("decode_attention_cpu", "extend_attention_cpu", "weight_packed_linear", "rmsnorm_cpu")
               if not hasattr(ops, n)]
    if missing:
        return f"SGLang's CPU kernels cannot run here: sgl_kernel has no {', '.join(missing)} (not a CPU build)"
    return ops


def cpu_info() -> dict:
    """The CPU's model name, whether it has AMX (bf16 tiles) and AVX-512 bf16, and the oneDNN ISA cap."""
    flags, model = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "threads": torch.get_num_threads(), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}


def gemm_path(rows_min: int, cpu: dict | None = None) -> str:
    """Which code ``weight_packed_linear`` / the attention products run on this CPU (see the module's text)."""
    cpu = cpu or cpu_info()
    if rows_min <= 4:
        return "avx512-bf16 (sgl_kernel tinygemm)"
    isa = cpu["onednn_max_cpu_isa"].upper()
    amx = cpu["amx_bf16"] and (not isa or "AMX" in isa or isa in ("ALL", "DEFAULT"))
    return "amx (oneDNN brgemm)" if amx else "avx512-bf16 (oneDNN brgemm)"


# -- a check: inputs, the kernel, the float32 reference, the same thing in bf16 torch ----------


@dataclass(frozen=True)
class Check:
    """One kernel at one shape. ``inputs(gen)`` makes the inputs (bf16 tensors and indices);
    ``kernel(ops, inp)``, ``reference(inp)`` (float32) and ``torch_bf16(inp)`` each return a tuple of
    outputs, compared position by position. ``factor``: the kernel may be this many times worse than
    torch's bf16 (``None``: must be exact, data movement)."""

    name: str
    kernel_op: str
    shapes: str
    path: str
    inputs: Callable[[torch.Generator], dict]
    kernel: Callable[[object, dict], tuple]
    reference: Callable[[dict], tuple]
    torch_bf16: Callable[[dict], tuple]
    factor: float | None = 2.0
    why: str = ""
    inputs_use_ops: bool = False  # ``inputs(gen, ops)``: inputs made by another kernel (SGLang's tree builder)


@dataclass
class Result:
    """One check's outcome: its worst output (largest error relative to its limit). ``max_abs``, ``max_rel``
    (over the reference's largest magnitude) and ``rms_rel`` (RMS error over the reference's RMS) of the
    kernel, the same for torch's bf16 computation, and the limits: ``limit`` on ``max_abs``,
    ``rms_limit`` on ``rms_rel``."""

    name: str
    kernel_op: str
    shapes: str
    path: str
    max_abs: float
    max_rel: float
    rms_rel: float
    torch_bf16_abs: float
    torch_bf16_rel: float
    torch_bf16_rms_rel: float
    limit: float
    rms_limit: float
    passed: bool
    note: str = ""
    per_output: list = field(default_factory=list)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(largest absolute error, that over the reference's largest magnitude, RMS error over the
    reference's RMS): the first is set by the output's own bf16 rounding, the last sees errors spread
    over every element (e.g. probabilities rounded to bf16 inside an attention kernel)."""
    d = (out.float() - ref.float()).abs()
    bad = ~torch.isfinite(out.float())
    if bad.any() or not d.numel():
        return (float("inf"),) * 3 if bad.any() else (0.0, 0.0, 0.0)
    r = ref.float()
    scale = r.abs().max().item() or 1.0
    rms = r.pow(2).mean().sqrt().item() or 1.0
    m = d.max().item()
    return m, m / scale, d.pow(2).mean().sqrt().item() / rms


def run_check(check: Check, ops) -> Result:
    """Run one check; a kernel that raises, or returns the wrong shape, fails with that as its note."""
    gen = torch.Generator().manual_seed(_seed(check.name))
    inp = check.inputs(gen, ops) if check.inputs_use_ops else check.inputs(gen)
    inf, nan = float("inf"), float("nan")

    def failed(note):
        return Result(check.name, check.kernel_op, check.shapes, check.path, inf, inf, inf, nan, nan, nan, 0.0, 0.0,
                      False, note)

    try:
        with torch.inference_mode():
            got = check.kernel(ops, inp)
    except Exception as exc:  # a refused shape is a failure of the check, reported, not a crash
        return failed(f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    with torch.inference_mode():
        ref = check.reference(inp)
        tb = check.torch_bf16(inp)
    if not len(got) == len(ref) == len(tb):
        return failed(f"{len(got)} outputs, the reference has {len(ref)}")
    worst, per = None, []
    for i, (g, r, t) in enumerate(zip(got, ref, tb)):
        if g.shape != r.shape:
            return failed(f"output {i}: shape {tuple(g.shape)} != {tuple(r.shape)}")
        ka, kr, krms = _err(g, r)
        ta, tr, trms = _err(t, r)
        if check.factor is None:  # data movement: exact
            limit = rms_limit = 0.0
        else:  # factor x torch's bf16 error, plus half a bf16 ulp (of the largest |ref|; for the RMS, an eighth of one)
            limit = check.factor * ta + HALF_ULP * (r.float().abs().max().item() or 1.0)
            rms_limit = check.factor * trms + HALF_ULP / 8
        ok = ka <= limit and krms <= rms_limit and (check.factor is None or (krms <= SANE_RMS and trms <= SANE_RMS))
        per.append({"output": i, "max_abs": ka, "max_rel": kr, "rms_rel": krms, "torch_bf16_abs": ta,
                    "torch_bf16_rel": tr, "torch_bf16_rms_rel": trms, "limit": limit, "rms_limit": rms_limit,
                    "passed": ok})
        key = max(ka / limit if limit else (0.0 if ka == 0 else inf),
                  krms / rms_limit if rms_limit else (0.0 if krms == 0 else inf))
        if worst is None or key > worst[0]:
            worst = (key, ka, kr, krms, ta, tr, trms, limit, rms_limit)
    _, ka, kr, krms, ta, tr, trms, limit, rms_limit = worst
    note = check.why
    insane = [p["output"] for p in per if check.factor is not None and p["torch_bf16_rms_rel"] > SANE_RMS]
    if insane:
        note = f"torch's bf16 is {max(p['torch_bf16_rms_rel'] for p in per):.2g} RMS from the reference (> {SANE_RMS:g}): the reference is wrong"
    return Result(check.name, check.kernel_op, check.shapes, check.path, ka, kr, krms, ta, tr, trms, limit, rms_limit,
                  all(p["passed"] for p in per), note, per)


# -- references --------------------------------------------------------------------------------


def _randn(gen, *shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rms_ref(x, w, eps=EPS):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def rms_bf16(x, w, eps=EPS):
    """transformers' ``LlamaRMSNorm`` on bf16: normalise in float32, round to bf16, scale in bf16."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def cos_sin_cache(dtype=torch.float32):
    """SGLang's ``RotaryEmbedding`` cache ``[MAX_POS, HEAD_DIM]``: cos then sin, ``HEAD_DIM / 2`` each
    (computed in float32 as SGLang does, then cast to the query's dtype by its CPU forward)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    freqs = torch.einsum("i,j->ij", torch.arange(MAX_POS, dtype=torch.float), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _cos_sin_exact(pos):
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    f = pos.double()[:, None] * inv[None]
    return f.cos(), f.sin()


def rope_neox(x, cos, sin, heads):
    """Rotate-half (neox) rotary embedding of ``x [n, heads * D]`` with cos / sin ``[n, D / 2]``, in x's dtype."""
    n = x.shape[0]
    x = x.view(n, heads, HEAD_DIM)
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(n, heads * HEAD_DIM)


def attention(q, keys, values, visible, scale, bf16_sdpa=False):
    """``q [m, H, D]`` over ``keys/values [n, Hkv, D]`` with ``visible [m, n]`` (bool), GQA.

    float32 inputs: the reference (plain matmuls and softmax). bf16 inputs with ``bf16_sdpa``: torch's
    ``scaled_dot_product_attention`` in bf16, what adaptivespec's torch runtime runs (``fastpath/forward.py``
    ``attend``; it accumulates in float32, so it is a tighter yardstick than transformers' eager bf16
    attention, whose bf16-rounded scores are ~10x worse on sharp softmaxes)."""
    if bf16_sdpa:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=visible[None, None],
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    g = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1).transpose(0, 1)  # [H, n, D]
    v = values.repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, m, n]
    s = s.masked_fill(~visible[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v).transpose(0, 1)  # [m, H, D]


# -- the checks --------------------------------------------------------------------------------


def _linear_check(label, out_f, in_f, rows, bias=False, why=""):
    rows = tuple(rows)

    def inputs(gen):
        w = _randn(gen, out_f, in_f, scale=in_f ** -0.5)
        return {"w": w, "b": (torch.randn(out_f, generator=gen) * 0.5 if bias else None),
                "xs": [_randn(gen, r, in_f) for r in rows]}

    def kernel(ops, inp):
        packed = ops.convert_weight_packed(inp["w"])
        b = None if inp["b"] is None else inp["b"].float().contiguous()  # SGLang and fastpath pass the bias in float32
        return tuple(ops.weight_packed_linear(x, packed, b, True) for x in inp["xs"])

    def reference(inp):  # rows are independent: one matmul over all of them, split back
        b = 0.0 if inp["b"] is None else inp["b"].float()
        return torch.cat(inp["xs"]).float().matmul(inp["w"].float().T).add_(b).split(rows)

    def torch_bf16(inp):
        b = None if inp["b"] is None else inp["b"].to(BF16)
        return F.linear(torch.cat(inp["xs"]), inp["w"], b).split(rows)

    name = f"weight_packed_linear {label}{' +bias' if bias else ''} rows {','.join(map(str, rows))}"
    return Check(name, "convert_weight_packed + weight_packed_linear",
                 f"[{'/'.join(map(str, rows))}, {in_f}] x [{out_f}, {in_f}]^T{' + bias' if bias else ''}",
                 gemm_path(min(rows)), inputs, kernel, reference, torch_bf16, why=why)


LINEARS = (
    # (label, out features, in features): the packed linears of the served pair and of the fast path
    ("target qkv", Q_SIZE + 2 * KV_SIZE, HIDDEN),
    ("target o_proj", HIDDEN, Q_SIZE),
    ("target gate_up", 2 * INTER, HIDDEN),
    ("target down", HIDDEN, INTER),
    ("head qkv", Q_SIZE + 2 * KV_SIZE, 2 * HIDDEN),
    ("head lm_head", DRAFT_VOCAB, HIDDEN),
    ("head fc (fastpath)", HIDDEN, 3 * HIDDEN),
    ("target lm_head (fastpath)", VOCAB, HIDDEN),  # the fast path runs batch 1: <= 64 rows (LARGE_ROWS[:-1])
)
SMALL_ROWS, LARGE_ROWS = (1, 2, 3, 4), (5, 8, 16, 33, 64, 256)  # the kernel's own AVX-512 code at <= 4 rows, brgemm above


def _norm_checks():
    out = []
    for rows in ((1, 3), (16, 64)):
        def inputs(gen, rows=rows):
            return {"w": (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(BF16),
                    "xs": [_randn(gen, r, HIDDEN, scale=3.0) for r in rows],
                    "rs": [_randn(gen, r, HIDDEN, scale=3.0) for r in rows]}

        out.append(Check(
            f"rmsnorm_cpu rows {','.join(map(str, rows))}", "rmsnorm_cpu", f"[{'/'.join(map(str, rows))}, {HIDDEN}], eps {EPS:g}",
            "avx512-bf16 (sgl_kernel)", inputs,
            lambda ops, inp: tuple(ops.rmsnorm_cpu(x, inp["w"], EPS) for x in inp["xs"]),
            lambda inp: tuple(rms_ref(x, inp["w"]) for x in inp["xs"]),
            lambda inp: tuple(rms_bf16(x, inp["w"]) for x in inp["xs"])))

        def fused_kernel(ops, inp):
            outs = []
            for x, r in zip(inp["xs"], inp["rs"]):
                x, r = x.clone(), r.clone()
                ops.fused_add_rmsnorm_cpu(x, r, inp["w"], EPS)  # r += x; x = rmsnorm(r)
                outs += [x, r]
            return tuple(outs)

        def fused_ref(inp):
            outs = []
            for x, r in zip(inp["xs"], inp["rs"]):
                s = x.float() + r.float()
                outs += [rms_ref(s, inp["w"]), s]
            return tuple(outs)

        def fused_bf16(inp):
            outs = []
            for x, r in zip(inp["xs"], inp["rs"]):
                s = x + r
                outs += [rms_bf16(s, inp["w"]), s]
            return tuple(outs)

        out.append(Check(
            f"fused_add_rmsnorm_cpu rows {','.join(map(str, rows))}", "fused_add_rmsnorm_cpu",
            f"[{'/'.join(map(str, rows))}, {HIDDEN}] x2 (normed, residual)", "avx512-bf16 (sgl_kernel)",
            inputs, fused_kernel, fused_ref, fused_bf16))
    return out


def _act_rope_checks():
    def act_inputs(gen):
        return {"xs": [_randn(gen, r, 2 * INTER, scale=2.0) for r in (1, 7, 64)]}

    def silu_ref(x):
        x = x.float()
        return F.silu(x[:, :INTER]) * x[:, INTER:]

    checks = [Check(
        "silu_and_mul_cpu rows 1,7,64", "silu_and_mul_cpu", f"[1/7/64, {2 * INTER}] -> [.., {INTER}]",
        "avx512-bf16 (sgl_kernel)", act_inputs,
        lambda ops, inp: tuple(ops.silu_and_mul_cpu(x) for x in inp["xs"]),
        lambda inp: tuple(silu_ref(x) for x in inp["xs"]),
        lambda inp: tuple(F.silu(x[:, :INTER]) * x[:, INTER:] for x in inp["xs"]))]

    def rope_inputs(gen):
        cases = []
        for n in (1, 13, 64):
            pos = torch.randint(0, MAX_POS, (n,), generator=gen)
            pos[0] = 0
            cases.append((pos, _randn(gen, n, Q_SIZE), _randn(gen, n, KV_SIZE)))
        return {"cases": cases, "cache": cos_sin_cache(BF16)}  # SGLang casts its cache to the query's dtype

    def rope_kernel(ops, inp):
        outs = []
        for pos, q, k in inp["cases"]:
            qo, ko = ops.rotary_embedding_cpu(pos, q.clone(), k.clone(), HEAD_DIM, inp["cache"], True)
            outs += [qo.reshape(q.shape), ko.reshape(k.shape)]
        return tuple(outs)

    def rope_ref(inp):
        outs = []
        for pos, q, k in inp["cases"]:
            c, s = _cos_sin_exact(pos)
            outs += [rope_neox(q.float(), c.float(), s.float(), HEADS), rope_neox(k.float(), c.float(), s.float(), KV_HEADS)]
        return tuple(outs)

    def rope_bf16(inp):
        outs = []
        half = HEAD_DIM // 2
        for pos, q, k in inp["cases"]:
            cs = inp["cache"][pos]
            outs += [rope_neox(q, cs[:, :half], cs[:, half:], HEADS), rope_neox(k, cs[:, :half], cs[:, half:], KV_HEADS)]
        return tuple(outs)

    checks.append(Check(
        "rotary_embedding_cpu neox", "rotary_embedding_cpu",
        f"q [1/13/64, {Q_SIZE}], k [.., {KV_SIZE}], head 64, theta {ROPE_THETA:g}, positions < {MAX_POS}",
        "avx512-bf16 (sgl_kernel)", rope_inputs, rope_kernel, rope_ref, rope_bf16,
        why="reference uses exact cos/sin; the kernel and torch bf16 both read SGLang's bf16 cos_sin_cache"))
    return checks


# attention ------------------------------------------------------------------------------------

POOL = 8192
CTX = 4096  # req_to_token's row length (the pool's max context)


def _kv_pool(gen, bs, total_lens):
    """A shuffled KV pool and a req_to_token table: request ``r`` owns ``total_lens[r]`` scattered slots."""
    kb = _randn(gen, POOL, KV_HEADS, HEAD_DIM)
    vb = _randn(gen, POOL, KV_HEADS, HEAD_DIM)
    table = torch.zeros(bs + 2, CTX, dtype=torch.int32)
    perm = torch.randperm(POOL - 1, generator=gen) + 1  # slot 0 stays unused (SGLang's padding slot)
    rows = torch.tensor([2, 0, 3, 1, 4, 5, 6, 7, 8, 9][:bs], dtype=torch.int64) % (bs + 2)
    used = 0
    for r, n in enumerate(total_lens):
        table[rows[r], :n] = perm[used: used + n].int()
        used += n
    assert used <= POOL - 1
    return kb, vb, table, rows


def _gather(buf, table, row, n):
    return buf[table[row, :n].long()]


def _decode_check(name, lens, sharp=1.0, why=""):
    lens = tuple(lens)  # committed tokens before the new one

    def inputs(gen):
        bs = len(lens)
        kb, vb, table, rows = _kv_pool(gen, bs, [n + 1 for n in lens])
        q = _randn(gen, bs, HEADS, HEAD_DIM, scale=sharp)
        k, v = _randn(gen, bs, KV_HEADS, HEAD_DIM), _randn(gen, bs, KV_HEADS, HEAD_DIM)
        loc = torch.stack([table[rows[r], lens[r]] for r in range(bs)]).long()
        return {"kb": kb, "vb": vb, "table": table, "rows": rows, "q": q, "k": k, "v": v, "loc": loc,
                "seq": torch.tensor(lens, dtype=torch.int64) + 1}

    def kernel(ops, inp):
        kb, vb = inp["kb"].clone(), inp["vb"].clone()
        bs = inp["q"].shape[0]
        o = torch.empty_like(inp["q"])
        # the backend's num_kv_splits = 8; NaN-filled: the backend reuses an uninitialised buffer for
        # layers of another shape, on the word that the kernel writes every element it reads
        logits = torch.full((bs, HEADS, 8, HEAD_DIM + 1), float("nan"))
        # the AMX backend's call after its shim: the kernel writes the new row's K/V at loc itself
        ops.decode_attention_cpu(inp["q"], kb, vb, o, inp["k"], inp["v"], inp["loc"], logits, inp["table"], inp["rows"],
                                 inp["seq"], HEAD_DIM ** -0.5, 0.0, False, 0, None, None)
        return o, kb[inp["loc"]], vb[inp["loc"]]

    def _both(inp, dtype, bf16_sdpa):
        kb, vb = inp["kb"].clone(), inp["vb"].clone()
        kb[inp["loc"]], vb[inp["loc"]] = inp["k"], inp["v"]
        outs = []
        for r in range(inp["q"].shape[0]):
            n = int(inp["seq"][r])
            keys = _gather(kb, inp["table"], inp["rows"][r], n).to(dtype)
            vals = _gather(vb, inp["table"], inp["rows"][r], n).to(dtype)
            outs.append(attention(inp["q"][r: r + 1].to(dtype), keys, vals, torch.ones(1, n, dtype=torch.bool),
                                  HEAD_DIM ** -0.5, bf16_sdpa))
        return torch.cat(outs), inp["k"].to(dtype), inp["v"].to(dtype)

    return Check(name, "decode_attention_cpu", f"bs {len(lens)}, kv lens {'/'.join(str(n + 1) for n in lens)}, "
                 f"q {HEADS}x{HEAD_DIM}{f' x{sharp:g}' if sharp != 1 else ''}, kv {KV_HEADS}x{HEAD_DIM}; outputs: o, written K, written V",
                 "avx512-bf16 (sgl_kernel)", inputs, kernel, lambda i: _both(i, torch.float32, False),
                 lambda i: _both(i, BF16, True), why=why)


def _tree_parents(gen, n):
    """A random draft tree of ``n`` nodes in verify order (node 0 the root, each parent before its child)."""
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def _tree_visible(parents):
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def _extend_check(name, prefix, extend, tree=False, sharp=1.0, why=""):
    prefix, extend = tuple(prefix), tuple(extend)

    def inputs(gen):
        bs = len(prefix)
        kb, vb, table, rows = _kv_pool(gen, bs, [p + e for p, e in zip(prefix, extend)])
        total = sum(extend)
        q = _randn(gen, total, HEADS, HEAD_DIM, scale=sharp)
        k, v = _randn(gen, total, KV_HEADS, HEAD_DIM), _randn(gen, total, KV_HEADS, HEAD_DIM)
        starts = torch.tensor([sum(extend[:r]) for r in range(bs)], dtype=torch.int32)
        # the backend writes the extend tokens' K/V into the pool before the kernel (set_kv_buffer)
        for r in range(bs):
            slots = table[rows[r], prefix[r]: prefix[r] + extend[r]].long()
            kb[slots] = k[starts[r]: starts[r] + extend[r]]
            vb[slots] = v[starts[r]: starts[r] + extend[r]]
        vis = []
        for r in range(bs):
            e = extend[r]
            vis.append(_tree_visible(_tree_parents(gen, e)) if tree else torch.ones(e, e, dtype=torch.bool).tril())
        mask = torch.cat([m.flatten() for m in vis]) if tree else None  # QLEN_ONLY: [bs * n * n], True = visible
        return {"kb": kb, "vb": vb, "table": table, "rows": rows, "q": q, "k": k, "v": v, "starts": starts,
                "vis": vis, "mask": mask}

    def kernel(ops, inp):
        o = torch.empty_like(inp["q"])
        seq = torch.tensor([p + e for p, e in zip(prefix, extend)], dtype=torch.int64)
        ops.extend_attention_cpu(inp["q"], inp["k"], inp["v"], o, inp["kb"], inp["vb"], inp["table"], inp["rows"], seq,
                                 torch.tensor(extend, dtype=torch.int32), inp["starts"], max(extend), HEAD_DIM ** -0.5,
                                 0.0, False, 0, None, None, inp["mask"])
        return (o,)

    def _both(inp, dtype, bf16_sdpa):
        outs = []
        for r in range(len(prefix)):
            p, e, s = prefix[r], extend[r], int(inp["starts"][r])
            keys = _gather(inp["kb"], inp["table"], inp["rows"][r], p + e).to(dtype)
            vals = _gather(inp["vb"], inp["table"], inp["rows"][r], p + e).to(dtype)
            visible = torch.cat([torch.ones(e, p, dtype=torch.bool), inp["vis"][r]], dim=1)
            outs.append(attention(inp["q"][s: s + e].to(dtype), keys, vals, visible, HEAD_DIM ** -0.5, bf16_sdpa))
        return (torch.cat(outs),)

    what = "tree mask (QLEN_ONLY, bool [bs*n*n])" if tree else "causal"
    return Check(name, "extend_attention_cpu",
                 f"bs {len(prefix)}, prefix {'/'.join(map(str, prefix))}, extend {'/'.join(map(str, extend))}, {what}"
                 f"{f', q x{sharp:g}' if sharp != 1 else ''}",
                 gemm_path(5), inputs, kernel, lambda i: _both(i, torch.float32, False),
                 lambda i: _both(i, BF16, True), why=why)


def _eagle_draft(gen, bs, topk, steps, ndt):
    """``(parent_list, top_scores_index)`` of an EAGLE draft with random probabilities, as SGLang's
    ``select_top_k_tokens`` (per level: the topk best of topk x topk children) and
    ``organize_draft_results`` (the ndt - 1 best path scores, sorted) make them."""
    scores, parents = [], []
    cum = torch.rand(bs, topk, generator=gen).sort(-1, descending=True).values
    scores.append(cum)
    parents.append(torch.arange(-1, topk).expand(bs, -1).contiguous())
    for level in range(1, steps):
        child = torch.rand(bs, topk, topk, generator=gen)
        flat = (cum[:, :, None] * child / child.sum(-1, keepdim=True)).flatten(1)
        scores.append(flat)
        top = torch.topk(flat, topk).indices
        parents.append(top + topk ** 2 * (level - 1) + topk)
        cum = flat.gather(1, top)
    index = torch.sort(torch.topk(torch.cat(scores, 1), ndt - 1).indices).values
    parent_list = torch.cat(parents[:-1], 1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list, index


def _parents_from_links(next_token, next_sibling):
    """Each node's parent as SGLang's greedy verify walks the tree (first child, next sibling); -1 for
    the root and for a node the walk never reaches."""
    n = len(next_token)
    par, stack = [-1] * n, [0]
    while stack:
        u = stack.pop()
        c = int(next_token[u])
        while c != -1:
            par[c] = u
            stack.append(c)
            c = int(next_sibling[c])
    return par


def _sglang_tree_check(name, prefix, topk, steps, ndt):
    """The verify attention over the tree exactly as SGLang's CPU path builds it: its
    ``build_tree_kernel_efficient_cpu`` (QLEN_ONLY mask, positions, next-token / next-sibling links) from
    an EAGLE draft, then ``extend_attention_cpu`` with that mask. The reference takes each node's
    ancestors from the links SGLang's verify walks (not from the mask), so a mask that disagrees with the
    tree the verify accepts along fails, as do positions other than prefix + depth."""
    prefix = tuple(prefix)
    bs = len(prefix)
    base = _extend_check(name, prefix, (ndt,) * bs)  # its pool, queries, kernel call and references

    def inputs(gen, ops):
        parent_list, index = _eagle_draft(gen, bs, topk, steps, ndt)
        seq = torch.tensor(prefix, dtype=torch.int64)
        mask = torch.ones(ndt * bs * ndt, dtype=torch.bool)
        positions = torch.empty(bs * ndt, dtype=torch.long)
        ri, rn, rs = torch.full((3, bs, ndt), -1, dtype=torch.long)
        ops.build_tree_kernel_efficient_cpu(parent_list, index, seq, mask, positions, ri, rn, rs, topk, steps, ndt, 1)
        parents = [_parents_from_links(rn[r], rs[r]) for r in range(bs)]
        inp = base.inputs(gen)
        inp.update(mask=mask, positions=positions, vis=[_tree_visible(p) for p in parents], parents=parents)
        return inp

    def kernel(ops, inp):
        return base.kernel(ops, inp) + (inp["positions"],)

    def depth_positions(inp):
        out = []
        for r, par in enumerate(inp["parents"]):
            for i in range(ndt):
                d, j = 0, i
                while par[j] >= 0:
                    d, j = d + 1, par[j]
                out.append(prefix[r] + d)
        return torch.tensor(out, dtype=torch.long)

    return Check(name, "build_tree_kernel_efficient_cpu + extend_attention_cpu",
                 f"bs {bs}, prefix {'/'.join(map(str, prefix))}, EAGLE topk {topk}, steps {steps}, ndt {ndt}; "
                 "outputs: o, positions", gemm_path(5), inputs, kernel,
                 lambda inp: base.reference(inp) + (depth_positions(inp),),
                 lambda inp: base.torch_bf16(inp) + (depth_positions(inp),), inputs_use_ops=True,
                 why="SGLang's own verify tree: mask and positions from its CPU tree builder")


def _store_cache_check():
    def inputs(gen):
        n = 37
        return {"k": _randn(gen, n, KV_HEADS, HEAD_DIM), "v": _randn(gen, n, KV_HEADS, HEAD_DIM),
                "kc": _randn(gen, POOL, KV_HEADS, HEAD_DIM), "vc": _randn(gen, POOL, KV_HEADS, HEAD_DIM),
                "idx": (torch.randperm(POOL - 1, generator=gen)[:n] + 1).long()}

    def kernel(ops, inp):
        kc, vc = inp["kc"].clone(), inp["vc"].clone()
        row = KV_HEADS * HEAD_DIM
        ops.store_cache_cpu(inp["k"], inp["v"], kc, vc, inp["idx"], row)  # as memory_pool._set_kv_buffer_impl calls it
        return kc, vc

    def ref(inp, dtype=torch.float32):
        kc, vc = inp["kc"].clone(), inp["vc"].clone()
        kc[inp["idx"]], vc[inp["idx"]] = inp["k"], inp["v"]
        return kc.to(dtype), vc.to(dtype)

    return Check("store_cache_cpu", "store_cache_cpu", f"37 rows of [{KV_HEADS}, {HEAD_DIM}] into a {POOL}-slot pool",
                 "avx512 (sgl_kernel, copy)", inputs, kernel, ref, lambda i: ref(i, BF16), factor=None,
                 why="KV write of an extend (set_kv_buffer): must be exact")


def checks() -> list[Check]:
    """Every check, in the order they print."""
    out = _norm_checks() + _act_rope_checks()
    for label, o, i in LINEARS:
        out.append(_linear_check(label, o, i, SMALL_ROWS))
        out.append(_linear_check(label, o, i, LARGE_ROWS[:-1] if "fastpath" in label else LARGE_ROWS))
    for rows in (SMALL_ROWS, LARGE_ROWS):
        out.append(_linear_check("qkv", Q_SIZE + 2 * KV_SIZE, HIDDEN, rows, bias=True,
                                 why="models with attention bias (not the embedded pair); SGLang and the fast path pass it in float32"))
    out += [
        _decode_check("decode_attention_cpu decode / one-row verify", (0, 16, 129, 700, 63, 5, 3000 - 1, 31),
                      why="plain decode, the draft's per-step decode (bs x topk rows), one_row_verify.py's undrafted verify"),
        _decode_check("decode_attention_cpu sharp scores", (1, 40, 511, 2047), sharp=6.0,
                      why="query x6: score std ~6, a few keys take the softmax (the online softmax's rescaling)"),
        _extend_check("extend_attention_cpu prefill", (0, 0), (37, 300)),
        _extend_check("extend_attention_cpu extend after prefix", (5, 130, 600), (1, 7, 70),
                      why="chunked prefill, EAGLE draft-extend (accepted tokens after the prefix), topk=1 chain verify"),
        _extend_check("extend_attention_cpu target verify tree n=8", (3, 90, 300, 17), (8, 8, 8, 8), tree=True),
        _extend_check("extend_attention_cpu target verify tree n=16", (40, 500), (16, 16), tree=True),
        _extend_check("extend_attention_cpu target verify tree n=64", (200,), (64,), tree=True),
        _extend_check("extend_attention_cpu target verify tree sharp", (2000, 33), (12, 12), tree=True, sharp=6.0),
        _sglang_tree_check("extend_attention_cpu verify, SGLang's tree (6,4,12)", (7, 300, 61), 4, 6, 12),
        _sglang_tree_check("extend_attention_cpu verify, SGLang's tree (10,10,13)", (150, 9), 10, 10, 13),
        _store_cache_check(),
    ]
    return out


# -- running and printing ----------------------------------------------------------------------


def run(only: list[str] | tuple[str, ...] = (), ops=None) -> tuple[dict, list[Result]]:
    """Run the checks whose name contains any of ``only`` (all without it); returns (CPU, results)."""
    ops = sgl_ops() if ops is None else ops
    if isinstance(ops, str):
        raise RuntimeError(ops)
    results = [run_check(c, ops) for c in checks() if not only or any(o in c.name for o in only)]
    return cpu_info(), results


def format_cpu(cpu: dict) -> str:
    isa = f", ONEDNN_MAX_CPU_ISA={cpu['onednn_max_cpu_isa']}" if cpu["onednn_max_cpu_isa"] else ""
    return (f"CPU: {cpu['model']}; amx_bf16 {'yes' if cpu['amx_bf16'] else 'no'}, "
            f"avx512_bf16 {'yes' if cpu['avx512_bf16'] else 'no'}; torch threads {cpu['threads']}{isa}")


def format_result(r: Result) -> str:
    return (f"{'PASS' if r.passed else 'FAIL'}  {r.name:<56} {r.shapes}  [{r.path}]  "
            f"max abs {r.max_abs:.3g} (rel {r.max_rel:.2g}, rms {r.rms_rel:.2g}); "
            f"torch bf16 {r.torch_bf16_abs:.3g} (rel {r.torch_bf16_rel:.2g}, rms {r.torch_bf16_rms_rel:.2g}); "
            f"limits {r.limit:.3g}, rms {r.rms_limit:.2g}{'  ' + r.note if r.note and not r.passed else ''}")


def markdown_table(cpu: dict, results: list[Result]) -> str:
    """The results as the Markdown table the serving docs carry."""
    lines = [f"{format_cpu(cpu)}", "",
             "| kernel | shapes | code path | max abs err (rel; rms rel) | torch bf16 (rel; rms rel) | verdict |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.shapes} | {r.path} | {r.max_abs:.3g} ({r.max_rel:.2g}; {r.rms_rel:.2g}) | "
                     f"{r.torch_bf16_abs:.3g} ({r.torch_bf16_rel:.2g}; {r.torch_bf16_rms_rel:.2g}) | "
                     f"{'pass' if r.passed else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaptivespec.analysis.sglang_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the CPU and every check's result here")
    ap.add_argument("--only", action="append", default=[], help="run the checks whose name contains this (repeatable: any)")
    ap.add_argument("--markdown", action="store_true", help="print the results as a Markdown table too")
    ap.add_argument("--onednn-isa", default="", help="re-run with ONEDNN_MAX_CPU_ISA set (e.g. AVX512_CORE_BF16: "
                                                     "oneDNN's brgemm takes its AVX-512-bf16 code, not AMX)")
    args = ap.parse_args(argv)
    if args.onednn_isa and os.environ.get("ONEDNN_MAX_CPU_ISA") != args.onednn_isa:
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA=args.onednn_isa)
        return subprocess.call([sys.executable, "-m", "adaptivespec.analysis.sglang_kernels", *rest], env=env)
    ops = sgl_ops()
    if isinstance(ops, str):
        print(ops)
        return 2
    cpu, results = run(args.only, ops)
    print(format_cpu(cpu))
    for r in results:
        print(format_result(r))
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)}/{len(results)} kernels within bf16 rounding"
          + (f"; FAILED: {', '.join(r.name for r in failed)}" if failed else ""))
    if args.markdown:
        print(markdown_table(cpu, results))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "results": [asdict(r) for r in results],
                                         "plain_torch": list(PLAIN_TORCH), "not_checked": list(NOT_CHECKED)}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
