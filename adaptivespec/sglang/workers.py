"""The EAGLE worker subclasses that run each decode step at the shape an adaptivespec policy picks.

This module imports SGLang at the top: the plugin imports it only inside SGLang's processes, when it
installs itself (:func:`adaptivespec.sglang.plugin.register`), so importing adaptivespec never does.
The worker reads the config ``ADAPTIVESPEC_CONFIG`` names, asks a
:class:`~adaptivespec.sglang.controller.TripletController` for each step's shape, keeps a
:class:`~adaptivespec.sglang.state_bank.ShapeStateBank` of captured states (plus the wide verify
states of merged trees and the no-draft step's), runs the config's candidate sources through the
draft stage (:mod:`adaptivespec.sglang.stage_steps`), and records each verified step (trace file,
``/metrics``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from typing import Any

from sglang.srt.runtime_context import get_context, get_parallel, get_spec
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.plugins import get_plugin_host
from adaptivespec.sglang import CONFIG_ENV, one_row_verify, root_entropy
from adaptivespec.sglang.controller import (SKIP_EXTEND_ENV, TripletController, build_strategies, step_level_notice,
                                            verify_budget_from_env)
from adaptivespec.sglang.draft_stage import ServedDraftStage
from adaptivespec.sglang.draft_worker import AdaptiveSpecDraftWorker, topk_as  # noqa: F401 (registered from here too)
from adaptivespec.sglang.load_model import load_model_from_env
from adaptivespec.sglang.metrics import SpecMetrics
from adaptivespec.sglang.platform import unsupported_reason
from adaptivespec.sglang.shapes import NoDraft, format_shapes
from adaptivespec.sglang.stage_steps import DraftStageSteps, keep_head_scores
from adaptivespec.sglang.state_bank import KV_RESERVE, ShapeStateBank
from adaptivespec.sglang.trace import StepTrace
from adaptivespec.sglang.uncompiled import run_uncompiled
from adaptivespec.sglang.verification import VERIFYING
from adaptivespec.types import TreeShape

logger = logging.getLogger("adaptivespec.sglang")

ew = importlib.import_module("sglang.srt.speculative.eagle_worker_v2")
"""SGLang's EAGLE worker module (the subclasses' bases, its context managers)."""


@dataclasses.dataclass(frozen=True)
class _Dims:
    """A runtime state's ``(nsteps, topk, ndt)`` where ``ndt`` may exceed what one head tree of
    ``(nsteps, topk)`` holds: the wide verify states of merged trees."""

    nsteps: int
    topk: int
    ndt: int


def _is_cpu_device(device: Any) -> bool:
    return str(device).split(":")[0] == "cpu"


def _eager_state(nsteps: int, ndt: int, draft_backend, draft_extend_backend, target_backend) -> SpecRuntimeState:
    """A runtime state without graphs (every forward eager)."""
    return SpecRuntimeState(
        speculative_num_steps=nsteps,
        speculative_num_draft_tokens=ndt,
        draft_attn_backend=draft_backend,
        cuda_graph_runner=None,
        target_attn_backend=target_backend,
        target_graph_runner=None,
        draft_extend_attn_backend=draft_extend_backend,
        cuda_graph_runner_for_draft_extend=None,
    )


class AdaptiveSpecWorker(DraftStageSteps, ew.EAGLEWorkerV2):
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
        host = get_plugin_host()
        config = load_config(os.environ[CONFIG_ENV].strip())  # as register() read it
        policy, self.adaptivespec_verifier = build_strategies(config, host)
        self.adaptivespec_stage = ServedDraftStage.from_config(config, host)
        if self.adaptivespec_stage is not None:  # constrained requests: the grammar source reads their state
            self.adaptivespec_stage.view = self._adaptivespec_grammar_view
        self.adaptivespec_wide: dict[int, Any] = {}  # verify width -> state (merged steps)
        self.adaptivespec_undrafted_state = None  # the no-draft step's state (load controls)
        self._adaptivespec_active: Any = None  # key of the active state (see _adaptivespec_apply)
        observe = host.has_observers("adaptivespec_step")
        trace = StepTrace.from_env()
        self.adaptivespec = TripletController(
            policy, on_record=(lambda r: host.pm.hook.adaptivespec_step(record=r)) if observe else None,
            on_trace=trace.write if trace is not None else None,
            verify_budget=verify_budget_from_env(),
            load=load_model_from_env(),
            metrics=SpecMetrics.from_env(),
        )
        # $ADAPTIVESPEC_SGLANG_SKIP_EXTEND=0: the head's draft-extend runs after every undrafted step
        self.adaptivespec.skip_settled_extend = os.environ.get(SKIP_EXTEND_ENV, "1") != "0"
        # the load controls may run a step that drafts nothing (SGLang's nsteps == 0 path)
        self.adaptivespec.undrafted = self.adaptivespec.load is not None or self.adaptivespec.verify_budget is not None
        notice = step_level_notice(policy)
        if notice:
            logger.warning("adaptivespec: %s", notice)
        bank = self.adaptivespec_bank = ShapeStateBank(self.adaptivespec.shapes)
        self.adaptivespec_shape = TreeShape(self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens)
        self._adaptivespec_active = self.adaptivespec_shape  # the start-up state
        top = bank.max_shape()
        if self.adaptivespec_shape != top:
            raise AdaptiveSpecError(
                f"adaptivespec SGLang plugin: the server started at {self.adaptivespec_shape}, but the "
                f"shapes of policy {policy.name!r} ({format_shapes(bank.shapes)}) need their largest, "
                f"{top}: --speculative-num-steps {top.nsteps} --speculative-eagle-topk {top.topk} "
                f"--speculative-num-draft-tokens {top.ndt} (adaptivespec serve passes these)"
            )
        KV_RESERVE["len"] = bank.kv_alloc_len_per_decode(self.page_size)
        if _is_cpu_device(getattr(self, "device", None)):  # torch.compile does not pay on a CPU
            run_uncompiled(importlib.import_module("sglang.srt.speculative.spec_utils"))
        stage = self.adaptivespec_stage
        if stage is not None:
            widest = max(stage.widths(bank.shapes))
            KV_RESERVE["len"] = max(KV_RESERVE["len"], -(-widest // self.page_size) * self.page_size)
            if self.adaptivespec.metrics is not None:
                self.adaptivespec.metrics.declare_sources(stage.names)
            logger.info("adaptivespec: draft stage with sources %s, up to %d extra verify rows",
                        ", ".join(stage.names[1:]), stage.extra_slots)
            if os.environ.get("ADAPTIVESPEC_SGLANG_FUSION", "joint") == "joint":
                keep_head_scores(ew)
        if self._draft_worker is not None:
            self._draft_worker.adaptivespec_topk = bank.max_topk() if bank.max_topk() > 1 else 0
            if getattr(policy, "reads_draft_entropy", False):
                self._draft_worker.adaptivespec_entropy = True
                root_entropy.keep_root_entropy(ew)
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
        if self.adaptivespec_stage is not None:
            deepest, widest_k = max(s.nsteps for s in bank.shapes), bank.max_topk()
            for width in self.adaptivespec_stage.widths(bank.shapes):
                self.adaptivespec_wide[width] = self._adaptivespec_capture(_Dims(deepest, widest_k, width))
            logger.info("adaptivespec: merged-tree verify widths %s", sorted(self.adaptivespec_wide))
        if self.adaptivespec.undrafted:
            self.adaptivespec_undrafted_state = self._adaptivespec_undrafted()
            logger.info("adaptivespec: no-draft step state built (load controls)")

    def _adaptivespec_undrafted(self):
        """The state of a step that drafts nothing: SGLang's ``speculative_num_steps == 0`` path
        verifies the last token alone (one row per request), with a target verify backend for one
        row -- on SGLang's CPU backend its attention runs with the decode kernel
        (:mod:`adaptivespec.sglang.one_row_verify`; ``ADAPTIVESPEC_SGLANG_ONE_ROW_DECODE=0`` keeps the
        extend kernel); the draft backends are the live ones (its draft extension runs unless the
        load model settled on not drafting: :attr:`LoadModel.settled`).
        Eager on every device (no graph is captured for it)."""
        live = self._adaptivespec_live_state()
        with self._override_worker_state(0, 1):
            target = self._adaptivespec_verify_backend()
        if os.environ.get(one_row_verify.ENV, "1") != "0" and one_row_verify.decode_one_row_verify(target):
            logger.info("adaptivespec: the no-draft step runs its attention with the decode kernel")
        return _eager_state(0, 1, live.draft_attn_backend, live.draft_extend_attn_backend, target)

    def _adaptivespec_verify_backend(self):
        """A new target attention backend sized by the (overridden) speculative settings."""
        runner = self._target_worker.model_runner
        backup = runner.init_new_workspace
        try:
            return runner._get_attention_backend(init_new_workspace=True)
        finally:
            runner.init_new_workspace = backup

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

    def _adaptivespec_capture(self, shape: "TreeShape | _Dims"):
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

    def _adaptivespec_eager_state(self, shape: "TreeShape | _Dims"):
        """``shape``'s state without graphs: SGLang's CPU attention backend (Intel AMX) has no
        CUDA-graph state, so ``build_adaptive_runtime_state`` cannot capture one. The draft
        backends (one per draft step) and the target's verify backend are built for the shape,
        as that builder does before capturing; every forward then runs eagerly."""
        dw = self._draft_worker
        with self._override_worker_state(shape.nsteps, shape.ndt):
            dw.init_attention_backend()
            return _eager_state(shape.nsteps, shape.ndt, dw.draft_attn_backend, dw.draft_extend_attn_backend,
                                self._adaptivespec_verify_backend())

    def _adaptivespec_activate(self, shape: TreeShape) -> None:
        """Draft this step at ``shape`` (its bank state)."""
        self.adaptivespec_shape = shape
        if self._adaptivespec_active == shape:
            return
        state = self.adaptivespec_bank.get(shape)  # raises, naming the captured shapes
        self.topk = self._draft_worker.topk = shape.topk  # before apply: it rebuilds topk=1 buffers
        self._adaptivespec_apply(state, shape)
        get_context().override("adaptivespec.apply", speculative_eagle_topk=shape.topk)

    def _adaptivespec_apply(self, state, key) -> None:
        """Make ``state`` (known as ``key``: a bank shape, a verify width, or NO_DRAFT) the active one."""
        if self.speculative_num_steps == state.speculative_num_steps:
            self.speculative_num_steps = -1  # apply_runtime_state skips a state of the active depth
        self.apply_runtime_state(state)
        self._adaptivespec_active = key

    def _adaptivespec_widen(self, width: int) -> None:
        """Verify and draft-extend this step at ``width`` rows per request (a merged tree); the
        drafted shape's state comes back at the next step's activation."""
        state = self.adaptivespec_wide.get(width)
        if state is None:
            raise AdaptiveSpecError(f"adaptivespec: no verify state of width {width}; built: {sorted(self.adaptivespec_wide)}")
        self._adaptivespec_apply(state, width)

    def forward_batch_generation(self, batch, *args, **kwargs):
        spec = batch.spec_info
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        shape = None
        if decode and self._draft_worker is not None and getattr(spec, "topk_p", None) is not None:
            shape = self.adaptivespec.begin_step(spec.topk_p, [req.rid for req in batch.reqs],
                                                 entropy=root_entropy.take(len(batch.reqs)))
        if self._draft_worker is not None:
            self._draft_worker.adaptivespec_skip_extend = isinstance(shape, NoDraft) and self.adaptivespec.skip_draft_extend
            self._draft_worker.adaptivespec_skip_prefill = (  # the flag first: the pool is read only then
                not decode and self.adaptivespec.skip_draft_extend
                and self.adaptivespec.skip_prefill_extend(self._adaptivespec_live_requests()))
        if isinstance(shape, NoDraft):
            if self._adaptivespec_active is not shape:
                self._adaptivespec_apply(self.adaptivespec_undrafted_state, shape)
        elif shape is None:  # prefill, idle: the last drafted shape's state (not a wide or no-draft one)
            if self._adaptivespec_active != self.adaptivespec_shape:
                self._adaptivespec_activate(self.adaptivespec_shape)
        else:
            if spec.topk_p.shape[1] < shape.topk:
                raise AdaptiveSpecError(
                    f"adaptivespec: the draft input carries top-{spec.topk_p.shape[1]}, {shape} needs {shape.topk}"
                )
            self._adaptivespec_activate(shape)
            spec.topk_p = spec.topk_p[:, : shape.topk].contiguous()
            spec.topk_index = spec.topk_index[:, : shape.topk].contiguous()
        return super().forward_batch_generation(batch, *args, **kwargs)

    def _adaptivespec_live_requests(self) -> int:
        """Requests holding a row of the request-to-token pool: the running batch and the ones
        being admitted (the worker does not see the scheduler's running batch)."""
        pool = self._target_worker.model_runner.req_to_token_pool
        return pool.size - pool.available_size()

    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        stage = self.adaptivespec_stage
        live = stage is not None and not batch.forward_mode.is_idle() and len(batch.reqs) > 0
        merged = None
        if self.speculative_num_steps == 0 and not batch.forward_mode.is_idle():  # a step that drafts nothing
            self._adaptivespec_root_only(batch)
            if live:
                stage.unmerged([r.rid for r in batch.reqs], [])
        elif live:
            merged = self._adaptivespec_merge(batch)
        token = VERIFYING.set(self) if self.adaptivespec_verifier is not None else None
        try:
            # a merged tree's accepted path need not be the front rows: SGLang compacts it for topk > 1
            with topk_as(self, 2 if merged is not None and self.topk == 1 else 0):
                out = super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        finally:
            if token is not None:
                VERIFYING.reset(token)
        if live:
            self._adaptivespec_after_verify(batch, out, merged)
        return out

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        self.adaptivespec.observe(num_correct_drafts_per_req)
