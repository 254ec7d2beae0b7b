"""The static (CUDA-graph) path of the torch runtime gives what the plain runtime gives.

On CPU, ``enable_cuda_graphs(capture=False)`` runs the same static caches, buffers, padding, masks
and drafter proxy as the graph path, without capturing: these tests check all of that against the
plain runtime (DynamicCache). Only the capture itself needs CUDA; that test is skipped without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaptivespec.fastpath.cuda_graphs import (
    CudaGraphsUnsupportedError,
    GraphedTorchRuntime,
    StaticContextError,
    capture_report,
    cuda_graphs_unsupported_reason,
    draft_step_static,
    enable_cuda_graphs,
)
from adaptivespec.drafter import Eagle3Drafter
from adaptivespec.runtime import TorchRuntime
from adaptivespec.fastpath.forced_path import ForcedPath
from adaptivespec.strategies import TreePolicy
from adaptivespec.types import TreeShape

from shared_prompts import PROMPTS

SHAPES = (TreeShape(3, 4, 4), TreeShape(4, 3, 5), TreeShape(7, 1, 8))


class Cycle(TreePolicy):
    """Visits its shapes in turn; ``short`` keeps two nodes fewer than ndt (padded trees)."""

    name = "cycle"

    def __init__(self, shapes, short: bool = False) -> None:
        super().__init__()
        self._shapes, self.short, self.i = tuple(shapes), short, 0

    def shapes(self):
        return self._shapes

    def reset(self) -> None:
        self.i = 0

    def next_shape(self, signals):
        self.i += 1
        return self._shapes[(self.i - 1) % len(self._shapes)]

    def select_final(self, scores, shape):
        kept = super().select_final(scores, shape)
        return kept[: max(1, kept.shape[0] - 2)] if self.short else kept


@pytest.fixture
def one_thread():
    """Tiny matrices: a second thread only spins (100x slower on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    """A random 4-layer Llama (GQA) and a random EAGLE-3 head, float32 on CPU."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    target = LlamaForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    target.requires_grad_(False)
    return target, Eagle3Drafter.random_init(target, 256, seed=0)


def runtime(target, head, static: bool, shapes=SHAPES, max_context: int = 256):
    rt = TorchRuntime(target, copy.copy(head))  # a shallow copy: shared weights, own cache state
    rt.prepare(shapes)
    if static:
        enable_cuda_graphs(rt, max_context, capture=False)
    return rt


def decode(rt, prompt, policy, verifier, steps: int):
    """Prefill and ``steps`` speculative steps; per step the tree, the verify logits, the tokens."""
    out = []
    policy.reset()
    rt.prefill(prompt, max_new_tokens=64)
    for _ in range(steps):
        tree = rt.draft(policy.next_shape(None), policy)
        logits, hidden = rt.verify_forward(tree)
        result = verifier.verify(tree, logits)
        out.append((tree.tokens.tolist(), logits.clone(), result.tokens))
        rt.commit(tree, result, hidden)
    return out, rt


@pytest.mark.parametrize("older_transformers", [False, True], ids=["installed", "static-layers-without-crop"])
@pytest.mark.parametrize("short", [False, True], ids=["full-trees", "padded-trees"])
def test_static_path_matches_eager_with_compaction(tiny, one_thread, short, older_transformers, monkeypatch):
    """Every shape, accepted paths off the first branch, trees smaller than ndt: same trees,
    same logits, same tokens, and the same caches afterwards. Also where static layers have no
    ``crop`` (transformers before 5.24: a GPU machine's 5.17 showed it)."""
    if older_transformers:
        from transformers.cache_utils import StaticLayer

        if hasattr(StaticLayer, "crop"):
            monkeypatch.delattr(StaticLayer, "crop")
    prompt = list(range(3, 40))
    runs = {}
    for static in (False, True):
        policy = Cycle(SHAPES, short=short)
        runs[static] = decode(runtime(*tiny, static), prompt, policy, ForcedPath(), steps=9)
    (eager, rt_e), (stat, rt_s) = runs[False], runs[True]
    for (tree_e, logits_e, tok_e), (tree_s, logits_s, tok_s) in zip(eager, stat):
        assert tree_e == tree_s
        assert (logits_e - logits_s).abs().max() < 1e-4
        assert tok_e == tok_s
    P = rt_e.P
    assert rt_s.P == P and all(int(layer.cumulative_length) == P for layer in rt_s.cache.layers)
    for le, ls in zip(rt_e.cache.layers, rt_s.cache.layers):
        assert torch.allclose(le.keys, ls.keys[:, :, :P], atol=1e-5)
        assert torch.allclose(le.values, ls.values[:, :, :P], atol=1e-5)
    d_e, d_s = rt_e.drafter, rt_s.drafter
    assert d_e.length == d_s.length == P
    assert torch.allclose(d_e._k[:, :, :P], d_s._k[:, :, :P], atol=1e-5)
    assert torch.allclose(rt_e.root_logp, rt_s.root_logp, atol=1e-4)


def test_static_draft_step_equals_the_drafter_step(tiny, one_thread):
    _, head = tiny
    d = copy.copy(head)
    d.reset_cache(64)
    with torch.inference_mode():
        H = d.config.hidden_size
        d.step(torch.arange(5, 15), torch.randn(10, H), torch.arange(10), None)  # a committed prefix
        keys, values = torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16)
        keys[:, :, :10], values[:, :, :10] = d._k[:, :, :10], d._v[:, :, :10]
        tokens, state, positions = torch.tensor([7, 8, 9]), torch.randn(3, H), torch.full((3,), 10)
        mask = torch.zeros(1, 1, 3, 13)
        mask[0, 0, :, 10:] = torch.tensor([[0, -1e30, -1e30], [0, 0, -1e30], [-1e30, -1e30, 0]])
        wide = torch.full((1, 1, 3, 64), torch.finfo(torch.float32).min)
        wide[..., :13] = mask
        out = draft_step_static(d, tokens, state, positions, torch.arange(10, 13), keys, values, wide)
        ref = d.step(tokens, state, positions, mask)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(keys[:, :, :13], d._k[:, :, :13], atol=1e-6)


def test_bank_holds_the_static_entries_and_the_report(tiny):
    rt = runtime(*tiny, static=True)
    for shape in SHAPES:
        graphs = rt.bank.get(shape).graphs
        assert graphs["verify"].ndt == shape.ndt
        assert sorted(graphs["draft"]) == list(range(1, max(shape.topk, shape.ndt - 1) + 1))
    assert rt.bank.get(SHAPES[0]).graphs["draft"][1] is rt.bank.get(SHAPES[2]).graphs["draft"][1]  # shared by width
    rt.bank.reserve(4 * rt.bank.capacity)  # a grown bank keeps them
    assert "verify" in rt.bank.get(SHAPES[0]).graphs
    report = capture_report(rt)
    assert report["captured"] is False and report["max_context"] == 256
    assert [s["shape"] for s in report["shapes"]] == [[3, 4, 4], [4, 3, 5], [7, 1, 8]]
    assert report["target_cache_bytes"] == 2 * 4 * 2 * 256 * 16 * 4  # K and V, layers, kv heads, positions, head_dim, fp32


def test_context_overflow_is_a_clear_error(tiny):
    rt = runtime(*tiny, static=True, max_context=64)
    with pytest.raises(StaticContextError, match="max_context=64"):
        rt.prefill(list(range(50)), max_new_tokens=16)


def test_unsupported_runtimes_say_why(tiny):
    target, head = tiny
    assert "no drafter" in cuda_graphs_unsupported_reason(TorchRuntime(target, None))
    assert "prepare" in cuda_graphs_unsupported_reason(TorchRuntime(target, head))
    rt = runtime(target, head, static=False)
    if not torch.cuda.is_available():
        assert "CUDA device" in cuda_graphs_unsupported_reason(rt, capture=True)
        with pytest.raises(CudaGraphsUnsupportedError, match="CUDA device"):
            GraphedTorchRuntime(target, head).prepare(SHAPES)
    assert cuda_graphs_unsupported_reason(rt, capture=False) is None
    enable_cuda_graphs(rt, 128, capture=False)
    assert "already enabled" in cuda_graphs_unsupported_reason(rt, capture=False)


@pytest.mark.model
def test_static_path_gives_the_same_tokens_on_smollm2(smol32, random_head_dir, greedy_reference, one_thread):
    """The embedded SmolLM2 in float32, strict verification: the static path's output is the
    plain runtime's, and both are transformers' greedy output."""
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    overrides = [f"model.drafter={random_head_dir}", "runtime.dtype=float32", "policy.name=dcs", "policy.levels=2"]
    plain, static = Engine(load_config(None, overrides)), Engine(load_config(None, overrides))
    static.runtime.drafter = copy.copy(static.runtime.drafter)  # the engines share the loaded head
    assert set(static.runtime.bank.shapes) == {TreeShape(3, 4, 4), TreeShape(7, 1, 8)}
    enable_cuda_graphs(static.runtime, 256, capture=False)
    for engine in (plain, static):
        engine.policy = Cycle(engine.policy.shapes())
    for text in PROMPTS[:2]:
        ids, ref = greedy_reference(text, 16)
        a = plain.generate_ids(ids, max_new_tokens=16)
        b = static.generate_ids(ids, max_new_tokens=16)
        assert b.token_ids == a.token_ids == ref, text
        assert [r.shape for r in b.records] == [r.shape for r in a.records]
        assert {r.shape for r in b.records} == set(static.runtime.bank.shapes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device; none here "
                    "(the static path it replays is checked above on CPU; scripts/gpu_check.py checks it on a GPU)")
def test_graph_replay_equals_the_static_path_on_cuda(tiny):
    target, head = (m.to("cuda") for m in copy.deepcopy(tiny))
    prompt = list(range(3, 40))
    runs = {}
    for capture in (False, True):
        rt = TorchRuntime(target, copy.copy(head))
        rt.prepare(SHAPES)
        enable_cuda_graphs(rt, 256, capture=capture)
        runs[capture] = decode(rt, prompt, Cycle(SHAPES), ForcedPath(), steps=9)[0]
    assert capture_report(rt)["captured"] is True
    for (tree_a, logits_a, tok_a), (tree_b, logits_b, tok_b) in zip(runs[False], runs[True]):
        assert tree_a == tree_b and tok_a == tok_b
        assert (logits_a - logits_b).abs().max() < 1e-4


def test_static_path_samples_like_eager(tiny, one_thread):
    """At temperature > 0 the static path draws the same tokens as the eager one (same seed):
    prefill's first token through the wrapped eager prefill, then strict's tree sampling."""
    from adaptivespec.sampling import Sampler
    from adaptivespec.verifiers.strict import StrictVerifier

    prompt = list(range(3, 40))
    runs = {}
    for static in (False, True):
        rt = runtime(*tiny, static)
        verifier = StrictVerifier()
        rt.sampler = verifier.sampler = Sampler(1.0, top_p=0.95, seed=3)
        runs[static] = [t for _, _, t in decode(rt, prompt, Cycle(SHAPES), verifier, steps=6)[0]], int(rt.root)
    assert runs[False] == runs[True]


def cost_aware_factory(tmp_path, per_verified_token: float):
    """``make()`` -> a fresh cost_aware policy (buckets 3/5/9, depth 4, topk 3) with a hand-set cost
    model (``per_verified_token`` ms per verified token) and a depth-independent prior."""
    from adaptivespec.params import structure
    from adaptivespec.costmodel import CostModel, save_prior
    from adaptivespec.policies.cost_aware import CostAwareParams, CostAwarePolicy

    CostModel(fixed=20.0, per_draft_level=0.5, per_verified_token=per_verified_token, context_ref=0).save(tmp_path / "c.json")
    prior = torch.linspace(0.95, 0.05, 12).repeat(6, 1)
    save_prior(tmp_path / "p.json", prior, torch.ones_like(prior), shrink=0)

    def make():
        return CostAwarePolicy(structure(CostAwareParams, {
            "max_depth": 4, "topk": 3, "buckets": [3, 5, 9], "profile": str(tmp_path / "c.json"),
            "prior": str(tmp_path / "p.json"), "prior_weight": 1.0}, "test", "policy"))

    return make


def test_static_path_runs_the_cost_aware_verify_buckets(tiny, one_thread, tmp_path):
    """A variable verify budget on the static path: each tree is verified by its bucket's static
    entry (padded to the bucket's ndt), with the same trees, logits and tokens as eager."""
    make = cost_aware_factory(tmp_path, per_verified_token=4.0)
    prompt = list(range(3, 40))
    runs = {}
    for static in (False, True):
        policy = make()
        runs[static] = decode(runtime(*tiny, static, shapes=policy.shapes()), prompt, policy, ForcedPath(), steps=8)
    (eager, _), (stat, rt_s) = runs[False], runs[True]
    for (tree_e, logits_e, tok_e), (tree_s, logits_s, tok_s) in zip(eager, stat):
        assert tree_e == tree_s and tok_e == tok_s
        assert (logits_e - logits_s).abs().max() < 1e-4
    sizes = {len(t) for t, _, _ in stat}
    assert sizes <= set(range(2, 10))
    assert any(n < policy.verify_shape(policy.shape, n).ndt for n in sizes)  # a tree padded to its bucket
