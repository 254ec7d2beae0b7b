"""An int8 target (W8A8) for CPUs: int8 weights per output channel, int8 activations per row, int32 sums.

``runtime.quantization: int8`` replaces the target's linear layers (every projection and the LM head;
those named in ``runtime.quantization_keep`` stay in the model's dtype) with :class:`Int8Linear`:

- **weights** rounded once to int8 with one scale per output channel (``w ~ qw * sw``, ``|qw| <= 127``);
- **activations** rounded to int8 at each matmul's input with one scale per row (``x ~ qx * sx``),
  computed from the row alone (its largest magnitude / 127);
- the product ``qx . qw`` summed in int32, exactly, then ``y = float(acc) * sw * sx`` in float32 and
  rounded to the model's dtype.

The int32 sums are exact on every CPU, so the int8 target computes the same numbers everywhere; the
kernel is chosen per CPU (:func:`kernel_name`, asking :mod:`adaptivespec.hardware`):

- ``vnni`` (AVX512-VNNI): our kernel up to :data:`VNNI_MAX_ROWS` rows, oneDNN's prepacked ``qlinear``
  beyond (``vpdpbusd`` sums u8 x s8 products straight into int32);
- ``avx2`` (no VNNI): our AVX2 kernel for every row count (``int8_linear_avx2``: both operands widened
  to int16, ``vpmaddwd`` sums pairs into int32). Not oneDNN's, nor torch's ``_int_mm``: on AVX2 they
  multiply u8 x s8 by ``vpmaddubsw``, which saturates each pair of products at int16 (measured: 80% of
  the outputs of a 1536-deep matmul of large values wrong; the held-out perplexity +5.1% instead of +1.2%);
- ``float`` (neither, or no C++ compiler): the integers multiplied in float32 in slices of at most
  :data:`FLOAT_EXACT_K` of K (each slice's sum below 2^24: exact), the slices added in int32. Slow.

Integer sums do not depend on the order they are added in, and every other step above reads one
row only: a row's output is the same whatever else is in the matmul (one row, a verify tree, a
batch of requests, a prompt chunk). That is what makes the int8 target *batch-invariant*: a strict
verifier reproduces the int8 target's greedy decoding of a prompt alone, in any batch.

The float reference (:func:`reference_linear`) sums the same integers in float64 (exact for any
K this runs), so tests check the kernel bit for bit, not within a tolerance.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

VNNI_MAX_ROWS = 16
"""Up to this many rows (two for a layer of more than 4,096 outputs, the LM head) our VNNI kernel runs
the matmul (its fixed cost per call is a third of oneDNN's); beyond, oneDNN's ``qlinear`` (faster
per row there). Integer sums are exact, so both give the same bits (tested)."""

FLOAT_EXACT_K = 1040
"""The ``float`` kernel's slice of K: 1040 x 127 x 127 = 16,774,160 < 2^24, so every partial sum of a
slice is an integer float32 holds exactly (a whole 1536-deep row could reach 24,774,144: not exact)."""

_QLINEAR = getattr(getattr(torch.ops, "onednn", None), "qlinear_pointwise", None)


def kernel_name(native=None) -> str:
    """The int32 matmul this machine runs (``native``: :func:`adaptivespec.fastpath.native.ops`'s module,
    or None): ``vnni`` (ours and oneDNN's), ``avx2`` (ours) or ``float`` (torch's float32 matmul, in
    exact slices). Every choice exact; the module docstring says why oneDNN's int8 is not used without VNNI."""
    from adaptivespec import hardware

    if hardware.has("vnni") and (_onednn() or (native is not None and native.has_vnni())):
        return "vnni"
    if hardware.has("avx2") and native is not None and getattr(native, "has_avx2", lambda: False)():
        return "avx2"
    return "float"


def _onednn() -> bool:
    return _QLINEAR is not None and torch.backends.mkldnn.is_available()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (int8 [N, K], float32 scales [N]): symmetric, one scale per output channel."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(x: torch.Tensor, smooth: torch.Tensor | None = None, native=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x`` [M, K] (times ``smooth`` [K], in float32) -> (uint8 [M, K] holding ``qx + 128``,
    float32 ``max |x|`` per row [M, 1]).

    One scale per row from that row alone (``max |x| / 127``; the 1/127 is folded into the weight
    scales, :class:`Int8Weight`); ``qx = floor(x * (127 / max|x|) + 0.5)``, so ``|qx| <= 127``; a row
    of zeros (a padded row) quantizes to zeros. Every step is elementwise and correctly rounded, or an
    exact maximum: a row's result does not depend on the other rows. ``native``: the same in one C++
    call (:mod:`adaptivespec.fastpath.native`), bit for bit."""
    if native is not None:
        return native.quantize_rows(x, smooth)
    y = x.float() if smooth is None else x.float() * smooth
    amax = y.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)  # [M, 1]
    inv = torch.full_like(amax, 127.0).div_(amax)
    q = torch.mul(y, inv).add_(128.5).to(torch.uint8)  # floor(v + 128.5) = round-half-up(v) + 128 (y may be x itself)
    return q, amax


def scale_rows(y: torch.Tensor, amax: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, native=None):
    """The matmul's epilogue: ``y`` [M, N] (``float(acc) * sw / 127``) times each row's ``max|x|``, plus
    ``bias``, rounded to ``dtype``; ``native``: one C++ call, bit for bit."""
    if native is not None:
        return native.scale_rows(y, amax, bias, dtype)
    y = y.mul_(amax)
    return (y if bias is None else y.add_(bias)).to(dtype)


class Int8Weight:
    """A W8A8 matmul: call it on ``x`` [M, K] (any float dtype) -> [M, N] in ``x``'s dtype:
    ``y = float32(int32 sum of qx * qw) * (sw / 127) * max|x|`` (+ bias), rounded to ``x``'s dtype.

    ``qweight`` int8 [N, K], ``scale`` float32 [N] (``w ~ qweight * scale``), ``bias`` [N] or None. The
    sums run on :func:`kernel_name`'s kernel; every kernel gives the same bits (tested)."""

    __slots__ = ("qweight", "scale", "bias", "in_features", "out_features", "smooth", "native", "groups", "kernel",
                 "ours", "packed", "zero", "floats")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None, groups: int = 1) -> None:
        """``groups``: activation scales per row and per this many equal slices of K (each slice its own
        int8 matmul, the slices' float results added in order): finer scales where one per row costs quality."""
        self.smooth = None if smooth is None else smooth.float().contiguous()  # [K]: 1 / SmoothQuant's factors
        from adaptivespec.fastpath.native import ops

        self.native = ops()  # the C++ quantize, matmul and epilogue where they build (the same bits, fewer calls)
        self.qweight = qweight.contiguous()
        self.scale = scale.float().div(127.0).contiguous()  # sw / 127: the activations' 1/127 folded in
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = self.qweight.shape
        self.groups = groups
        if self.in_features % groups:
            raise ValueError(f"int8 groups: {groups} does not divide the layer's {self.in_features} inputs")
        self.kernel = kernel_name(self.native)
        self.ours = self._pack_ours()  # (weight in our kernel's layout, 128 x each slice's column sums) or None
        self.packed = self.floats = None
        if self.kernel == "vnni" and _onednn() and self.qweight.device.type == "cpu":
            self.packed = [torch.ops.onednn.qlinear_prepack(w, None) for w in self._slices()]
            self.zero = torch.zeros(self.out_features, dtype=torch.int32)
        elif self.ours is None:
            _say_float_once()
            self.floats = [_float_slices(w) for w in self._slices()]

    def _slices(self) -> list[torch.Tensor]:
        """The weight's ``groups`` slices of K, each contiguous [N, K / groups]."""
        k = self.in_features // self.groups
        return [self.qweight[:, g * k:(g + 1) * k].contiguous() for g in range(self.groups)]

    def _pack_ours(self):
        """Our kernel's weight and column sums where the kernel is ours and the shape tiles, else None."""
        k = self.in_features // self.groups
        if self.native is None or self.out_features % 16 or k % 4 or self.kernel == "float":
            return None
        if self.kernel == "vnni" and not self.native.has_vnni():
            return None
        sums = self.qweight.view(self.out_features, self.groups, k).sum(-1, dtype=torch.int32).t().contiguous()
        pack = self.native.pack_weight if self.kernel == "vnni" else self.native.pack_weight_avx2
        return pack(self.qweight), sums.mul_(128)

    def products(self, q: torch.Tensor, g: int = 0) -> torch.Tensor:
        """``(q - 128) . qweight`` per row (of slice ``g`` of K), times the weight scales: float32 [M, N]."""
        if self.packed is None:
            return float_products(q, self.floats[g], self.scale)
        # x_scale 1, zero point 128: the kernel sums (q - 128) * qw in int32 and scales by sw in float32
        return _QLINEAR.default(q, 1.0, 128, self.packed[g], self.scale, self.zero, None, 1.0, 0, torch.float32,
                                "none", [], "")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [M, K] -> (uint8 [M, K], ``max|x|`` [M, groups]): a scale per row and per slice of K."""
        M, G = x.shape[0], self.groups
        if G == 1:
            return quantize_rows(x, self.smooth, self.native)
        xs = x.float() if self.smooth is None else x.float() * self.smooth
        q, amax = quantize_rows(xs.view(M * G, -1), None, self.native)
        return q.view(M, -1), amax.view(M, G)

    def _ours_for(self, rows: int) -> bool:
        """Whether our kernel runs ``rows`` rows: always without oneDNN (AVX2); with it, few rows only."""
        if self.ours is None:
            return False
        return self.packed is None or rows <= 2 or (rows <= VNNI_MAX_ROWS and self.out_features <= 4096)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, G = x.shape[0], self.groups
        q, amax = self.quantize(x)
        if self._ours_for(rows):  # our kernel, the scaling fused
            run = self.native.int8_linear if self.kernel == "vnni" else self.native.int8_linear_avx2
            return run(q, amax, self.ours[0], self.ours[1], self.scale, self.bias, x.dtype)
        if G == 1:
            return scale_rows(self.products(q), amax, self.bias, x.dtype, self.native)  # float(acc) * sw/127 * max|x|
        q = q.view(rows, G, -1)
        y = self.products(q[:, 0].contiguous(), 0).mul_(amax[:, 0:1])
        for g in range(1, G):  # the slices' results added in order: the same sums whatever the rows
            y.add_(self.products(q[:, g].contiguous(), g).mul_(amax[:, g:g + 1]))
        return (y if self.bias is None else y.add_(self.bias)).to(x.dtype)


def _float_slices(qweight: torch.Tensor) -> list[torch.Tensor]:
    """``qweight`` [N, K] as float32 [k, N] slices of K, each at most :data:`FLOAT_EXACT_K` deep."""
    w = qweight.float().t()
    return [w[k:k + FLOAT_EXACT_K].contiguous() for k in range(0, w.shape[0], FLOAT_EXACT_K)]


def float_products(q: torch.Tensor, slices: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """``(q - 128) . qweight`` times ``scale`` by float32 matmuls (the ``float`` kernel): each slice's sums
    are integers below 2^24 (exact in float32, in any order; assumes torch's default float32 matmul
    precision, "highest"), converted to int32 and added there."""
    x = q.float().sub_(128.0)
    acc, k = None, 0
    for w in slices:
        part = torch.mm(x[:, k:k + w.shape[0]], w).to(torch.int32)
        acc, k = (part if acc is None else acc.add_(part)), k + w.shape[0]
    return acc.to(torch.float32).mul_(scale)


_SAID: set[str] = set()


def _say_float_once() -> None:
    from adaptivespec import hardware

    if "float" not in _SAID:
        _SAID.add("float")
        logging.getLogger("adaptivespec.int8").warning(
            "adaptivespec: int8 matmuls in exact float32 slices (%s, our int8 kernels not built): slow", hardware.describe())


def reference_products(q: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:meth:`Int8Weight.products` by float64 sums (exact: |sum| < 2^53), rounded as the kernel rounds
    (int32 -> float32, then times the (already divided) scale)."""
    acc = (q.double() - 128.0) @ qweight.double().t()
    return acc.to(torch.int64).to(torch.float32).mul_(scale)


