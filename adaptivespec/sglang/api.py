"""The pinned SGLang release and every part of its API the adaptivespec plugin relies on.

:data:`REQUIRED_API` is declarative: each :class:`Api` names a module and what must be in it (a
class, a function and its parameter names, fields, ``self.`` attributes, imports, calls). It is
checked two ways:

* :func:`check_api` -- statically, with ``ast`` over a source tree (an unpacked wheel), with no
  import: what the test suite runs on a CPU machine against the pinned wheel;
* :func:`assert_api` -- at plugin load in the server, with ``importlib``/``inspect`` on the modules
  SGLang really imported; raises :class:`SGLangAPIError` naming everything missing and the pin.

Why 0.5.23: the newest release on the package index (checked 2026-11-29) and one that has every
piece the plugin builds on: ``EAGLEWorkerV2`` (the only EAGLE/EAGLE3 worker left: the V1 worker is
gone), the ``sglang.srt.plugins`` entry-point group with ``HookRegistry`` and ``SGLANG_PLUGINS``,
and ``adaptive_runtime_state.SpecRuntimeState`` with ``build_adaptive_runtime_state`` /
``apply_runtime_state`` on the worker.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Iterable

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
         "cuda_graph_runner", "draft_extend_attn_backend", "cuda_graph_runner_for_draft_extend")),
    Api(_EW, "", "import", ("draft_tp_context", "speculative_moe_backend_context", "speculative_moe_a2a_backend_context"),
        why="the contexts SGLang captures adaptive states under"),
    Api("sglang.srt.model_executor.model_runner", "ModelRunner", "attribute", ("attn_backend", "decode_cuda_graph_runner")),
    Api("sglang.srt.managers.schedule_batch", "ScheduleBatch", "field",
        ("reqs", "forward_mode", "is_extend_in_batch", "spec_info", "sampling_info")),
    Api("sglang.srt.managers.schedule_batch", "Req", "attribute", ("rid",), why="sequence boundaries reset the policy"),
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
def module_candidates(module: str) -> tuple[str, str]:
    """Relative paths a module's source may have: ``a/b.py`` or ``a/b/__init__.py``."""
    rel = module.replace(".", "/")
    return f"{rel}.py", f"{rel}/__init__.py"


def _defs(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Class and function definitions of a block, looking inside if/try/with but not into defs."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _defs(block)
            for handler in getattr(node, "handlers", []):
                yield from _defs(handler.body)


def _find(tree: ast.AST, dotted: str) -> ast.AST | None:
    node = tree
    for part in dotted.split(".") if dotted else ():
        node = next((d for d in _defs(getattr(node, "body", [])) if d.name == part), None)
        if node is None:
            return None
    return node


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names | {x.arg for x in (a.vararg, a.kwarg) if x is not None}


def _body_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _self_attrs(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _imported(node: ast.AST, top_level: bool) -> set[str]:
    stmts = node.body if top_level else list(ast.walk(node))
    return {a.asname or a.name for s in stmts if isinstance(s, (ast.Import, ast.ImportFrom)) for a in s.names}


def _called(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def _constant(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value) if isinstance(node.value, ast.Constant) else ...
    return None


def check_node(api: Api, tree: ast.AST, node: ast.AST | None) -> str | None:
    """What is missing for ``api`` given the module's tree and the node ``api.name`` resolved to."""
    if api.kind == "constant":
        got = _constant(tree, api.name)
        return None if got == api.value else f"{api.where()}: expected constant {api.value!r}, found {got!r}"
    if node is None:
        return f"{api.where()}: not found"
    kind_ok = {
        "class": isinstance(node, ast.ClassDef),
        "field": isinstance(node, ast.ClassDef),
        "attribute": isinstance(node, ast.ClassDef),
        "function": isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)),
        "call": isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)),
    }.get(api.kind, True)
    if not kind_ok:
        return f"{api.where()}: is a {type(node).__name__}, expected a {api.kind} scope"
    have = {
        "function": _params,
        "field": _body_names,
        "attribute": _self_attrs,
        "import": lambda n: _imported(n, top_level=not api.name),
        "call": _called,
    }.get(api.kind, lambda n: set())(node)
    missing = [n for n in api.names if n not in have]
    if missing:
        what = {"function": "parameter", "field": "field", "attribute": "attribute self.", "import": "import",
                "call": "call to"}[api.kind]
        return f"{api.where()}: missing {what}{'' if what.endswith('.') else ' '}{', '.join(missing)}"
    return None


