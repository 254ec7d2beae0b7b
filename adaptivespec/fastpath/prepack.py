"""Linear layers with weights prepacked for oneDNN: the CPU's fast path for small-batch decoding.

``torch.nn.functional.linear`` on a CPU hands oneDNN the weight in PyTorch's layout, and oneDNN
re-lays it out for its AMX / AVX-512 kernels on every call. Decoding runs each weight once per
step with 1 to ~64 rows, so that reorder is a large share of the step: on the 2-vCPU Xeon (AMX)
SmolLM2-135M's one-token step in bfloat16 goes from ~38 to ~30 ms when every linear layer keeps a
weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``), the logits identical.
:func:`prepack_linears` swaps a module's ``nn.Linear`` children for :class:`PackedLinear` in place;
it is for inference only (the packed weight is not a parameter and gets no gradient). Where SGLang's
CPU kernels are installed (:func:`sgl_ops`) they run the packed matmuls instead of oneDNN.
"""

from __future__ import annotations

import os

import torch

from adaptivespec import hardware
from adaptivespec.fastpath.native import linear_ops

DISABLE_ENV = "ADAPTIVESPEC_NO_PREPACK"


NO_SGL_ENV = "ADAPTIVESPEC_NO_SGL_KERNEL"
_SGL_NEEDS = ("weight_packed_linear", "convert_weight_packed", "rmsnorm_cpu", "fused_add_rmsnorm_cpu", "silu_and_mul_cpu")


def sgl_ops():
    """``torch.ops.sgl_kernel`` when SGLang's CPU kernel package imports here (optional: SGLang is not a
    dependency; ``scripts/install_sglang_cpu.sh``) and ``$ADAPTIVESPEC_NO_SGL_KERNEL`` is not 1, else None."""
    if os.environ.get(NO_SGL_ENV, "0") == "1" or not hardware.has("bf16_kernels"):  # its kernels are AVX-512 / AMX
        return None
    try:
        import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
    except Exception:  # not installed, or built for another torch / CPU
        return None
    ops = torch.ops.sgl_kernel
    return ops if all(hasattr(ops, name) for name in _SGL_NEEDS) else None


class PackedWeight:
    """A weight ``[out, in]`` (and bias) laid out once for a CPU matmul kernel; call it on ``x [rows, in]``.

    With ``sgl`` (:func:`sgl_ops`), SGLang's AMX ``weight_packed_linear``: at one to a few rows its
    fixed cost per call is a third of oneDNN's (~10 vs ~30 us for 576 x 576 on the 2-vCPU Xeon).
    Shapes it refuses (its blocks need e.g. a multiple of 32 output features) fall back to oneDNN.
    With ``invariant`` (bf16), a weight whose matmul (SGLang's or oneDNN's) rounds a row by the rows
    beside it (:func:`rows_invariant`) runs the fixed-order kernel instead, where it builds."""

    __slots__ = ("packed", "bias", "sgl", "fixed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, sgl=None, invariant: bool = False) -> None:
        weight = weight.detach().contiguous()
        bias = None if bias is None else bias.detach()
        self.sgl = self.fixed = None
        self.out_features = weight.shape[0]
        self._pack(weight, bias, sgl)
        if invariant and weight.dtype == torch.bfloat16:
            ops = linear_ops()
            backend = "sgl_kernel" if self.sgl is not None else "onednn"
            if ops is not None and not rows_invariant(self, backend, weight.shape[1]):
                self.sgl, self.fixed, self.packed = None, ops, ops.pack_linear(weight)
                self.bias = None if bias is None else bias.float().contiguous()

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, sgl) -> None:
        if sgl is not None:
            try:
                packed = sgl.convert_weight_packed(weight)
                fbias = None if bias is None else bias.float().contiguous()
                sgl.weight_packed_linear(weight.new_zeros(1, weight.shape[1]), packed, fbias, True)
                self.sgl, self.packed, self.bias = sgl, packed, fbias
                return
            except RuntimeError:
                pass
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed is not None:
            return self.fixed.linear_bf16(x, self.packed, self.out_features, self.bias)
        if self.sgl is not None:
            return self.sgl.weight_packed_linear(x.contiguous(), self.packed, self.bias, True)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


_VERDICTS: dict[tuple[str, int, int, int], bool] = {}


@torch.no_grad()
def rows_invariant(matmul, backend: str, in_features: int) -> bool:
    """Whether ``matmul`` (a weight's bf16 kernel: ``backend`` "onednn" or "sgl_kernel") gives a row the
    same bits in a call of any number of rows (2-40, 48-256 by 16, 512 and 1,024: a prompt's chunk) as
    alone, at the current thread count: a probe on random rows, once per backend, shape and thread
    count in a process (~1 s for SmolLM2's five shapes, most of it the LM head; the kernels choose
    their blocking by shape, rows and threads, never by the weight's values). On a 2-vCPU AMD EPYC
    oneDNN's holds for SmolLM2's 576-wide inputs and fails for its down projection (1536 wide: from
    the 12th row of a call on, rows differ), which then runs the fixed-order kernel
    (:func:`adaptivespec.fastpath.native.linear_ops`)."""
    key = (backend, matmul.out_features, in_features, torch.get_num_threads())
    if key not in _VERDICTS:
        gen = torch.Generator().manual_seed(7919 * matmul.out_features + in_features)
        x = torch.randn(1024, in_features, generator=gen).bfloat16()
        alone = torch.cat([matmul(x[i:i + 1]) for i in range(256)])
        _VERDICTS[key] = all(torch.equal(matmul(x[:m])[:256], alone[:m])
                             for m in [*range(2, 41), *range(48, 257, 16), 512, 1024])
    return _VERDICTS[key]


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` for inference with the weight in a CPU kernel's own layout (:class:`PackedWeight`).

    ``weight`` (and ``bias``) stay readable as before; the forward uses the packed copy."""

    def __init__(self, linear: torch.nn.Linear, sgl=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel = PackedWeight(linear.weight, linear.bias, sgl)

    @property
    def packed(self) -> torch.Tensor:
        return self.kernel.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)


def can_prepack(module: torch.nn.Module) -> bool:
    """True for a bfloat16 module on the CPU where oneDNN is available and can reorder bf16 weights
    (:func:`adaptivespec.hardware.has` ``onednn_bf16``: AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2
    CPU oneDNN's reorder raises), unless ``$ADAPTIVESPEC_NO_PREPACK=1``.

    float32 is left alone here: oneDNN's packed float32 matmul was slower (43 vs 33 ms a step); the fused
    float32 forward packs its weights for MKL's sgemm instead (:class:`~adaptivespec.fastpath.forward.Float32Weight`)."""
    p = next(module.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and os.environ.get(DISABLE_ENV, "0") != "1"
            and hardware.has("onednn_bf16"))


@torch.no_grad()
def prepack_linears(module: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``module`` with a :class:`PackedLinear`; returns how many.

    A no-op (0) where :func:`can_prepack` is false, and for layers already packed."""
    if not can_prepack(module):
        return 0
    sgl = sgl_ops()
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child, sgl))
                n += 1
    return n
