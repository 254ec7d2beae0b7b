"""Per-step costs without a model: policy decisions, verifiers, tree drafting, cache compaction.

Synthetic inputs, seeded: target logits over V = 49152 (SmolLM2's vocabulary), draft
log-probabilities over Vd = 8192 (the shipped head's draft vocabulary), trees of 8/16/32 nodes,
a 30-layer KV cache (SmolLM2-135M: 3 KV heads of 64) holding 256/1024 positions.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from adaptivespec.runtime import compact_cache
from adaptivespec.testing import registered
from adaptivespec.tree import draft_tree
from adaptivespec.types import StepRecord, StepSignals, TreeShape, VerifyResult

V, VD, HIDDEN = 49152, 8192, 576
SHAPES = {8: TreeShape(5, 2, 8), 16: TreeShape(6, 3, 16), 32: TreeShape(7, 4, 32)}
"""Tree size (nodes, root included) -> an EAGLE shape that verifies exactly that many."""

PLUGINS = {"talon": "adaptivespec_talon", "fly": "adaptivespec_fly"}


def strategy(kind: str, name: str):
    """The registered class, skipping when it comes from a plugin that is not installed."""
    if name in PLUGINS:
        pytest.importorskip(PLUGINS[name], reason=f"plugin {PLUGINS[name]} not installed")
    return registered(kind, name).cls


class FakeExpand:
    """A drafter stand-in: fixed random draft log-probabilities, no model (constant cost per row)."""

    def __init__(self, rows: int = 512, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.logp = torch.log_softmax(torch.randn(rows, VD, generator=gen) * 2, -1)
        self.hidden = torch.randn(rows, HIDDEN, generator=gen)

    def __call__(self, tokens, states, parent_slots, depth):
        b = tokens.shape[0]
        return self.logp[:b], self.hidden[:b]


def draft(shape: TreeShape, policy, fake: FakeExpand):
    return draft_tree(shape, torch.tensor(1), fake.logp[-1], fake.hidden[-1], fake, lambda ids: ids, policy)


# -- policies: one step = choose a shape, draft a tree with the policy's level rules, observe --------
@pytest.mark.parametrize("name", ["static", "dcs", "talon", "cost_aware"])
def test_policy_step(benchmark, name):
    benchmark.group = "policy step (next_shape + draft_tree rules + observe, fake drafter)"
    cls = strategy("policy", name)
    policy, fake = cls(), FakeExpand()
    gen = torch.Generator().manual_seed(1)
    p1 = torch.rand(64, generator=gen).tolist()  # draft confidences cycling through the steps
    accepted = torch.randint(0, 5, (64,), generator=gen).tolist()
    steps = itertools.cycle(range(64))
    policy.reset()

    def step():
        i = next(steps)
        shape = policy.next_shape(StepSignals(step=i, draft_top1_prob=p1[i], last_accepted=accepted[i - 1]))
        tree = draft(shape, policy, fake)
        policy.observe_tree(tree, VerifyResult(path=[0, 1] if accepted[i] else [0], tokens=[]))
        policy.observe(StepRecord(step=i, shape=shape, tree_size=tree.size, accepted=accepted[i], promoted=0,
                                  new_tokens=accepted[i] + 1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0))
        return tree

    assert benchmark(step).size >= 2


# -- verifiers on random logits ------------------------------------------------------------------
def synthetic_tree(n: int, seed: int = 0):
    """A drafted tree of ``n`` nodes and float32 target logits [n, V], about half its nodes the
    target's top-1 at their parent (so the accepted path is a few tokens deep)."""
    gen = torch.Generator().manual_seed(seed)
    tree = draft(SHAPES[n], strategy("policy", "static")(), FakeExpand(seed=seed))
    tree.tokens = torch.randint(0, V, (n,), generator=gen)
    logits = torch.randn(n, V, generator=gen)
    agree = torch.rand(n, generator=gen) < 0.5
    agree[0] = False
    for i in agree.nonzero().squeeze(1).tolist():
        logits[tree.parents[i], tree.tokens[i]] = 12.0 + torch.rand(1, generator=gen).item()
    return tree, logits


@pytest.mark.parametrize("n", [8, 16, 32])
@pytest.mark.parametrize("name", ["strict", "margin", "fly"])
def test_verifier(benchmark, name, n):
    benchmark.group = f"verifier, {n}-node tree, V={V}"
    verifier = strategy("verifier", name)()
    tree, logits = synthetic_tree(n)
    result = benchmark(verifier.verify, tree, logits)
    assert len(result.tokens) == len(result.path) >= 1


# -- tree building ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 16, 32])
def test_draft_tree(benchmark, n):
    benchmark.group = f"draft_tree (EAGLE rules, fake drafter, Vd={VD})"
    shape, fake = SHAPES[n], FakeExpand()
    policy = strategy("policy", "static")(attrs_params(shape))
    tree = benchmark(draft, shape, policy, fake)
    assert tree.size == n


def attrs_params(shape: TreeShape):
    return strategy("policy", "static").Params(nsteps=shape.nsteps, topk=shape.topk, ndt=shape.ndt)


# -- KV-cache compaction ------------------------------------------------------------------------------
LAYERS, KV_HEADS, HEAD_DIM, TREE = 30, 3, 64, 16


@pytest.mark.parametrize("positions", [256, 1024])
@pytest.mark.parametrize("path", [[0, 1, 2, 3], [0, 2, 5, 9]], ids=["chain", "branch"])
def test_compact_cache(benchmark, positions, path):
    """Keep a 4-node accepted path of a 16-node tree appended to ``positions`` cached positions."""
    from transformers import DynamicCache

    benchmark.group = f"compact_cache, {LAYERS} layers, 16-node tree"
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    for layer in range(LAYERS):
        kv = torch.randn(1, KV_HEADS, positions, HEAD_DIM, generator=gen).to(torch.bfloat16)
        cache.update(kv, kv.clone(), layer)
    tree_kv = torch.randn(1, KV_HEADS, TREE, HEAD_DIM, generator=gen).to(torch.bfloat16)
    idx = torch.tensor(path)

    def setup():  # back to `positions` cached + a fresh 16-node tree block (not timed)
        extra = cache.get_seq_length() - positions
        if extra:
            cache.crop(-extra)
        for layer in cache.layers:
            layer.update(tree_kv, tree_kv)
        return (cache, positions, path, idx, TREE), {}

    benchmark.pedantic(compact_cache, setup=setup, rounds=300, warmup_rounds=10)
    assert cache.get_seq_length() == positions + len(path)