def default_root() -> Path | None:
    """The directory holding the installed ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def check_api(root: Path | None = None, required: Iterable[Api] = REQUIRED_API) -> list[str]:
    """Problems found checking ``required`` against the sources under ``root`` (the directory
    that contains ``sglang/``; default: the installed package). Empty when everything is there."""
    root = Path(root) if root is not None else default_root()
    if root is None:
        return ["sglang is not installed and no source root was given"]
    trees: dict[str, ast.Module | None] = {}
    problems = []
    for api in required:
        if api.module not in trees:
            path = next((root / c for c in module_candidates(api.module) if (root / c).is_file()), None)
            trees[api.module] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path else None
        tree = trees[api.module]
        if tree is None:
            problems.append(f"{api.module}: module not found under {root}")
            continue
        if api.kind != "module":
            problem = check_node(api, tree, _find(tree, api.name))
            if problem:
                problems.append(problem)
    return problems


def extract_sources(wheel: Path, dest: Path, required: Iterable[Api] = REQUIRED_API) -> Path:
    """Unpack from ``wheel`` the source files ``required`` names into ``dest``; returns ``dest``."""
    wanted = {c for api in required for c in module_candidates(api.module)}
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member in wanted and not (dest / member).is_file():
                zf.extract(member, dest)
    return dest


def download_command(dest: Path) -> list[str]:
    """``pip download`` of the pinned wheel alone (no dependencies) into ``dest``."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={SGLANG_VERSION}", *WHEEL_TAGS, "-d", str(dest)]


