"""The pytest kit for plugin authors (``adaptivespec.testing``): each fixture does what it says."""

from __future__ import annotations

import math

import pytest
import torch

from adaptivespec.policies.static import StaticParams, StaticPolicy
from adaptivespec.strategies import TreePolicy
from adaptivespec.testing import LOSSLESS_PROMPTS, SignalStream, draft_with_fake_drafter, registered, tree_with_logits
from adaptivespec.types import StepRecord, TreeShape
from adaptivespec.verifiers.strict import StrictVerifier


# -- make_tree_with_logits / tiny_tree -------------------------------------------------------------
def test_kit_is_loaded_through_the_pytest11_entry_point(pytestconfig):
    import adaptivespec.testing

    assert pytestconfig.pluginmanager.get_plugin("adaptivespec") is adaptivespec.testing
    assert "model:" in "\n".join(pytestconfig.getini("markers"))


def test_chosen_top1_and_probability_per_node(make_tree_with_logits):
    tree, z = make_tree_with_logits([9, 1, 2, 3], [-1, 0, 1, 2], target_top1=[1, 2, 7, None], top1_prob={1: 0.6}, vocab=12)
    assert tree.size == 4 and tree.parents.tolist() == [-1, 0, 1, 2] and tree.depth.tolist() == [0, 1, 2, 3]
    assert z.shape == (4, 12) and z.dtype == torch.float32
    assert z.argmax(-1).tolist() == [1, 2, 7, 11]  # node 3 has no top-1: the filler token V - 1
    p = torch.softmax(z.double(), -1)
    assert p[0, 1].item() == pytest.approx(0.9) and p[1, 2].item() == pytest.approx(0.6)
    assert p[1, 5].item() == pytest.approx(0.4 / 11)  # the rest spread evenly
    assert StrictVerifier().verify(tree, z).tokens == [1, 2, 7]


def test_explicit_probability_rows(make_tree_with_logits):
    tree, z = make_tree_with_logits([9, 1], [-1, 0], probs={0: {4: 0.5, 1: 0.3, 2: 0.1}}, vocab=20)
    p = torch.softmax(z.double(), -1)
    assert [p[0, t].item() for t in (4, 1, 2, 7)] == pytest.approx([0.5, 0.3, 0.1, 0.1 / 17])
    assert torch.allclose(z.exp().sum(-1), torch.ones(2), atol=1e-5)  # rows are log-probabilities


def test_impossible_rows_are_refused():
    with pytest.raises(ValueError, match="would not be the target's top-1"):
        tree_with_logits([9, 1], [-1, 0], target_top1=[1, None], top1_prob=0.004, vocab=200)
    with pytest.raises(ValueError, match="sum to at most 1"):
        tree_with_logits([9, 1], [-1, 0], probs={0: {1: 0.7, 2: 0.6}})
    with pytest.raises(ValueError, match="vocab: expected more than"):
        tree_with_logits([9, 1], [-1, 0], vocab=5)
    with pytest.raises(ValueError, match="one entry per node"):
        tree_with_logits([9, 1], [-1, 0], target_top1=[1])


def test_tiny_tree_matches_strict_verification(tiny_tree):
    res = StrictVerifier().verify(tiny_tree.tree, tiny_tree.logits)
    assert res.path == tiny_tree.strict_path == [0, 2, 4]
    assert res.tokens == tiny_tree.strict_tokens == [2, 4, 8]


# -- step_signals ------------------------------------------------------------------------------------
class Recorder(TreePolicy):
    """Picks the shape from the draft probability; remembers what it was given."""

    name = "recorder"
    SHAPES = (TreeShape(3, 4, 4), TreeShape(7, 1, 8))

    def __init__(self):
        super().__init__()
        self.seen, self.observed, self.resets = [], [], 0

    def shapes(self):
        return self.SHAPES

    def reset(self):
        self.resets += 1

    def next_shape(self, signals):
        self.seen.append(signals)
        return self.SHAPES[signals.draft_top1_prob > 0.5]

    def observe(self, record):
        self.observed.append(record)

    def state(self):
        return {"n": len(self.seen)}


