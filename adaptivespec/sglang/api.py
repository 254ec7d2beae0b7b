"""The pinned SGLang release and every part of its API the adaptivespec plugin relies on.

:data:`REQUIRED_API` is declarative: each :class:`Api` names a module and what must be in it (a
class, a function and its parameter names, fields, ``self.`` attributes, imports, calls). It is
checked two ways (:mod:`adaptivespec.sglang.api_check`):

* :func:`~adaptivespec.sglang.api_check.check_api` -- statically, with ``ast`` over a source tree (an unpacked wheel), with no
  import: what the test suite runs on a CPU machine against the pinned wheel;
* :func:`~adaptivespec.sglang.api_check.assert_api` -- at plugin load in the server, with ``importlib``/``inspect`` on the modules
  SGLang really imported; raises :class:`SGLangAPIError` naming everything missing and the pin.

Why 0.5.23: the newest release on the package index (checked 2026-11-29) and one that has every
piece the plugin builds on: ``EAGLEWorkerV2`` (the only EAGLE/EAGLE3 worker left: the V1 worker is
gone), the ``sglang.srt.plugins`` entry-point group with ``HookRegistry`` and ``SGLANG_PLUGINS``,
and ``adaptive_runtime_state.SpecRuntimeState`` with ``build_adaptive_runtime_state`` /
``apply_runtime_state`` on the worker.
"""

from __future__ import annotations

from typing import Any

import attrs

from adaptivespec.errors import AdaptiveSpecError

SGLANG_VERSION = "0.5.23"
"""The SGLang release the plugin is written and checked against."""

WHEEL_TAGS = ("--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11", "--implementation", "cp")
"""Tags fixing which of the release's wheels is downloaded for the static check (the Python
sources are the same in every wheel; fixing one makes the download work from any machine)."""


class SGLangAPIError(AdaptiveSpecError):
    """The installed SGLang lacks something the plugin needs."""


KINDS = ("module", "class", "function", "field", "attribute", "constant", "import", "call")