# -- load-time check (inspect over the imported modules) ------------------------------------------
def _source_tree(obj: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def _check_live(api: Api) -> str | None:
    module = importlib.import_module(api.module)
    if api.kind == "module":
        return None
    if api.kind == "constant":
        got = getattr(module, api.name, None)
        return None if got == api.value else f"{api.where()}: expected constant {api.value!r}, found {got!r}"
    obj: Any = module
    for part in api.name.split(".") if api.name else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return f"{api.where()}: not found"
    if api.kind == "function":
        if not callable(obj):
            return f"{api.where()}: not callable"
        have = set(inspect.signature(obj).parameters)
        missing = [n for n in api.names if n not in have]
        return f"{api.where()}: missing parameter {', '.join(missing)}" if missing else None
    if api.kind == "class":
        return None if inspect.isclass(obj) else f"{api.where()}: not a class"
    if api.kind == "field":
        have = set()
        for klass in inspect.getmro(obj) if inspect.isclass(obj) else ():
            have |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
        have |= set(getattr(obj, "__struct_fields__", ())) | set(getattr(obj, "__dataclass_fields__", {}))
        missing = [n for n in api.names if n not in have]
        return f"{api.where()}: missing field {', '.join(missing)}" if missing else None
    if api.kind == "import" and not api.name:
        missing = [n for n in api.names if not hasattr(module, n)]
        return f"{api.where()}: missing import {', '.join(missing)}" if missing else None
    # attribute / call / scoped import: read the live object's own source
    tree = _source_tree(obj)
    return check_node(api, tree, tree.body[0])


def installed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def assert_api(required: Iterable[Api] = REQUIRED_API) -> None:
    """Raise :class:`SGLangAPIError` unless the imported SGLang has everything ``required``."""
    required = list(required)
    if any(a.module.split(".")[0] == "sglang" for a in required) and importlib.util.find_spec("sglang") is None:
        raise SGLangAPIError(f"sglang is not installed (the plugin needs sglang=={SGLANG_VERSION})")
    problems, broken = [], set()
    for api in required:
        if api.module in broken:
            continue
        try:
            importlib.import_module(api.module)
        except Exception as exc:  # an import failing is a finding, reported once per module
            broken.add(api.module)
            problems.append(f"{api.module}: {type(exc).__name__}: {exc}")
            continue
        try:
            problem = _check_live(api)
        except Exception as exc:
            problem = f"{api.where()}: {type(exc).__name__}: {exc}"
        if problem:
            problems.append(problem)
    if problems:
        raise SGLangAPIError(
            f"adaptivespec's SGLang plugin is written against sglang=={SGLANG_VERSION}; the installed "
            f"sglang {installed_version() or '(unknown version)'} lacks: " + "; ".join(problems)
        )


# -- the EAGLE-3 draft model's config keys (what SGLang reads from a head's config.json) -----------
DRAFT_MODEL_API: tuple[Api, ...] = (
    Api("sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3", "class",
        why="the architecture a head's config.json names; its config reads are checked by check_head_config"),
    Api("sglang.srt.models.llama", "LlamaDecoderLayer", "class", why="the draft layer's base class"),
    Api("sglang.srt.models.llama", "LlamaAttention", "class"),
    Api("sglang.srt.models.llama", "LlamaMLP", "class"),
)
"""Sources read by :func:`draft_config_reads` (the draft model and the parts of Llama it builds on)."""

MODEL_SPECIFIC_READS = ("rope_parameters", "rope_theta", "head_dim", "max_position_embeddings", "eagle_config")
"""Keys SGLang reads with a default (``getattr(config, key, default)``) that is wrong for some
models (``rope_theta`` 10000, ``max_position_embeddings`` 8192, ...): a head must carry them."""

CONDITIONAL_READS = {"intermediate_size_mlp": "read only when model_type is llama4_text"}
"""Hard ``config.X`` reads that do not apply to a Llama head."""


def _config_reads(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(``config.X`` / ``self.config.X`` loads, ``getattr(config, "X", default)`` keys, keys read
    from ``rope_parameters`` / ``rope_scaling`` dicts with ``.get("X", ...)``) under ``node``."""
    def is_config(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "config") or (
            isinstance(n, ast.Attribute) and n.attr == "config" and isinstance(n.value, ast.Name) and n.value.id == "self")

    hard, soft, rope = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load) and is_config(sub.value):
            hard.add(sub.attr)
        elif isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Name) and f.id == "getattr" and len(sub.args) >= 2 and is_config(sub.args[0]) \
                    and isinstance(sub.args[1], ast.Constant):
                (soft if len(sub.args) > 2 else hard).add(sub.args[1].value)
            elif isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name) \
                    and f.value.id in ("rope_parameters", "rope_scaling") and sub.args and isinstance(sub.args[0], ast.Constant):
                rope.add(sub.args[0].value)
    return hard, soft, rope


def draft_config_reads(root: Path) -> dict[str, set[str]]:
    """Config keys SGLang's EAGLE-3 Llama draft model reads, from the sources under ``root``:
    ``required`` (attribute reads, no default), ``optional`` (``getattr`` with a default) and
    ``rope`` (keys read from the rope parameters dict)."""
    hard, soft, rope = set(), set(), set()
    for api in DRAFT_MODEL_API:
        path = next((root / c for c in module_candidates(api.module) if (root / c).is_file()), None)
        if path is None:
            raise SGLangAPIError(f"{api.module}: module not found under {root}")
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        node = tree if api.module.endswith("llama_eagle3") else _find(tree, api.name)
        if node is None:
            raise SGLangAPIError(f"{api.where()}: not found under {root}")
        h, s, r = _config_reads(node)
        hard, soft, rope = hard | h, soft | s, rope | r
    # a direct read guarded by ``getattr(config, "X", default)`` elsewhere is optional
    return {"required": hard - soft - set(CONDITIONAL_READS), "optional": soft, "rope": rope}


def check_head_config(config: dict[str, Any], root: Path, target_config: dict[str, Any] | None = None) -> list[str]:
    """Problems of a head's ``config.json`` (as a dict) for SGLang's EAGLE-3 Llama draft model.

    Every key the model reads without a default must be there; the rope settings must be there
    too (SGLang falls back to ``rope_theta`` 10000 silently) and, given ``target_config``, equal the
    target's; ``architectures`` must name ``LlamaForCausalLMEagle3`` and the dtype must be set."""
    reads = draft_config_reads(root)
    problems = [f"config.json: missing {key!r} (read by SGLang's LlamaForCausalLMEagle3)"
                for key in sorted(reads["required"]) if key not in config]
    problems += [f"config.json: missing {key!r} (SGLang's LlamaForCausalLMEagle3 falls back to a default that fits "
                 "other models)" for key in MODEL_SPECIFIC_READS if key in reads["optional"] and key not in config]
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    theta = (rope or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        problems.append("config.json: no rope_theta (in rope_parameters or top level); SGLang would use 10000")
    if rope is not None and not ({"rope_type", "type"} & set(rope)):
        problems.append("config.json: rope_parameters has no rope_type; SGLang's get_rope refuses it")
    if target_config is not None:
        t_rope = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
        t_theta = t_rope.get("rope_theta", target_config.get("rope_theta", 10000.0))
        for name, value in (("rope_parameters.rope_theta", theta), ("rope_theta", config.get("rope_theta"))):
            if value is not None and float(value) != float(t_theta):
                problems.append(f"config.json: {name} {value} differs from the target's {t_theta}")
    if "LlamaForCausalLMEagle3" not in (config.get("architectures") or []):
        problems.append(f"config.json: architectures {config.get('architectures')!r} does not name LlamaForCausalLMEagle3")
    if not (config.get("dtype") or config.get("torch_dtype")):
        problems.append("config.json: neither dtype nor torch_dtype is set; SGLang would assume float32")
    return problems