def reference_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias=None, smooth=None) -> torch.Tensor:
    """What :class:`Int8Weight` computes, in plain torch ops: the tests' float reference."""
    q, amax = quantize_rows(x, None if smooth is None else smooth.float())
    return scale_rows(reference_products(q, qweight, scale.float() / 127.0), amax,
                      None if bias is None else bias.float(), x.dtype)


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` with int8 weights and per-row int8 activations (:class:`Int8Weight`)."""

    def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor | None = None, groups: int = 1) -> None:
        """``smooth`` [K]: SmoothQuant's factors ``s`` (:func:`smoothing`): the layer computes
        ``(x / s) @ (w * s)^T``, the same product with the activations' outlier channels moved into the weights."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        self.inv_smooth = None
        if smooth is not None:
            w = w * smooth[None, :]
            self.inv_smooth = (1.0 / smooth).float()
        qweight, scale = quantize_weight(w)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.groups = groups
        self.kernel = Int8Weight(qweight, scale, self.bias, self.inv_smooth, groups)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (``qweight * scale / s``) in float32: what the layer multiplies by."""
        w = self.qweight.float() * self.scale[:, None]
        return w if self.inv_smooth is None else w * self.inv_smooth[None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)


SMOOTH_ALPHA = 0.5
"""SmoothQuant's migration strength (its paper's default for most models)."""

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections the fused forward runs as one matmul: a ``keep`` naming one keeps its group."""


def quantize_linears(model: torch.nn.Module, keep: Iterable[str] = (), act_max: dict | None = None,
                     alpha: float = SMOOTH_ALPHA, groups: dict[str, int] | None = None) -> list[str]:
    """Replace every ``nn.Linear`` of ``model`` with an :class:`Int8Linear` in place, except those
    whose qualified name ends with one of ``keep`` (e.g. ``down_proj``, ``lm_head``); returns the
    names replaced (naming one of q/k/v or gate/up keeps its group: :data:`FUSED`). ``act_max``:
    each layer's largest input magnitude per channel (:func:`activation_maxima`), for SmoothQuant's
    factors (:func:`smoothing`, shared by a fused group). A tied LM head is untied (the embedding
    stays in the model's dtype)."""
    keep = set(keep)
    for group in FUSED:  # the fused forward runs q|k|v and gate|up as one matmul: kept together
        if any(k.endswith(g) for k in keep for g in group):
            keep |= {k[: len(k) - len(g)] + other for k in keep for g in group if k.endswith(g) for other in group}
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear
               and not any(name == k or name.endswith("." + k) for k in keep)}
    done = []
    with torch.no_grad():
        for name, child in linears.items():
            smooth = None
            if act_max is not None and name in act_max:
                prefix, _, last = name.rpartition(".")
                group = next((g for g in FUSED if last in g), (last,))
                mates = [linears.get(f"{prefix}.{other}" if prefix else other) for other in group]
                wmax = torch.stack([m.weight.detach().float().abs().amax(0) for m in mates if m is not None]).amax(0)
                smooth = smoothing(act_max[name].float(), wmax, alpha)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            g = next((n for k, n in (groups or {}).items() if name == k or name.endswith("." + k)), 1)
            setattr(parent, attr, Int8Linear(child, smooth, g))
            done.append(name)
    if "lm_head" in done and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    model._adaptivespec_quantization = "int8"  # read by the fused forward, the cost tables, the engine
    return done


def smoothing(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``s = max|x|^alpha / max|w|^(1 - alpha)`` (Xiao et al., 2023):
    ``x / s`` has smaller outlier channels, ``w * s`` takes them, the product is unchanged."""
    s = act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp(1e-2, 1e2)


@torch.inference_mode()
def activation_maxima(model: torch.nn.Module, sequences: Iterable[list[int]]) -> dict[str, torch.Tensor]:
    """Each ``nn.Linear``'s largest input magnitude per channel over ``sequences`` (token ids, one
    forward each through the model's own modules): SmoothQuant's calibration."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            def hook(_, inputs, name=name):
                a = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0).float()
                maxima[name] = a if name not in maxima else torch.maximum(maxima[name], a)
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        for ids in sequences:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return maxima


def quantization_of(model) -> str:
    """``int8`` for a target :func:`quantize_linears` converted, else ``none``."""
    return getattr(model, "_adaptivespec_quantization", "none")
