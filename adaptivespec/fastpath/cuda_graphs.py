"""CUDA graphs for the torch runtime, applied from outside (as gpt-fast applies them).

:func:`enable_cuda_graphs` takes a :class:`~adaptivespec.runtime.TorchRuntime` whose shape bank is
prepared and, for every shape of the bank, captures the target's tree-verify forward and the
drafter's level steps over static buffers. The decode loop, the runtime's algorithm and the
policies never mention graphs; the per-step choice of the policy replays the graphs of the shape
it chose. What changes on the runtime it is applied to::

    target cache    a transformers ``StaticCache`` of ``max_context`` positions. Each layer keeps its
                    length on the device, so a replayed forward appends at the right place;
                    "crop" subtracts from that length, and ``runtime.compact_cache`` (unchanged)
                    copies the accepted rows into place inside the fixed buffers
    verify_forward  copies the tree into its shape's static inputs (tokens and positions [1, ndt],
                    additive mask [1, 1, ndt, max_context]) and replays that shape's graph; a tree
                    smaller than ndt is padded and the padding cropped right after
    drafter         a thin proxy over the real head: a drafting level of width b (called with a
                    mask) replays the graph of width b over a [1, kv_heads, max_context, head_dim]
                    drafter cache; prefill and commit (no mask, any width) run Eagle3Drafter.step
                    eagerly on the same buffers
    prefill         runs eagerly through a DynamicCache (any prompt length), then copies the
                    prompt's keys and values into the static cache

Attention runs over all ``max_context`` positions, the mask hiding those past the tree: fixed
shapes for launch-free replay (gpt-fast's trade), so size ``max_context`` to the workload.

``capture=False`` builds the same static buffers and runs the same functions without capturing:
that is how the static path is checked on CPU, and a baseline that isolates what replay saves.
Graph outputs are static buffers, valid until the same graph is replayed again (the verifier and
the commit read them before that, as the decode loop is written).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import attrs
import torch

import adaptivespec
from adaptivespec.drafter import Eagle3Drafter
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.fastpath.bank import max_beam, max_expanded
from adaptivespec.models import cache_forward
from adaptivespec.runtime import TorchRuntime
from adaptivespec.types import DraftTree, TreeShape

ALIGN = 64  # max_context is rounded up to this (aligned mask rows for the fused attention kernels)


class CudaGraphsUnsupportedError(AdaptiveSpecError):
    """The runtime cannot run the static (graph) path; the message says why."""


class StaticContextError(AdaptiveSpecError):
    """A generation needs more positions than the static caches were built with."""


def cuda_graphs_unsupported_reason(runtime: Any, capture: bool = True) -> str | None:
    """Why :func:`enable_cuda_graphs` cannot be applied to ``runtime``, as a sentence; None if it can."""
    from transformers.cache_utils import StaticLayer

    d = getattr(runtime, "drafter", None)
    if d is None:
        return "CUDA graphs capture the draft tree and its verification; autoregressive decoding (no drafter) has none"
    if isinstance(d, StaticDrafter):
        return "CUDA graphs are already enabled on this runtime"
    if getattr(runtime, "bank", None) is None:
        return "the shape bank is not prepared: call runtime.prepare(policy.shapes()) first"
    if not isinstance(d, Eagle3Drafter):
        return f"drafter {type(d).__name__}: only EAGLE-3 heads have a static draft step"
    if type(d).step is not Eagle3Drafter.step:
        return f"{type(d).__name__} overrides Eagle3Drafter.step; the static draft step reproduces Eagle3Drafter.step only"
    cfg = runtime.target.config
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in ("sdpa", "eager", "adaptivespec_sdpa"):  # (the last: sdpa with grouped KV heads, adaptivespec.fastpath.attention)
        return f"target attention {attn!r} does not take an additive float tree mask; load it with attn_implementation='sdpa'"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"target RoPE {rope!r} updates its frequencies from the positions on the host every forward"
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(cfg, "sliding_window", None):
        return f"target layer types {sorted(kinds)}: the static path handles full-attention layers only"
    if not isinstance(getattr(StaticLayer(max_cache_len=1), "cumulative_length", None), torch.Tensor):
        import transformers

        return (f"transformers {transformers.__version__}: StaticLayer keeps no device-side length "
                "(cumulative_length tensor), which graph replay needs; use transformers 5.24")
    if capture and runtime.device.type != "cuda":
        return (f"CUDA graphs need a CUDA device; the runtime is on {runtime.device} "
                "(capture=False runs the same static path eagerly)")
    return None


# -- static functions ---------------------------------------------------------------------------


@attrs.define(eq=False)
class StaticRun:
    """A function of static buffers: replayed from its captured graph, or called (eager mode)."""

    fn: Callable[[], Any]
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    out: Any = None  # what ``fn`` returned during capture: the graph's static outputs

    def __call__(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


def draft_step_static(d, tokens, state, positions, rows, keys, values, mask) -> torch.Tensor:
    """``Eagle3Drafter.step`` over fixed-size cache buffers (same maths, shapes that never change).

    tokens [b]; state [b, H]; positions [b]; rows [b]: cache rows written (device tensor, so a
    replay writes where the current step needs); keys / values [1, kv_heads, max_context, d];
    mask [1, 1, b, max_context] additive, hiding every row past the drafter's length. -> [b, H].
    """
    x = d.midlayer.pre(d.embed_tokens(tokens), state).unsqueeze(0)  # [1, b, 2H]
    cos, sin = d.rotary(x, positions.unsqueeze(0))
    q, k, v = d.midlayer.self_attn.qkv(x, cos, sin)
    keys.index_copy_(2, rows, k)
    values.index_copy_(2, rows, v)
    attn = d.midlayer.self_attn.attend(q, keys, values, mask)
    return d.midlayer.post(state.unsqueeze(0), attn).squeeze(0)


@attrs.define(eq=False)
class StaticVerify:
    """The target's tree forward for one shape: static inputs, and the run (graph or eager)."""

    ndt: int
    tokens: torch.Tensor  # [1, ndt] int64
    positions: torch.Tensor  # [1, ndt] int64
    mask: torch.Tensor  # [1, 1, ndt, max_context] additive: 0 attends, neg hides
    run: StaticRun | None = None  # -> (logits [1, ndt, V], hidden_states tuple of [1, ndt, H_t])

    def load(self, tree: DraftTree, P: int, neg: float) -> None:
        """Write ``tree`` (n <= ndt nodes) below committed context ``P``; no host sync."""
        n, ndt = tree.size, self.ndt
        m = self.mask[0, 0]  # [ndt, max_context]
        m[:, :P].zero_()  # the committed context
        m[:, P:].fill_(neg)  # the tree block below, stale rows and padding stay hidden
        m[:n, P : P + n].masked_fill_(tree.ancestors, 0.0)
        self.tokens[0, :n].copy_(tree.tokens)
        torch.add(tree.depth, P, out=self.positions[0, :n])
        if n < ndt:  # padding: the root's token at position P, each pad node sees only itself
            self.tokens[0, n:].copy_(tree.tokens[:1].expand(ndt - n))
            self.positions[0, n:].fill_(P)
            torch.diagonal(m[n:, P + n : P + ndt]).zero_()


