"""SGLang plugin: each EAGLE step runs at the tree shape an adaptivespec policy picks, verified by
an adaptivespec verifier.

SGLang (0.5.23) runs every function advertised in the entry-point group ``sglang.srt.plugins`` in
each of its processes (``load_plugins``: launcher, scheduler, detokenizer), then applies the hooks
they registered with ``HookRegistry``. :func:`register` is ours; it does nothing unless
``ADAPTIVESPEC_CONFIG`` names an adaptivespec YAML (``adaptivespec serve`` sets it). Then it

1. asserts the SGLang API it needs (:func:`adaptivespec.sglang.api.assert_api`) and reads the config;
2. replaces ``EAGLEWorkerV2`` (the worker of ``--speculative-algorithm EAGLE3``: the algorithm name
   stays, so every EAGLE-3 code path stays) and its ``EagleDraftWorker`` by subclasses that keep
   a :class:`~adaptivespec.sglang.policy_bridge.ShapeStateBank` of captured states, one per policy
   shape, and ask a :class:`~adaptivespec.sglang.policy_bridge.TripletController` for each step's
   shape;
3. wraps ``eagle_sample`` so that, inside our worker's verify and when the verifier is not
   ``strict``, the adaptivespec verifier decides what is accepted (greedy batches only: sampled
   batches keep SGLang's own lossless tree sampling, and ``serve`` refuses a lossy verifier in a
   config at ``generation.temperature > 0``);
4. wraps ``get_alloc_len_per_decode`` so every decode reserves KV for the largest bank shape: the
   scheduler reserves before the policy has chosen.

The server must start at the bank's largest shape (``ShapeStateBank.max_shape``), so every buffer
SGLang sizes from its arguments fits every shape. SGLang's ``load_plugins`` logs a plugin's
exception and carries on; so that a broken setup never runs as plain EAGLE-3, a failure here also
makes the EAGLE worker refuse to start, with the same message.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
from typing import Any

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import CONFIG_ENV
from adaptivespec.sglang.policy_bridge import (
    ShapeStateBank,
    TripletController,
    build_strategies,
    format_shapes,
    sglang_shapes,
    step_level_notice,
    wrap_verify,
)
from adaptivespec.types import TreeShape

logger = logging.getLogger("adaptivespec.sglang")

WORKER_TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
DRAFT_TARGET = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
SAMPLE_TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
KV_TARGET = "sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode"
VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"

_VERIFYING: contextvars.ContextVar[Any] = contextvars.ContextVar("adaptivespec_verifying", default=None)
_KV_RESERVE = {"len": 0}  # KV slots per request and decode step covering every bank shape
_WARNED: set[str] = set()


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: install adaptivespec when configured."""
    path = os.environ.get(CONFIG_ENV, "").strip()
    if not path:
        logger.info("%s is not set: the adaptivespec plugin stays inactive", CONFIG_ENV)
        return
    try:
        from adaptivespec.config import load_config
        from adaptivespec.sglang.api import assert_api

        assert_api()
        config = load_config(path)
        ShapeStateBank(sglang_shapes(build_strategies(config)[0].shapes()))  # refuse what SGLang cannot run, now
        _install(path)
    except Exception as exc:
        _refuse_eagle_worker(f"{type(exc).__name__}: {exc}")
        raise


def unsupported_reason(*, adaptive: bool, rejection_sampling: bool, tp_size: int, pp_size: int) -> str | None:
    """Why the adaptivespec worker cannot run with these server settings, as a sentence."""
    if adaptive:
        return "--speculative-adaptive is SGLang's own step controller; adaptivespec replaces it: drop the flag"
    if rejection_sampling:
        return "--speculative-use-rejection-sampling runs topk=1 chains only; drop it to vary the tree shape"
    if tp_size != 1 or pp_size != 1:
        return f"tp_size={tp_size}, pp_size={pp_size}: each rank would pick shapes from its own draft probabilities; use 1 and 1"
    return None