@attrs.frozen
class Api:
    """One requirement on SGLang's source.

    ``kind`` says what ``name`` (a dotted path inside ``module``; empty for the module itself)
    must be and what ``names`` lists: a function's parameter names; a class's fields (names
    assigned in its body: dataclass, msgspec or enum members); attributes assigned as ``self.x``
    in its methods; names imported by a module or a function; names a function calls.
    """

    module: str
    name: str = ""
    kind: str = attrs.field(default="module", validator=attrs.validators.in_(KINDS))
    names: tuple[str, ...] = ()
    value: Any = None
    why: str = ""

    def where(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module


_SPEC = "sglang.srt.speculative"
_EW = f"{_SPEC}.eagle_worker_v2"

REQUIRED_API: tuple[Api, ...] = (
    # -- plugin loading -----------------------------------------------------------------------
    Api("sglang.srt.plugins", "GENERAL_PLUGINS_GROUP", "constant", value="sglang.srt.plugins",
        why="entry-point group of general plugins (pyproject [project.entry-points])"),
    Api("sglang.srt.plugins", "load_plugins", "function", why="runs our entry point in every SGLang process"),
    Api("sglang.srt.environ", "Envs", "field", ("SGLANG_PLUGINS",), why="plugin whitelist serve extends"),
    Api("sglang.srt.plugins.hook_registry", "HookRegistry.register", "function", ("target", "hook", "hook_type"),
        why="registers the worker replacement and the verify / KV-reserve wrappers"),
    Api("sglang.srt.plugins.hook_registry", "HookType", "field", ("REPLACE", "AROUND")),
    # -- the EAGLE worker we subclass ---------------------------------------------------------------
    Api(f"{_SPEC}.spec_info", "SpeculativeAlgorithm.create_worker", "import", ("EAGLEWorkerV2",),
        why="EAGLE/EAGLE3 resolve the worker class from eagle_worker_v2 at creation time"),
    Api(_EW, "EAGLEWorkerV2.__init__", "function", ("server_args", "gpu_id", "nccl_port", "target_worker")),
    Api(_EW, "EAGLEWorkerV2.__init__", "call", ("EagleDraftWorker",), why="the draft worker we replace"),
    Api(_EW, "EAGLEWorkerV2", "attribute",
        ("topk", "speculative_num_steps", "speculative_num_draft_tokens", "_draft_worker", "_target_worker", "page_size",
         "device")),
    Api(_EW, "EAGLEWorkerV2.init_cuda_graphs", "function", why="where the bank is built"),
    Api(_EW, "EAGLEWorkerV2.forward_batch_generation", "function", ("batch",), why="where each step's shape is chosen"),
    Api(_EW, "EAGLEWorkerV2.forward_batch_generation", "call", ("draft", "verify", "_draft_extend_for_decode")),
    Api(_EW, "EAGLEWorkerV2.verify", "function", ("batch", "pp_proxy_tensors", "grammar_barrier")),
    Api(_EW, "EAGLEWorkerV2.verify", "call", ("run_eagle_verify",)),
    Api(_EW, "EAGLEWorkerV2.on_verify_complete_cpu", "function", ("num_correct_drafts_per_req", "batch_size"),
        why="accept lengths reach the policy here"),
    Api(_EW, "EAGLEWorkerV2.build_adaptive_runtime_state", "function",
        ("speculative_num_steps", "speculative_num_draft_tokens", "cuda_graph_bs"), why="captures one shape's state"),
    Api(_EW, "EAGLEWorkerV2.apply_runtime_state", "function", ("state",), why="swaps the active shape's state"),
    Api("sglang.srt.managers.tokenizer_manager", "TokenizerManager._validate_one_request", "function",
        ("obj", "input_ids"), why="out-of-vocabulary prompt ids are refused there"),
    Api(_EW, "EAGLEWorkerV2._override_worker_state", "function", ("speculative_num_steps", "speculative_num_draft_tokens"),
        why="sets a shape around building its eager state (CPU: no CUDA-graph state)"),
    Api(_EW, "EagleDraftWorker.init_attention_backend", "function", why="the draft backends of an eager state"),
    Api("sglang.srt.model_executor.model_runner", "ModelRunner._get_attention_backend", "function",
        ("init_new_workspace",), why="the target's verify backend of an eager state"),
    Api(_EW, "EAGLEWorkerV2.apply_runtime_state", "call", ("_rebuild_topk1_chain_buffers",)),
    Api(_EW, "EagleDraftWorker", "attribute",
        ("topk", "speculative_num_steps", "speculative_num_draft_tokens", "parallel_layout", "draft_attn_backend",
         "cuda_graph_runner", "draft_extend_attn_backend", "cuda_graph_runner_for_draft_extend", "tree_mask_mode")),
    Api(_EW, "", "import", ("draft_tp_context", "speculative_moe_backend_context", "speculative_moe_a2a_backend_context"),
        why="the contexts SGLang captures adaptive states under"),
    Api("sglang.srt.model_executor.model_runner", "ModelRunner", "attribute", ("attn_backend", "decode_cuda_graph_runner", "model_config")),
    Api("sglang.srt.managers.schedule_batch", "ScheduleBatch", "field",
        ("reqs", "forward_mode", "is_extend_in_batch", "spec_info", "sampling_info")),
    Api("sglang.srt.managers.schedule_batch", "Req", "attribute", ("rid",), why="sequence boundaries reset the policy"),
    Api("sglang.srt.managers.schedule_batch", "Req", "attribute", ("origin_input_ids", "output_ids"),
        why="the draft stage's sources read each request's tokens"),
    Api(_EW, "EagleDraftWorker._draft_extend_for_decode", "call", ("renorm_draft_probs",),
        why="the root's entropy for policies that read it (the module's renorm_draft_probs is wrapped)"),
    Api(_EW, "", "import", ("renorm_draft_probs",)),
    Api(f"{_SPEC}.spec_utils", "select_top_k_tokens", "call", ("_select_top_k_tokens_later",),
        why="on a CPU the plugin runs the compiled later-level top-k uncompiled (looked up per call)"),
    Api("sglang.srt.managers.schedule_batch", "Req", "attribute", ("grammar",),
        why="the grammar source reads a constrained request's grammar state"),
    Api("sglang.srt.constrained.xgrammar_backend", "XGrammarGrammar", "attribute", ("matcher", "accepted_tokens"),
        why="the grammar source drafts from the matcher when it stands at the request's last token"),
    Api("sglang.srt.managers.tp_worker", "TpModelWorker", "attribute", ("tokenizer",),
        why="the grammar source encodes forced text with the served tokenizer"),
    Api("sglang.srt.managers.schedule_batch", "ScheduleBatch", "field", ("seq_lens", "seq_lens_cpu"),
        why="positions and the FULL_MASK layout of merged trees"),
    Api("sglang.srt.model_executor.forward_batch_info", "ForwardMode.is_extend", "function"),
    Api("sglang.srt.model_executor.forward_batch_info", "ForwardMode.is_idle", "function"),
    Api("sglang.srt.sampling.sampling_batch_info", "SamplingBatchInfo", "field", ("is_all_greedy",)),
    Api("sglang.srt.layers.logits_processor", "LogitsProcessorOutput", "field", ("next_token_logits",)),
    Api(_EW, "EagleDraftWorker._draft_extend_for_decode", "function", ("batch", "batch_result"),
        why="emits the next step's first-level top-k (widened to the bank's largest topk)"),
    Api(_EW, "EagleDraftWorker._draft_extend_for_prefill", "function", ("batch", "target_hidden_states", "next_token_ids")),
    Api(f"{_SPEC}.base_spec_worker", "EagleDraftWorkerBase._rebuild_topk1_chain_buffers", "function"),
    Api(f"{_SPEC}.base_spec_worker", "BaseSpecWorker.on_verify_complete_cpu", "function", ("num_correct_drafts_per_req",)),
    Api("sglang.srt.managers.scheduler_components.batch_result_processor",
        "SchedulerBatchResultProcessor._resolve_spec_v2_tokens", "call", ("on_verify_complete_cpu",),
        why="the scheduler reports accept lengths on the host"),
    Api(f"{_SPEC}.adaptive_runtime_state", "SpecRuntimeState", "field",
        ("speculative_num_steps", "speculative_num_draft_tokens", "draft_attn_backend", "cuda_graph_runner",
         "target_attn_backend", "target_graph_runner", "draft_extend_attn_backend", "cuda_graph_runner_for_draft_extend")),
    # -- tree layout and verification ---------------------------------------------------------------
    Api(f"{_SPEC}.eagle_info", "EagleDraftInput", "field", ("topk_p", "topk_index")),
    Api(f"{_SPEC}.eagle_info", "EagleVerifyInput", "field",
        ("draft_token", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "spec_steps", "topk",
         "draft_token_num")),
    Api(f"{_SPEC}.eagle_info", "EagleVerifyInput", "field",
        ("custom_mask", "positions", "num_tokens_per_req", "draft_probs", "prepared_out_cache_loc",
         "prepared_mrope_positions", "kv_loc_plan"), why="the draft stage replaces the verify input with a merged tree's"),
    Api("sglang.kernels.ops.speculative.spec_tree", "TreeMaskMode", "field", ("FULL_MASK", "QLEN_ONLY"),
        why="the two tree-mask layouts tree_layout writes"),
    Api(f"{_SPEC}.eagle_utils", "", "import", ("TreeMaskMode",), why="the draft stage reads the mask mode from here"),
    Api(f"{_SPEC}.eagle_utils", "organize_draft_results", "function",
        ("score_list", "token_list", "parents_list", "num_draft_token"),
        why="wrapped in the EAGLE worker's module to keep the chosen head nodes' scores (the draft stage's joint ranking)"),
    Api(_EW, "", "import", ("organize_draft_results",)),
    Api(_EW, "EagleDraftWorker.draft_forward", "call", ("organize_draft_results",)),
    Api(_EW, "EAGLEWorkerV2._build_trivial_verify_input", "function", ("batch",),
        why="the no-draft step (speculative_num_steps == 0) the load controls run"),
    Api(f"{_SPEC}.eagle_utils", "build_tree_kernel_efficient", "function",
        ("parent_list", "top_scores_index", "draft_tokens", "topk", "spec_steps", "num_verify_tokens"),
        why="the retrieve_* tree layout wrap_verify reads"),
    Api(f"{_SPEC}.eagle_utils", "eagle_sample", "function", ("verify_input", "batch", "logits_output", "grammar_mask"),
        why="wrapped (AROUND) by the lossy verifier; returns (predict, accept_lens, accept_index)"),
    Api(f"{_SPEC}.eagle_utils", "eagle_sample", "call", ("verify_tree_greedy_func",)),
    Api("sglang.kernels.ops.speculative.spec_tree", "verify_tree_greedy_func", "function",
        ("predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
         "retrieve_next_sibling", "target_predict"), why="the greedy semantics wrap_verify reproduces"),
    Api(f"{_SPEC}.eagle_worker_common", "", "import", ("eagle_sample",)),
    Api(f"{_SPEC}.eagle_worker_common", "run_eagle_verify", "call", ("eagle_sample",)),
    # -- the no-draft step on the CPU backend (one_row_verify) ---------------------------------------
    Api("sglang.srt.layers.attention.intel_amx_backend", "IntelAMXAttnBackend", "attribute",
        ("draft_decode_metadata", "extend_metadata", "req_to_token_pool"),
        why="a one-row verify runs as a decode over the verify's lengths (extend_metadata[0])"),
    Api("sglang.srt.layers.attention.intel_amx_backend", "IntelAMXAttnBackend.forward_decode", "function",
        ("q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    Api("sglang.srt.layers.attention.intel_amx_backend", "IntelAMXAttnBackend.forward_extend", "function",
        ("q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    Api("sglang.srt.layers.attention.intel_amx_backend", "IntelAMXAttnBackend._build_extend_metadata", "function",
        ("forward_batch",), why="its first item is seq_lens + draft_token_num in TARGET_VERIFY mode"),
    Api("sglang.srt.model_executor.forward_batch_info", "ForwardMode.is_target_verify", "function"),
    Api(_EW, "", "import", ("get_draft_recurrent_hidden_state_spec",),
        why="the shapes of a skipped draft-extend's stub next draft input"),
    Api(_EW, "EagleDraftWorker", "attribute", ("draft_runner",)),
    Api(f"{_SPEC}.eagle_info", "EagleDraftInput", "field", ("hidden_states",)),
    Api(f"{_SPEC}.eagle_info", "EagleDraftInput", "field",
        ("bonus_tokens", "num_tokens_per_req", "num_tokens_for_logprob_per_req"),
        why="a skipped prefill draft-extend's draft input (the first token as the next root)"),
    Api(_EW, "", "import", ("EagleDraftInput",)),
    Api("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool.available_size", "function",
        why="the live request count when requests are admitted (size minus the free rows)"),
    Api("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool", "attribute", ("size",)),
    Api("sglang.srt.model_executor.model_runner", "ModelRunner", "attribute", ("req_to_token_pool",)),
    # -- KV reservation and resolved configuration ---------------------------------------------------
    Api("sglang.srt.mem_cache.allocation_sizing", "get_alloc_len_per_decode", "function",
        why="wrapped so every decode reserves KV for the largest bank shape"),
    Api("sglang.srt.mem_cache.allocation_sizing", "get_alloc_reserve_per_decode", "call", ("get_alloc_len_per_decode",)),
    Api("sglang.srt.runtime_context", "get_context", "function"),
    Api("sglang.srt.runtime_context", "get_spec", "function"),
    Api("sglang.srt.runtime_context", "get_parallel", "function"),
    Api("sglang.srt.runtime_context", "RuntimeContext.override", "function", ("source", "fields"),
        why="sets speculative_eagle_topk in the resolved config while capturing / after swapping"),
    # -- launch flags (field names; the flag is --name-with-dashes) ----------------------------------
    Api("sglang.launch_server", why="python -m sglang.launch_server"),
    Api("sglang.srt.arg_groups.arg_utils", "_field_to_cli_name", "function", ("name",), why="field -> --flag"),
    Api("sglang.srt.arg_groups.fields.spec", "Spec", "field",
        ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
         "speculative_num_draft_tokens", "speculative_adaptive", "speculative_use_rejection_sampling",
         "enable_multi_layer_eagle")),
    Api("sglang.srt.arg_groups.fields.schedule", "Schedule", "field", ("disable_overlap_schedule", "page_size")),
    Api("sglang.srt.arg_groups.fields.model", "Model", "field", ("model_path",)),
    Api("sglang.srt.arg_groups.fields.serving", "Serving", "field", ("host", "port")),
    Api("sglang.srt.arg_groups.fields.parallel", "Parallel", "field", ("tp_size", "pp_size")),
)


# -- static check (ast over source files) ---------------------------------------------------------