@attrs.define(eq=False)
class StaticDraftStep:
    """One drafter level of width ``b`` (any shape): static inputs, and the run (graph or eager)."""

    b: int
    tokens: torch.Tensor  # [b] int64
    state: torch.Tensor  # [b, H]
    positions: torch.Tensor  # [b] int64
    start: torch.Tensor  # [] int64: first cache row written
    offsets: torch.Tensor  # [b] int64: 0..b-1
    mask: torch.Tensor  # [1, 1, b, max_context] additive
    run: StaticRun | None = None  # -> (out [b, H], logp [b, Vd])

    def load(self, tokens, state, positions, start: int, mask: torch.Tensor, neg: float) -> None:
        """Inputs of one level; ``mask`` is the runtime's [1, 1, b, start + b] level mask."""
        end = start + self.b
        self.tokens.copy_(tokens)
        self.state.copy_(state)
        self.positions.copy_(positions)
        self.start.fill_(start)
        self.mask[..., :end].copy_(mask)
        self.mask[..., end:].fill_(neg)


# -- the drafter as the runtime sees it ---------------------------------------------------------


class StaticDrafter:
    """Proxy over an :class:`~adaptivespec.drafter.Eagle3Drafter` whose cache is fixed-size.

    Attribute reads and writes go to the real head (``length`` included), except ``step``,
    ``log_probs`` and ``reset_cache``. A masked step of a captured width replays that width's
    graph, which also computes the draft log-probabilities: ``log_probs`` of the output it just
    returned hands them back instead of recomputing them.
    """

    _own = ("_d", "_keys", "_values", "_steps", "_neg", "_last")

    def __init__(self, drafter, keys: torch.Tensor, values: torch.Tensor, steps: dict[int, StaticDraftStep], neg: float) -> None:
        for name, value in zip(self._own, (drafter, keys, values, steps, neg, (None, None))):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in StaticDrafter._own:  # not set yet (copy, unpickling): no recursion through _d
            raise AttributeError(name)
        return getattr(self._d, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self._d, name, value)

    @property
    def capacity(self) -> int:
        return int(self._keys.shape[2])

    def reset_cache(self, capacity: int = 1024) -> None:
        """Start a sequence on the fixed buffers (``capacity`` is checked by the runtime's prefill)."""
        d = self._d
        d._k, d._v, d.length = self._keys, self._values, 0  # re-pointed in case another runtime grew them

    def step(self, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        d, b = self._d, tokens.shape[0]
        start = d.length
        if start + b > self.capacity:
            raise StaticContextError(
                f"the drafter needs {start + b} positions; its static cache holds {self.capacity} (max_context)"
            )
        st = self._steps.get(b)
        if mask is None or st is None:  # prefill / commit (causal chunk) or an uncaptured width
            return d.step(tokens, state, positions, mask)
        st.load(tokens, state, positions, start, mask, self._neg)
        out, logp = st.run()
        d.length = start + b
        self._last = (out, logp)
        return out

    def log_probs(self, out_state: torch.Tensor) -> torch.Tensor:
        out, logp = self._last
        if out_state is out:
            return logp
        return self._d.log_probs(out_state)


# -- capture ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ShapeCapture:
    """What capturing one shape cost."""

    shape: TreeShape
    verify_seconds: float
    """Building the static verify inputs, warm-up runs and capture of the tree forward."""
    verify_allocated: int
    """Bytes of ``torch.cuda.memory_allocated`` they added (static inputs and outputs)."""
    verify_reserved: int
    """Bytes of ``torch.cuda.memory_reserved`` they added (graph memory pool included)."""
    draft_widths: tuple[int, ...]
    """Drafter level widths this shape can run (each width's graph is shared by the shapes)."""
    draft_new_widths: tuple[int, ...]
    """Widths first captured for this shape (their cost is counted here)."""
    draft_seconds: float
    """Building, warming up and capturing the new widths' drafter steps."""
    draft_allocated: int
    """Bytes of ``torch.cuda.memory_allocated`` the new widths added."""
    draft_reserved: int
    """Bytes of ``torch.cuda.memory_reserved`` the new widths added."""

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["shape"] = [self.shape.nsteps, self.shape.topk, self.shape.ndt]
        return d


class _Meter:
    """Wall time and CUDA memory added by a block (memory 0 off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "_Meter":
        self._sync()
        self.t0, self.a0, self.r0 = time.perf_counter(), *self._mem()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        a, r = self._mem()
        self.seconds, self.allocated, self.reserved = time.perf_counter() - self.t0, a - self.a0, r - self.r0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _mem(self) -> tuple[int, int]:
        return (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if self.cuda else (0, 0)


def _capture(fn: Callable[[], Any], *, capture: bool, warmup: int, pool, restore: Callable[[], None]) -> StaticRun:
    """Warm ``fn`` up on a side stream (``restore`` undoes its side effects), then capture it."""
    if not capture:
        return StaticRun(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # lazy cuBLAS / attention-kernel set-up happens outside the capture
            fn()
            restore()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return StaticRun(fn, graph=graph, out=out)


@attrs.define(eq=False)
class CudaGraphs:
    """What :func:`enable_cuda_graphs` installed on one runtime, and what it cost."""

    runtime: Any
    max_context: int
    captured: bool
    cache: Any  # transformers StaticCache
    drafter: StaticDrafter
    room: int  # positions past the committed context one step may write (target and drafter)
    eager_prefill: Callable[..., int]  # the runtime's own prefill
    captures: list[ShapeCapture] = attrs.field(factory=list)
    seconds: float = 0.0

    # -- what the runtime calls ---------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_new_tokens: int = 0) -> int:
        need = len(prompt_ids) + max_new_tokens + self.room
        if need > self.max_context:
            raise StaticContextError(
                f"a prompt of {len(prompt_ids)} tokens with max_new_tokens={max_new_tokens} needs {need} positions "
                f"(tree room {self.room} included); the static caches hold max_context={self.max_context}: "
                "enable CUDA graphs with a larger max_context"
            )
        first = self.eager_prefill(prompt_ids, max_new_tokens)
        self.adopt(self.runtime.cache, self.runtime.P)
        return first

    @torch.inference_mode()
    def verify_forward(self, tree: DraftTree):
        """As ``TorchRuntime.verify_forward``: (logits [n, V], hidden_states), from the shape's graph."""
        rt = self.runtime
        sv = rt.bank.get(tree.shape).graphs.get("verify")
        if sv is None:
            raise CudaGraphsUnsupportedError(
                f"tree shape {tree.shape} has no static verify: the bank was rebuilt after enable_cuda_graphs"
            )
        n, P = tree.size, rt.P
        if P + sv.ndt > self.max_context:
            raise StaticContextError(f"verifying {sv.ndt} nodes after {P} positions exceeds max_context={self.max_context}")
        sv.load(tree, P, rt.neg)
        logits, hidden = sv.run()
        if n == sv.ndt:
            return logits[0], hidden
        self.cache.crop(-(sv.ndt - n))  # drop the padding: the cache now holds P + n rows
        return logits[0, :n], tuple(h[:, :n] for h in hidden)

    def adopt(self, cache, P: int) -> None:
        """Make the static cache hold ``cache``'s first ``P`` positions and give it to the runtime."""
        if cache is not self.cache:
            for s, d in zip(self.cache.layers, cache.layers, strict=True):
                s.keys[:, :, :P].copy_(d.keys[:, :, :P])
                s.values[:, :, :P].copy_(d.values[:, :, :P])
        for s in self.cache.layers:
            s.cumulative_length.fill_(P)
        self.runtime.cache = self.cache

    # -- report --------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Capture time and memory per shape, and the static caches' size."""
        layer = self.cache.layers[0]
        target_kv = 2 * len(self.cache.layers) * layer.keys.numel() * layer.keys.element_size()
        dk = self.drafter._keys
        return {
            "captured": self.captured,
            "max_context": self.max_context,
            "seconds": self.seconds,
            "target_cache_bytes": target_kv,
            "drafter_cache_bytes": 2 * dk.numel() * dk.element_size(),
            "shapes": [c.to_dict() for c in self.captures],
        }


def _static_cache(target, max_context: int, dtype, device):
    from transformers import StaticCache

    cfg = target.config
    cache = StaticCache(config=cfg, max_cache_len=max_context)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(1, cfg.num_key_value_heads, head_dim, dtype, device)
    for layer in cache.layers:
        if not hasattr(layer, "crop"):  # transformers < 5.24: static layers cannot be cropped
            layer.crop = _crop_static.__get__(layer)
    return cache


def _crop_static(layer, tokens_to_remove: int) -> None:
    """Drop the last ``-tokens_to_remove`` rows of a static layer: its length moves back, in place
    (the graphs hold that tensor); the rows are overwritten by the next update."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop: expected a negative number of rows to remove, got {tokens_to_remove}")
    layer.cumulative_length.sub_(-tokens_to_remove)


def _verify_static(rt, cache, shape: TreeShape, max_context: int, **cap) -> StaticVerify:
    z = dict(device=rt.device)
    sv = StaticVerify(
        ndt=shape.ndt,
        tokens=torch.zeros(1, shape.ndt, dtype=torch.long, **z),
        positions=torch.zeros(1, shape.ndt, dtype=torch.long, **z),
        mask=torch.zeros(1, 1, shape.ndt, max_context, dtype=rt.dtype, **z),
    )

    target = cache_forward(rt.target)

    def fn():
        out = target(input_ids=sv.tokens, position_ids=sv.positions, attention_mask=sv.mask,
                        cache=cache, use_cache=True, output_hidden_states=True)
        return out.logits, out.hidden_states

    lengths = [layer.cumulative_length.clone() for layer in cache.layers]

    def restore():  # a warm-up run appended ndt rows: take them back (in place: the graph holds these tensors)
        for layer, n in zip(cache.layers, lengths):
            layer.cumulative_length.copy_(n)

    sv.run = _capture(fn, restore=restore, **cap)
    return sv


def _draft_static(d, b: int, keys, values, **cap) -> StaticDraftStep:
    p = d.lm_head.weight
    z = dict(device=p.device)
    cap_rows = keys.shape[2]
    st = StaticDraftStep(
        b=b,
        tokens=torch.zeros(b, dtype=torch.long, **z),
        state=torch.zeros(b, d.config.hidden_size, dtype=p.dtype, **z),
        positions=torch.zeros(b, dtype=torch.long, **z),
        start=torch.tensor(cap_rows - b, dtype=torch.long, **z),  # warm-up writes the last rows, never live ones
        offsets=torch.arange(b, **z),
        mask=torch.zeros(1, 1, b, cap_rows, dtype=p.dtype, **z),
    )

    def fn():
        out = draft_step_static(d, st.tokens, st.state, st.positions, st.start + st.offsets, keys, values, st.mask)
        return out, d.log_probs(out)

    st.run = _capture(fn, restore=lambda: None, **cap)
    return st


def tree_room(shapes) -> int:
    """Positions past the committed context that one step may write (drafter slots or tree nodes)."""
    return max(max(s.ndt, max_expanded(s)) for s in shapes) + 1


def _capture_bank(rt, cache, keys, values, max_context: int, **cap) -> tuple[dict[int, StaticDraftStep], list[ShapeCapture]]:
    """Static verify per ndt and static draft step per width, referenced by every shape that uses them."""
    verifies: dict[int, StaticVerify] = {}
    steps: dict[int, StaticDraftStep] = {}
    captures = []
    for shape in rt.bank.shapes:
        graphs = rt.bank.get(shape).graphs
        with _Meter(rt.device) as mv:
            if shape.ndt not in verifies:
                verifies[shape.ndt] = _verify_static(rt, cache, shape, max_context, **cap)
        widths = tuple(range(1, max_beam(shape) + 1))
        new = tuple(b for b in widths if b not in steps)
        with _Meter(rt.device) as md:
            for b in new:
                steps[b] = _draft_static(rt.drafter, b, keys, values, **cap)
        graphs["verify"], graphs["draft"] = verifies[shape.ndt], {b: steps[b] for b in widths}
        captures.append(ShapeCapture(
            shape=shape, verify_seconds=mv.seconds, verify_allocated=mv.allocated, verify_reserved=mv.reserved,
            draft_widths=widths, draft_new_widths=new, draft_seconds=md.seconds,
            draft_allocated=md.allocated, draft_reserved=md.reserved,
        ))
    return steps, captures


def enable_cuda_graphs(
    runtime: TorchRuntime, max_context: int, *, capture: bool | None = None, warmup: int = 2, share_pool: bool = True
) -> CudaGraphs:
    """Capture one verify graph per bank shape and one drafter graph per level width; install them.

    ``max_context``: positions of the static caches (rounded up to a multiple of 64); prompt +
    max_new_tokens + :func:`tree_room` must fit. ``capture``: capture CUDA graphs (default: when
    the runtime is on CUDA); False runs the same static path eagerly. ``share_pool``: all graphs
    share one memory pool (they are replayed one at a time, never concurrently). Shapes with the
    same ndt share one verify graph; drafter graphs are per level width, shared by the shapes.
    Returns the installed :class:`CudaGraphs` (also ``runtime.cuda_graphs``, which
    :func:`capture_report` reads).
    """
    if capture is None:
        capture = getattr(runtime, "device", torch.device("cpu")).type == "cuda"
    reason = cuda_graphs_unsupported_reason(runtime, capture)
    if reason:
        raise CudaGraphsUnsupportedError(reason)
    max_context = -(-max_context // ALIGN) * ALIGN
    rt, d = runtime, runtime.drafter
    t0 = time.perf_counter()
    with torch.inference_mode(), (torch.cuda.device(rt.device) if capture else contextlib.nullcontext()):
        pool = torch.cuda.graph_pool_handle() if capture and share_pool else None
        cache = _static_cache(rt.target, max_context, rt.dtype, rt.device)
        kv = (1, d.config.num_key_value_heads, max_context, d.config.head_dim)
        keys = torch.zeros(kv, dtype=d.lm_head.weight.dtype, device=rt.device)  # zeros: masked rows stay finite
        values = torch.zeros_like(keys)
        steps, captures = _capture_bank(rt, cache, keys, values, max_context, capture=capture, warmup=warmup, pool=pool)
        if d._k is not None and d.length:  # enabled mid-sequence: keep what the drafter holds
            keys[:, :, : d.length].copy_(d._k[:, :, : d.length])
            values[:, :, : d.length].copy_(d._v[:, :, : d.length])
        d._k, d._v = keys, values
        drafter = StaticDrafter(d, keys, values, steps, torch.finfo(keys.dtype).min)
        graphs = CudaGraphs(runtime=rt, max_context=max_context, captured=capture, cache=cache, drafter=drafter,
                            room=tree_room(rt.bank.shapes), eager_prefill=rt.prefill, captures=captures)
        if rt.cache is not None:  # enabled mid-sequence: move the live cache over
            graphs.adopt(rt.cache, rt.P)
        _Meter(rt.device)._sync()
    graphs.seconds = time.perf_counter() - t0
    # Install: instance attributes shadow the class's methods; nothing global changes.
    rt.prefill, rt.verify_forward, rt.drafter = graphs.prefill, graphs.verify_forward, graphs.drafter
    rt.cuda_graphs = graphs
    return graphs


def capture_report(runtime: Any) -> dict[str, Any]:
    """Capture time and memory per shape of a runtime :func:`enable_cuda_graphs` was applied to."""
    graphs = getattr(runtime, "cuda_graphs", None)
    if graphs is None:
        raise CudaGraphsUnsupportedError("CUDA graphs are not enabled on this runtime: call enable_cuda_graphs first")
    return graphs.report()


class GraphedTorchRuntime(TorchRuntime):
    """The torch runtime with CUDA graphs captured per bank shape when the bank is prepared."""

    name = "torch-cuda-graphs"

    def prepare(self, shapes, capacity: int = 1024, extra_rows: int = 0):
        if extra_rows:  # a static verify is captured for ndt rows; fused trees up to ndt (extra_slots: 0) fit it
            raise CudaGraphsUnsupportedError(
                f"runtime.name: torch-cuda-graphs captures verify graphs of ndt rows; a candidate source asks for "
                f"{extra_rows} extra verify slots; expected extra_slots: 0 in the source, or runtime.name: torch")
        bank = super().prepare(shapes, capacity)
        enable_cuda_graphs(self, max_context=capacity, capture=True)  # on CPU: a clear error, not a silent fallback
        return bank


@adaptivespec.hookimpl
def adaptivespec_register_runtimes(registry):
    registry.register(GraphedTorchRuntime)
