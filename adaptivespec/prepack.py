"""Linear layers with weights prepacked for oneDNN: the CPU's fast path for small-batch decoding.

``torch.nn.functional.linear`` on a CPU hands oneDNN the weight in PyTorch's layout, and oneDNN
re-lays it out for its AMX / AVX-512 kernels on every call. Decoding runs each weight once per
step with 1 to ~64 rows, so that reorder is a large share of the step: on the 2-vCPU Xeon (AMX)
SmolLM2-135M's one-token step in bfloat16 goes from ~38 to ~30 ms when every linear layer keeps a
weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``), the logits identical.
:func:`prepack_linears` swaps a module's ``nn.Linear`` children for :class:`PackedLinear` in place;
it is for inference only (the packed weight is not a parameter and gets no gradient).
"""

from __future__ import annotations

import os

import torch

DISABLE_ENV = "ADAPTIVESPEC_NO_PREPACK"


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` for inference with the weight in oneDNN's own layout.

    ``weight`` (and ``bias``) stay readable as before; the forward uses the packed copy."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def can_prepack(module: torch.nn.Module) -> bool:
    """True for a bfloat16 module on the CPU where oneDNN is available, unless ``$ADAPTIVESPEC_NO_PREPACK=1``.

    float32 is left alone: packed, its one-token step was slower (43 vs 33 ms) on the same machine."""
    p = next(module.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and os.environ.get(DISABLE_ENV, "0") != "1")


@torch.no_grad()
def prepack_linears(module: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``module`` with a :class:`PackedLinear`; returns how many.

    A no-op (0) where :func:`can_prepack` is false, and for layers already packed."""
    if not can_prepack(module):
        return 0
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                n += 1
    return n
