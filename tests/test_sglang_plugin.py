"""The SGLang plugin's logic on CPU, against small stand-ins for the SGLang pieces it touches.

The stand-ins behave as SGLang 0.5.23's do where the plugin depends on it: ``apply_runtime_state``
skips a state with the active step count, ``_rebuild_topk1_chain_buffers`` asserts
``ndt == nsteps + 1`` at topk 1, ``build_adaptive_runtime_state`` sets and restores
(nsteps, ndt) around the capture, the draft input carries ``topk_p`` / ``topk_index``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from adaptivespec.errors import AdaptiveSpecError, ShapeNotInBankError
from adaptivespec.sglang import CONFIG_ENV, plugin
from adaptivespec.sglang.api import SGLANG_VERSION, SGLangAPIError
from adaptivespec.sglang.controller import TripletController
from adaptivespec.sglang.platform import unsupported_reason
from adaptivespec.sglang.state_bank import KV_RESERVE
from adaptivespec.sglang.verification import VERIFYING, retrieve_from_parents
from adaptivespec.strategies import TreePolicy, Verifier
from adaptivespec.types import TreeShape, VerifyResult

A, A2, B, C = TreeShape(3, 4, 4), TreeShape(3, 2, 5), TreeShape(5, 1, 6), TreeShape(4, 2, 9)
TOP = TreeShape(5, 4, 9)  # their element-wise max; ndt != nsteps + 1


class Policy(TreePolicy):
    name = "four"

    def __init__(self, params=None):
        super().__init__(params)
        self.records = []

    def shapes(self):
        return (A, A2, B, C)

    def next_shape(self, signals):
        p = signals.draft_top1_prob
        return B if p >= 0.8 else C if p >= 0.6 else A2 if p >= 0.3 else A

    def observe(self, record):
        self.records.append(record)


# -- stand-ins for SGLang ---------------------------------------------------------------------------
@dataclasses.dataclass
class SpecRuntimeState:
    speculative_num_steps: int
    speculative_num_draft_tokens: int
    draft_attn_backend: object
    cuda_graph_runner: object
    target_attn_backend: object
    target_graph_runner: object
    draft_extend_attn_backend: object
    cuda_graph_runner_for_draft_extend: object


class Context:
    def __init__(self, spec):
        self.spec = spec
        self.log = []

    def override(self, source, **fields):
        self.log.append((source, fields))
        for k, v in fields.items():
            setattr(self.spec, k, v)


def make_sglang(monkeypatch, start: TreeShape):
    spec = SimpleNamespace(speculative_eagle_topk=start.topk, speculative_num_steps=start.nsteps,
                           speculative_num_draft_tokens=start.ndt, speculative_adaptive=False,
                           speculative_use_rejection_sampling=False)
    ctx = Context(spec)
    parallel = SimpleNamespace(tp_size=1, pp_size=1)
    rc = types.ModuleType("sglang.srt.runtime_context")
    rc.get_context, rc.get_spec, rc.get_parallel = (lambda: ctx), (lambda: spec), (lambda: parallel)
    ars = types.ModuleType("sglang.srt.speculative.adaptive_runtime_state")
    ars.SpecRuntimeState = SpecRuntimeState
    eu = types.ModuleType("sglang.srt.speculative.eagle_utils")
    eu.TreeMaskMode = enum.IntEnum("TreeMaskMode", "FULL_MASK QLEN_ONLY QLEN_ONLY_BITPACKING")
    for name, mod in {"sglang.srt.runtime_context": rc, "sglang.srt.speculative.adaptive_runtime_state": ars,
                      "sglang.srt.speculative.eagle_utils": eu}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    ew = types.ModuleType("sglang.srt.speculative.eagle_worker_v2")

    class EagleDraftWorker:
        def __init__(self):
            self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens = (
                spec.speculative_eagle_topk, spec.speculative_num_steps, spec.speculative_num_draft_tokens)
            self.parallel_layout = "layout"
            self.draft_attn_backend = self.cuda_graph_runner = "start-draft"
            self.draft_extend_attn_backend = self.cuda_graph_runner_for_draft_extend = "start-extend"
            self.extend_topks = []
            self._rebuild_topk1_chain_buffers()

        def _rebuild_topk1_chain_buffers(self):
            if self.topk == 1:
                assert self.speculative_num_draft_tokens == self.speculative_num_steps + 1

        def _draft_extend_for_decode(self, batch, batch_result):
            self.extend_topks.append(self.topk)

        def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids):
            self.extend_topks.append(self.topk)

    class EAGLEWorkerV2:
        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens = (
                spec.speculative_eagle_topk, spec.speculative_num_steps, spec.speculative_num_draft_tokens)
            self.page_size = 1
            self._draft_worker = ew.EagleDraftWorker()  # module lookup: sees the replacement
            self._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend="start-target",
                                                                               decode_cuda_graph_runner="start-graph"))
            self.drafted, self.applied, self.completed = [], [], []

        def init_cuda_graphs(self):
            pass

        def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
            dw = self._draft_worker
            saved = (self.speculative_num_steps, self.speculative_num_draft_tokens)
            self.speculative_num_steps = dw.speculative_num_steps = speculative_num_steps
            self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = speculative_num_draft_tokens
            dw._rebuild_topk1_chain_buffers()
            key = (speculative_num_steps, spec.speculative_eagle_topk, dw.topk, speculative_num_draft_tokens)
            state = SpecRuntimeState(speculative_num_steps, speculative_num_draft_tokens, key, key, key, key, key, key)
            self.speculative_num_steps, self.speculative_num_draft_tokens = saved
            dw.speculative_num_steps, dw.speculative_num_draft_tokens = saved
            dw._rebuild_topk1_chain_buffers()
            return state

        def apply_runtime_state(self, state):
            if self.speculative_num_steps == state.speculative_num_steps:
                return
            dw = self._draft_worker
            self.speculative_num_steps = dw.speculative_num_steps = state.speculative_num_steps
            self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = state.speculative_num_draft_tokens
            dw._rebuild_topk1_chain_buffers()
            self.applied.append(state.draft_attn_backend)

        def forward_batch_generation(self, batch, **kwargs):
            self.drafted.append((self.topk, tuple(batch.spec_info.topk_p.shape), self.speculative_num_steps,
                                 self.speculative_num_draft_tokens))
            self._draft_worker._draft_extend_for_decode(batch, None)
            return "result"

        def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
            return VERIFYING.get()

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
            self.completed.append(list(num_correct_drafts_per_req))

    ew.EagleDraftWorker, ew.EAGLEWorkerV2 = EagleDraftWorker, EAGLEWorkerV2
    ew.draft_tp_context = ew.speculative_moe_backend_context = ew.speculative_moe_a2a_backend_context = (
        lambda *a: contextlib.nullcontext())
    return ew, spec, ctx


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy: static\nverifier: strict\n")
    return str(path)


def load_workers(monkeypatch, ew):
    """adaptivespec.sglang.workers imported afresh over the stand-ins (its classes subclass ``ew``'s)."""
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.eagle_worker_v2", ew)
    for name in ("adaptivespec.sglang.workers", "adaptivespec.sglang.draft_worker"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    workers = importlib.import_module("adaptivespec.sglang.workers")
    for name in ("adaptivespec.sglang.workers", "adaptivespec.sglang.draft_worker"):
        monkeypatch.delitem(sys.modules, name)  # the next test imports its own
    return workers


def make_worker(monkeypatch, config_path, start=TOP, verifier=None):
    ew, spec, ctx = make_sglang(monkeypatch, start)
    workers = load_workers(monkeypatch, ew)
    monkeypatch.setenv(CONFIG_ENV, config_path)
    monkeypatch.setattr(workers, "build_strategies", lambda config, host=None: (Policy(), verifier))
    monkeypatch.setitem(KV_RESERVE, "len", 0)
    ew.EagleDraftWorker = workers.AdaptiveSpecDraftWorker  # what HookRegistry's REPLACE does
    return workers.AdaptiveSpecWorker(None, 0, 0, None), spec, ctx


def decode_batch(top1: float, k: int = 4, rid: str = "r0"):
    topk_p = torch.tensor([[top1] + [(1 - top1) / k] * (k - 1)])
    spec_info = SimpleNamespace(topk_p=topk_p, topk_index=torch.arange(k).view(1, k))
    mode = SimpleNamespace(is_extend=lambda: False)
    return SimpleNamespace(spec_info=spec_info, forward_mode=mode, is_extend_in_batch=False, reqs=[SimpleNamespace(rid=rid)])


def test_worker_captures_every_shape_with_its_topk(monkeypatch, config_path):
    worker, spec, ctx = make_worker(monkeypatch, config_path)
    assert worker._draft_worker.adaptivespec_topk == 4 and KV_RESERVE["len"] == 12
    worker.init_cuda_graphs()
    bank = worker.adaptivespec_bank
    assert bank.keys() == (A2, A, C, B)
    for shape in bank.keys():  # captured with the shape's topk in the worker and the resolved config
        assert bank.get(shape).draft_attn_backend == (shape.nsteps, shape.topk, shape.topk, shape.ndt)
    assert (worker.topk, worker._draft_worker.topk, spec.speculative_eagle_topk) == (4, 4, 4)
    assert (worker.speculative_num_steps, worker.speculative_num_draft_tokens) == (5, 9)


def test_each_decode_step_runs_at_the_policy_shape(monkeypatch, config_path):
    worker, spec, ctx = make_worker(monkeypatch, config_path)
    worker.init_cuda_graphs()
    for top1 in (0.9, 0.1, 0.4, 0.7, 0.9):
        assert worker.forward_batch_generation(decode_batch(top1)) == "result"
        worker.on_verify_complete_cpu([2])
    # (topk, draft input width, nsteps, ndt) seen by SGLang's forward: B, A, A2 (same depth as A), C, B
    assert worker.drafted == [(1, (1, 1), 5, 6), (4, (1, 4), 3, 4), (2, (1, 2), 3, 5), (2, (1, 2), 4, 9), (1, (1, 1), 5, 6)]
    assert spec.speculative_eagle_topk == 1 and worker.adaptivespec_shape == B
    assert worker._draft_worker.extend_topks == [4] * 5  # draft-extend always hands over the widest level
    records = worker.adaptivespec.policy.records
    assert [r.shape for r in records] == [B, A, A2, C, B] and worker.completed == [[2]] * 5


def test_prefill_batches_leave_the_shape_alone(monkeypatch, config_path):
    worker, spec, ctx = make_worker(monkeypatch, config_path)
    worker.init_cuda_graphs()
    batch = decode_batch(0.9)
    batch.forward_mode = SimpleNamespace(is_extend=lambda: True)
    worker.forward_batch_generation(batch)
    assert worker.adaptivespec_shape == TOP and worker.adaptivespec.policy.records == []


def test_missing_state_and_wrong_start_shape_are_loud(monkeypatch, config_path):
    worker, spec, ctx = make_worker(monkeypatch, config_path)
    with pytest.raises(ShapeNotInBankError, match=r"captured shapes: \(none\); declared but not built"):
        worker.forward_batch_generation(decode_batch(0.9))
    with pytest.raises(AdaptiveSpecError, match=r"started at \(3,4,4\).*--speculative-num-steps 5 --speculative-eagle-topk 4"):
        make_worker(monkeypatch, config_path, start=A)


def test_verify_marks_the_worker_only_for_a_non_strict_verifier(monkeypatch, config_path):
    worker, *_ = make_worker(monkeypatch, config_path)
    assert worker.verify(None) is None
    lossy, *_ = make_worker(monkeypatch, config_path, verifier=FirstChild())
    assert lossy.verify(None) is lossy and VERIFYING.get() is None


def test_worker_reads_the_config_path_as_register_does(monkeypatch, config_path):
    """register() strips ADAPTIVESPEC_CONFIG; the worker in the same process reads the same file."""
    ew, *_ = make_sglang(monkeypatch, TOP)
    workers = load_workers(monkeypatch, ew)
    seen = []
    monkeypatch.setattr(workers, "load_config", lambda path: seen.append(path))
    monkeypatch.setattr(workers, "build_strategies", lambda config, host=None: (Policy(), None))
    monkeypatch.setenv(CONFIG_ENV, f" {config_path}\n")
    ew.EagleDraftWorker = workers.AdaptiveSpecDraftWorker
    workers.AdaptiveSpecWorker(None, 0, 0, None)
    assert seen == [config_path]


def test_unsupported_settings():
    ok = dict(adaptive=False, rejection_sampling=False, tp_size=1, pp_size=1)
    assert unsupported_reason(**ok) is None
    assert "--speculative-adaptive" in unsupported_reason(**{**ok, "adaptive": True})
    assert "rejection" in unsupported_reason(**{**ok, "rejection_sampling": True})
    assert "tp_size=2" in unsupported_reason(**{**ok, "tp_size": 2})


# -- the eagle_sample and KV hooks ---------------------------------------------------------------------
class FirstChild(Verifier):
    name = "first-child"
    lossless = False

    def verify(self, tree, logits):
        child = int((tree.parents == 0).nonzero()[0])
        return VerifyResult(path=[0, child], tokens=[int(tree.tokens[child]), int(logits[child].argmax())], promoted=1)


def eagle_sample(verify_input, batch, logits_output, grammar_mask=None, uno_target_max_top_k=None, *,
                 watermark_state=None, watermark_full_mask=True):
    logits_output.next_token_logits[:, 3] += 100.0  # a penalty applied in place, as SGLang's are
    return "sglang", "greedy", "result"


def sample_inputs(greedy=True, idle=False):
    parents = torch.tensor([[-1, 0, 0, 1]])
    index, next_token, next_sibling = retrieve_from_parents(parents)
    verify_input = SimpleNamespace(draft_token=torch.tensor([7, 11, 12, 13]), draft_token_num=4, spec_steps=2, topk=2,
                                   retrieve_index=index, retrieve_next_token=next_token, retrieve_next_sibling=next_sibling)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: idle),
                            sampling_info=SimpleNamespace(is_all_greedy=greedy))
    return verify_input, batch, SimpleNamespace(next_token_logits=torch.zeros(4, 20))