def test_stream_drives_a_policy_like_the_decode_loop(step_signals):
    pol = Recorder()
    stream = step_signals([0, 5, 7, 2], draft_probs=[0.2, 0.9, 0.9, 0.1])
    shapes = stream.drive(pol)
    assert shapes == [Recorder.SHAPES[0], Recorder.SHAPES[1], Recorder.SHAPES[1], Recorder.SHAPES[0]]
    assert pol.resets == 1
    assert [s.step for s in pol.seen] == [0, 1, 2, 3]
    assert [s.draft_top1_prob for s in pol.seen] == [0.2, 0.9, 0.9, 0.1]
    # accepted lengths are clamped to the chosen depth; last_accepted is what was recorded
    assert [r.accepted for r in pol.observed] == [0, 5, 7, 2]
    assert [s.last_accepted for s in pol.seen] == [-1, 0, 5, 7]
    assert all(isinstance(r, StepRecord) and r.new_tokens == r.accepted + 1 for r in pol.observed)
    assert [r.policy_state for r in stream.records] == [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}]
    assert [r.tree_size for r in stream.records] == [4, 8, 8, 4]


def test_stream_clamps_accepted_to_the_shape_and_iterates(step_signals):
    stream = step_signals([9, 1], draft_probs=0.3)
    assert Recorder().shapes()[0].nsteps == 3
    stream.drive(Recorder())
    assert [r.accepted for r in stream.records] == [3, 1]
    steps = list(stream)
    assert [(s.signals.step, s.signals.last_accepted, s.accepted) for s in steps] == [(0, -1, 9), (1, 9, 1)]
    assert steps[0].record(None).tree_size == 1
    with pytest.raises(ValueError, match="one per step"):
        SignalStream([1, 2], draft_probs=[0.5])


# -- draft_with_fake_drafter, registered -------------------------------------------------------------------
def test_fake_drafter_runs_the_policys_level_rules():
    pol = StaticPolicy(StaticParams(nsteps=4, topk=3, ndt=9))
    tree = draft_with_fake_drafter(pol, seed=3)
    again = draft_with_fake_drafter(pol, seed=3)
    assert tree.size == 9 and int(tree.depth.max()) <= 4
    assert torch.equal(tree.tokens, again.tokens) and torch.equal(tree.parents, again.parents)
    assert not torch.equal(draft_with_fake_drafter(pol, seed=4).tokens, tree.tokens)


def test_registered_finds_builtins_and_fails_with_the_names():
    entry = registered("verifier", "strict")
    assert entry.provider == "adaptivespec" and entry.lossless
    with pytest.raises(pytest.fail.Exception, match="registered verifiers: .*strict"):
        registered("verifier", "no-such-verifier")
    with pytest.raises(pytest.fail.Exception, match="unknown strategy kind"):
        registered("sampler", "strict")


# -- assert_lossless (loads the model) ------------------------------------------------------------------
@pytest.mark.model
def test_assert_lossless_passes_strict_and_catches_a_lossy_verifier(assert_lossless):
    assert len(LOSSLESS_PROMPTS) == 5
    prompt = [LOSSLESS_PROMPTS[0]]
    results = assert_lossless(["verifier.name=strict"], prompt, max_new_tokens=16, oracle=True)
    steps = results[0].records
    assert len(results) == 1 and 0 < len(results[0].token_ids) <= 16
    assert sum(r.accepted for r in steps) >= len(steps)  # the oracle head is mostly accepted
    with pytest.raises(pytest.fail.Exception, match="not lossless"):
        assert_lossless(["verifier.name=margin", f"verifier.kappa={math.exp(-30):.3e}"], prompt, max_new_tokens=16)