def _install(config_path: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import eagle_worker_common  # noqa: F401  holds eagle_sample by name
    from sglang.srt.speculative import eagle_worker_v2

    draft_cls, worker_cls = _worker_classes(eagle_worker_v2, config_path)
    HookRegistry.register(DRAFT_TARGET, draft_cls, HookType.REPLACE)
    HookRegistry.register(WORKER_TARGET, worker_cls, HookType.REPLACE)
    HookRegistry.register(SAMPLE_TARGET, _eagle_sample_around, HookType.AROUND)
    HookRegistry.register(KV_TARGET, _kv_alloc_len_around, HookType.AROUND)
    HookRegistry.register(VALIDATE_TARGET, _validate_request_around, HookType.AROUND)


def _refuse_eagle_worker(message: str) -> None:
    """Make the EAGLE worker fail at construction with ``message`` (best effort)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        from sglang.srt.speculative import eagle_worker_v2
    except ImportError:
        return  # no SGLang to block
    try:

        class RefusedEAGLEWorker(eagle_worker_v2.EAGLEWorkerV2):
            def __init__(self, *args, **kwargs):
                raise AdaptiveSpecError(f"adaptivespec SGLang plugin failed to load ({CONFIG_ENV} is set): {message}")

        HookRegistry.register(WORKER_TARGET, RefusedEAGLEWorker, HookType.REPLACE)
    except Exception:
        logger.exception("adaptivespec: could not block the EAGLE worker after a failed load")


@contextlib.contextmanager
def _topk_as(worker: Any, topk: int):
    """Temporarily set ``worker.topk`` (0: leave it)."""
    saved = worker.topk
    if topk:
        worker.topk = topk
    try:
        yield
    finally:
        worker.topk = saved


def _worker_classes(ew: Any, config_path: str) -> tuple[type, type]:
    """Subclasses of SGLang's EAGLE draft worker and worker (``ew``: eagle_worker_v2)."""
    from sglang.srt.runtime_context import get_context, get_parallel, get_spec
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

    class AdaptiveSpecDraftWorker(ew.EagleDraftWorker):
        """Draft worker whose draft-extend hands the next step the bank's widest first level.

        The next step's shape is not known when draft-extend runs, so it keeps ``max topk``
        candidates with their probabilities (above 1 this also bypasses SGLang's topk=1 argmax path,
        which reports probability 1.0); the worker slices them to the chosen ``topk``.
        """

        adaptivespec_topk = 0  # the bank's largest topk when > 1; 0 keeps SGLang's behaviour

        def _draft_extend_for_decode(self, *args, **kwargs):
            with _topk_as(self, self.adaptivespec_topk):
                return super()._draft_extend_for_decode(*args, **kwargs)

        def _draft_extend_for_prefill(self, *args, **kwargs):
            with _topk_as(self, self.adaptivespec_topk):
                return super()._draft_extend_for_prefill(*args, **kwargs)

        def _rebuild_topk1_chain_buffers(self):
            # While a topk=1 shape is captured, SGLang's capture context restores the start-up
            # (nsteps, ndt) before .topk is restored; skip that inconsistent rebuild:
            # apply_runtime_state rebuilds the buffers whenever a topk=1 state becomes active.
            if self.topk != 1 or self.speculative_num_draft_tokens == self.speculative_num_steps + 1:
                super()._rebuild_topk1_chain_buffers()

    class AdaptiveSpecWorker(ew.EAGLEWorkerV2):
        """EAGLEWorkerV2 running each decode step at the ``(nsteps, topk, ndt)`` a policy picks."""

        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            spec, parallel = get_spec(), get_parallel()
            reason = unsupported_reason(
                adaptive=bool(spec.speculative_adaptive),
                rejection_sampling=bool(spec.speculative_use_rejection_sampling),
                tp_size=parallel.tp_size,
                pp_size=parallel.pp_size,
            )
            if reason:
                raise AdaptiveSpecError(f"adaptivespec SGLang plugin: {reason}")
            from adaptivespec.config import load_config
            from adaptivespec.plugins import get_plugin_host

            host = get_plugin_host()
            config = load_config(config_path)
            policy, self.adaptivespec_verifier = build_strategies(config, host)
            observe = host.has_observers("adaptivespec_step")
            trace = StepTrace.from_env()
            self.adaptivespec = TripletController(
                policy, on_record=(lambda r: host.pm.hook.adaptivespec_step(record=r)) if observe else None,
                on_trace=trace.write if trace is not None else None,
                verify_budget=verify_budget_from_env(),
                load=load_model_from_env(),
            )
            notice = step_level_notice(policy)
            if notice:
                logger.warning("adaptivespec: %s", notice)
            bank = self.adaptivespec_bank = ShapeStateBank(self.adaptivespec.shapes)
            self.adaptivespec_shape = TreeShape(self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens)
            top = bank.max_shape()
            if self.adaptivespec_shape != top:
                raise AdaptiveSpecError(
                    f"adaptivespec SGLang plugin: the server started at {self.adaptivespec_shape}, but the "
                    f"shapes of policy {policy.name!r} ({format_shapes(bank.shapes)}) need their largest, "
                    f"{top}: --speculative-num-steps {top.nsteps} --speculative-eagle-topk {top.topk} "
                    f"--speculative-num-draft-tokens {top.ndt} (adaptivespec serve passes these)"
                )
            _KV_RESERVE["len"] = bank.kv_alloc_len_per_decode(self.page_size)
            if self._draft_worker is not None:
                self._draft_worker.adaptivespec_topk = bank.max_topk() if bank.max_topk() > 1 else 0
            if bank.max_topk() == 1:
                logger.warning("adaptivespec: every shape has topk=1; SGLang then reports draft probability 1.0")

        def init_cuda_graphs(self):
            super().init_cuda_graphs()  # the start-up (largest) shape
            if self._draft_worker is None:
                return
            bank = self.adaptivespec_bank
            if self.adaptivespec_shape in bank.shapes:
                bank.register(self.adaptivespec_shape, self._adaptivespec_live_state())
            bank.build_missing(self._adaptivespec_capture)
            logger.info("adaptivespec: captured tree shapes %s", format_shapes(bank.keys()))

        def _adaptivespec_live_state(self):
            dw, runner = self._draft_worker, self._target_worker.model_runner
            return SpecRuntimeState(
                speculative_num_steps=self.speculative_num_steps,
                speculative_num_draft_tokens=self.speculative_num_draft_tokens,
                draft_attn_backend=dw.draft_attn_backend,
                cuda_graph_runner=dw.cuda_graph_runner,
                target_attn_backend=runner.attn_backend,
                target_graph_runner=runner.decode_cuda_graph_runner,
                draft_extend_attn_backend=dw.draft_extend_attn_backend,
                cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
            )

        def _adaptivespec_capture(self, shape: TreeShape):
            """Capture ``shape``'s state with SGLang's own builder, ``topk`` set around it (on a
            CPU: an eager state, :meth:`_adaptivespec_eager_state`)."""
            dw, saved = self._draft_worker, self.topk
            self.topk = dw.topk = shape.topk
            get_context().override("adaptivespec.capture", speculative_eagle_topk=shape.topk)
            try:
                with (
                    ew.draft_tp_context(dw.parallel_layout),
                    ew.speculative_moe_backend_context(),
                    ew.speculative_moe_a2a_backend_context(),
                ):
                    if _is_cpu_device(getattr(self, "device", None)):
                        return self._adaptivespec_eager_state(shape)
                    return self.build_adaptive_runtime_state(shape.nsteps, shape.ndt, cuda_graph_bs=None)
            finally:
                self.topk = dw.topk = saved
                get_context().override("adaptivespec.capture_restore", speculative_eagle_topk=saved)

        def _adaptivespec_eager_state(self, shape: TreeShape):
            """``shape``'s state without graphs: SGLang's CPU attention backend (Intel AMX) has no
            CUDA-graph state, so ``build_adaptive_runtime_state`` cannot capture one. The draft
            backends (one per draft step) and the target's verify backend are built for the shape,
            as that builder does before capturing; every forward then runs eagerly."""
            dw = self._draft_worker
            with self._override_worker_state(shape.nsteps, shape.ndt):
                dw.init_attention_backend()
                runner = self._target_worker.model_runner
                backup = runner.init_new_workspace
                try:
                    target_attn_backend = runner._get_attention_backend(init_new_workspace=True)
                finally:
                    runner.init_new_workspace = backup
                return SpecRuntimeState(
                    speculative_num_steps=shape.nsteps,
                    speculative_num_draft_tokens=shape.ndt,
                    draft_attn_backend=dw.draft_attn_backend,
                    cuda_graph_runner=None,
                    target_attn_backend=target_attn_backend,
                    target_graph_runner=None,
                    draft_extend_attn_backend=dw.draft_extend_attn_backend,
                    cuda_graph_runner_for_draft_extend=None,
                )

        def _adaptivespec_activate(self, shape: TreeShape) -> None:
            if shape == self.adaptivespec_shape:
                return
            state = self.adaptivespec_bank.get(shape)  # raises, naming the captured shapes
            self.topk = self._draft_worker.topk = shape.topk  # before apply: it rebuilds topk=1 buffers
            if self.speculative_num_steps == shape.nsteps:
                self.speculative_num_steps = -1  # apply_runtime_state skips a state of the active depth
            self.apply_runtime_state(state)
            get_context().override("adaptivespec.apply", speculative_eagle_topk=shape.topk)
            self.adaptivespec_shape = shape

        def forward_batch_generation(self, batch, *args, **kwargs):
            spec = batch.spec_info
            decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
            if decode and self._draft_worker is not None and getattr(spec, "topk_p", None) is not None:
                shape = self.adaptivespec.begin_step(spec.topk_p, [req.rid for req in batch.reqs])
                if shape is not None:
                    if spec.topk_p.shape[1] < shape.topk:
                        raise AdaptiveSpecError(
                            f"adaptivespec: the draft input carries top-{spec.topk_p.shape[1]}, {shape} needs {shape.topk}"
                        )
                    self._adaptivespec_activate(shape)
                    spec.topk_p = spec.topk_p[:, : shape.topk].contiguous()
                    spec.topk_index = spec.topk_index[:, : shape.topk].contiguous()
            return super().forward_batch_generation(batch, *args, **kwargs)

        def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
            token = _VERIFYING.set(self) if self.adaptivespec_verifier is not None else None
            try:
                return super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
            finally:
                if token is not None:
                    _VERIFYING.reset(token)

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
            super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
            self.adaptivespec.observe(num_correct_drafts_per_req)

    return AdaptiveSpecDraftWorker, AdaptiveSpecWorker


def verify_budget_from_env() -> int | None:
    """``ADAPTIVESPEC_SGLANG_VERIFY_BUDGET`` (``serve --verify-budget``): verified rows per step
    (batch size x ndt) past which the controller shrinks the tree; unset or 0: no cap."""
    from adaptivespec.sglang.serve import VERIFY_BUDGET_ENV

    text = os.environ.get(VERIFY_BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise AdaptiveSpecError(f"{VERIFY_BUDGET_ENV}: expected an integer, got {text!r}") from None
    return value or None


def load_model_from_env():
    """``ADAPTIVESPEC_SGLANG_LOAD_PROFILE`` (``serve --load-profile``): the served step's cost
    profile; the controller then shrinks the tree as the batch grows (:class:`LoadModel`). Unset:
    no load model."""
    from adaptivespec.costmodel import CostModel
    from adaptivespec.sglang.policy_bridge import LoadModel
    from adaptivespec.sglang.serve import LOAD_PROFILE_ENV

    path = os.environ.get(LOAD_PROFILE_ENV, "").strip()
    if not path:
        return None
    try:
        return LoadModel(CostModel.load(path))
    except ValueError as exc:
        raise AdaptiveSpecError(f"{LOAD_PROFILE_ENV}: {exc}") from None


def _is_cpu_device(device: Any) -> bool:
    return str(device).split(":")[0] == "cpu"


class StepTrace:
    """JSON lines, one per observed decode step, appended to the file ``ADAPTIVESPEC_SGLANG_TRACE``
    names (``adaptivespec serve --trace``): ``{"step", "shape": [nsteps, topk, ndt], "bs",
    "accepted", "ms", "gap_ms", "policy"}`` (``accepted``: drafted tokens accepted, reduced over the
    batch as the policy sees it; ``ms``: host time from the shape's choice to the accept lengths,
    the draft and verify of the step; ``gap_ms``: from the previous step's accept lengths to this
    step's start when the batch is the same, i.e. the rest of the previous step -- its draft
    extension and the scheduler --, else null). Line-buffered: a reader sees every finished step."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        from adaptivespec.sglang.serve import TRACE_ENV

        path = os.environ.get(TRACE_ENV, "").strip()
        return cls(path) if path else None

    def write(self, record, batch_size: int, gap_ms: float | None = None) -> None:
        import json

        s = record.shape
        line = {"step": record.step, "shape": [s.nsteps, s.topk, s.ndt], "bs": batch_size, "accepted": record.accepted,
                "ms": round(record.verify_ms, 3), "gap_ms": None if gap_ms is None else round(gap_ms, 3),
                "policy": {k: v for k, v in (record.policy_state or {}).items() if _plain(v)}}
        self._file.write(json.dumps(line) + "\n")


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _eagle_sample_around(original, *args, **kwargs):
    """AROUND hook of ``eagle_sample``: SGLang's pass first (it applies penalties and the grammar
    mask to the logits in place), then, inside our worker's verify, the adaptivespec verifier."""
    out = original(*args, **kwargs)
    worker = _VERIFYING.get()
    if worker is None:
        return out
    if original not in _SIGNATURES:
        _SIGNATURES[original] = inspect.signature(original)
    bound = _SIGNATURES[original].bind(*args, **kwargs).arguments
    verify_input, batch, logits_output = bound["verify_input"], bound["batch"], bound["logits_output"]
    if batch.forward_mode.is_idle():
        return out
    if not batch.sampling_info.is_all_greedy:
        _warn_once(f"adaptivespec: verifier {worker.adaptivespec_verifier.name!r} runs on greedy batches; "
                   "sampled batches use SGLang's lossless verification")
        return out
    bs = verify_input.retrieve_index.shape[0]
    result = wrap_verify(
        worker.adaptivespec_verifier,
        candidates=verify_input.draft_token.reshape(bs, verify_input.draft_token_num),
        retrieve_index=verify_input.retrieve_index,
        retrieve_next_token=verify_input.retrieve_next_token,
        retrieve_next_sibling=verify_input.retrieve_next_sibling,
        logits=logits_output.next_token_logits,
        spec_steps=verify_input.spec_steps,
        topk=verify_input.topk,
    )
    worker.adaptivespec.note_promoted(result.promoted)
    return result.predict, result.accept_lens, result.accept_index


def _kv_alloc_len_around(original, *args, **kwargs):
    """AROUND hook of ``get_alloc_len_per_decode``: never less than the largest bank shape needs."""
    return max(original(*args, **kwargs), _KV_RESERVE["len"])


def _validate_request_around(original, *args, **kwargs):
    """AROUND hook of the tokenizer manager's request check: token ids outside the vocabulary are
    refused there (HTTP 400, SGLang's own error path), as SGLang 0.5.23 does for
    ``token_ids_logprob`` but not for ``input_ids``: an out-of-range prompt id otherwise reaches
    the embedding in the scheduler and kills the server."""
    manager = args[0] if args else None
    input_ids = kwargs.get("input_ids", args[2] if len(args) > 2 else None)
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    if vocab and input_ids:
        bad = next((t for t in input_ids if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab}).")
    return original(*args, **kwargs)