def test_sample_hook_passes_through_outside_our_verify():
    verify_input, batch, out = sample_inputs()
    assert plugin._eagle_sample_around(eagle_sample, verify_input, batch, out) == ("sglang", "greedy", "result")


def test_sample_hook_runs_the_adaptivespec_verifier_on_penalised_logits():
    controller = TripletController(Policy())
    controller.begin_step(torch.tensor([[0.1, 0.1, 0.1, 0.1]]))
    worker = SimpleNamespace(adaptivespec_verifier=FirstChild(), adaptivespec=controller)
    token = VERIFYING.set(worker)
    try:
        verify_input, batch, out = sample_inputs()
        predict, accept_lens, accept_index = plugin._eagle_sample_around(eagle_sample, verify_input, batch, logits_output=out)
        assert predict.tolist() == [11, 3, 0, 0]  # node 1's bonus is the penalised argmax, token 3
        assert accept_lens.tolist() == [2] and accept_index.tolist() == [[0, 1, -1]]
        assert controller.observe([1]).promoted == 1
        for kwargs in (dict(greedy=False), dict(idle=True)):  # SGLang's own result
            assert plugin._eagle_sample_around(eagle_sample, *sample_inputs(**kwargs))[0] == "sglang"
    finally:
        VERIFYING.reset(token)


def test_kv_hook_reserves_for_the_largest_shape(monkeypatch):
    monkeypatch.setitem(KV_RESERVE, "len", 12)
    assert plugin._kv_alloc_len_around(lambda: 8) == 12 and plugin._kv_alloc_len_around(lambda: 20) == 20


# -- the entry point -------------------------------------------------------------------------------------
def test_entry_point_is_inactive_without_a_config(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    before = set(sys.modules)
    assert plugin.register() is None
    assert not any(m == "sglang" or m.startswith("sglang.") for m in set(sys.modules) - before)


def test_entry_point_fails_loudly_without_the_pinned_api(monkeypatch, config_path):
    if any(m == "sglang" for m in sys.modules):
        pytest.skip("a real sglang is imported in this process")
    from adaptivespec.sglang import api_check as api

    real = api.importlib.util.find_spec  # an installed sglang (scripts/install_sglang_cpu.sh) is hidden
    monkeypatch.setattr(api.importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    monkeypatch.setenv(CONFIG_ENV, config_path)
    with pytest.raises(SGLangAPIError, match=rf"sglang is not installed \(the plugin needs sglang=={SGLANG_VERSION}\)"):
        plugin.register()


class HookRegistry:
    hooks: list = []

    @classmethod
    def register(cls, target, hook, hook_type=None):
        cls.hooks.append((target, hook, hook_type))


def fake_hook_modules(monkeypatch, ew):
    HookRegistry.hooks = []
    hr = types.ModuleType("sglang.srt.plugins.hook_registry")
    hr.HookRegistry, hr.HookType = HookRegistry, SimpleNamespace(REPLACE="replace", AROUND="around")
    spec_pkg = types.ModuleType("sglang.srt.speculative")
    spec_pkg.eagle_worker_v2, spec_pkg.eagle_worker_common = ew, types.ModuleType("common")
    for name, mod in {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
                      "sglang.srt.plugins": types.ModuleType("sglang.srt.plugins"),
                      "sglang.srt.plugins.hook_registry": hr, "sglang.srt.speculative": spec_pkg,
                      "sglang.srt.speculative.eagle_worker_v2": ew}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("adaptivespec.sglang.workers", "adaptivespec.sglang.draft_worker"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # imported over these


def test_entry_point_registers_the_worker_and_the_two_wrappers(monkeypatch, config_path):
    ew, *_ = make_sglang(monkeypatch, TOP)
    fake_hook_modules(monkeypatch, ew)
    monkeypatch.setattr(plugin, "assert_api", lambda: None)
    monkeypatch.setenv(CONFIG_ENV, config_path)
    plugin.register()
    got = {target: (hook, kind) for target, hook, kind in HookRegistry.hooks}
    assert set(got) == {plugin.WORKER_TARGET, plugin.DRAFT_TARGET, plugin.SAMPLE_TARGET, plugin.KV_TARGET,
                        plugin.VALIDATE_TARGET}
    assert issubclass(got[plugin.WORKER_TARGET][0], ew.EAGLEWorkerV2) and got[plugin.WORKER_TARGET][1] == "replace"
    assert issubclass(got[plugin.DRAFT_TARGET][0], ew.EagleDraftWorker)
    assert got[plugin.SAMPLE_TARGET] == (plugin._eagle_sample_around, "around")
    assert got[plugin.KV_TARGET] == (plugin._kv_alloc_len_around, "around")
    assert got[plugin.VALIDATE_TARGET] == (plugin._validate_request_around, "around")


def test_out_of_vocabulary_prompt_ids_are_refused_before_the_scheduler():
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    calls = []

    def original(self, obj, input_ids):
        calls.append(input_ids)

    plugin._validate_request_around(original, manager, "obj", [1, 99])
    assert calls == [[1, 99]]
    for bad in ([1, 100], [-1], [3, "x"]):
        with pytest.raises(ValueError, match="out-of-vocabulary token id .*valid range is \\[0, 100\\)"):
            plugin._validate_request_around(original, manager, "obj", bad)
    assert calls == [[1, 99]]


def test_failed_load_makes_the_eagle_worker_refuse_to_start(monkeypatch, config_path):
    """SGLang's load_plugins only logs a plugin's exception: the worker must not run as plain EAGLE-3."""
    ew, *_ = make_sglang(monkeypatch, TOP)
    fake_hook_modules(monkeypatch, ew)

    def broken():
        raise SGLangAPIError("no EAGLEWorkerV2.apply_runtime_state")

    monkeypatch.setattr(plugin, "assert_api", broken)
    monkeypatch.setenv(CONFIG_ENV, config_path)
    with pytest.raises(SGLangAPIError):
        plugin.register()
    (target, refused, kind), = HookRegistry.hooks
    assert target == plugin.WORKER_TARGET and kind == "replace"
    with pytest.raises(AdaptiveSpecError, match="failed to load .*no EAGLEWorkerV2.apply_runtime_state"):
        refused(None, 0, 0, None)
