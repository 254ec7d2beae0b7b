"""The proposal stage on hand-built cases (no model): signals, the budget, skip_draft, accounting.

A fake runtime stands in for the head (``draft`` returns a fixed tree) and scripted sources return
fixed tries; the fused trees themselves are tested in test_fusion.py.
"""

from __future__ import annotations

import math

import torch

from adaptivespec.fusion import HEAD
from adaptivespec.proposal import Proposer
from adaptivespec.strategies import CandidateSource, TreePolicy
from adaptivespec.tree import make_tree
from adaptivespec.types import CandidateTrie, TreeShape, VerifyResult

from test_fusion import paths_of, trie

SHAPE = TreeShape(3, 2, 4)
ROOT = 100


class Runtime:
    """The parts of a runtime the proposal stage touches; ``drafter=None``: no head."""

    def __init__(self, drafter=True) -> None:
        self.drafter = object() if drafter else None
        self.root, self.device, self.drafted = torch.tensor(ROOT), "cpu", 0

    def draft_root_stats(self) -> tuple[float, float, float]:
        return 0.7, 1.25, 0.9

    def draft(self, shape, rules):  # root -> 1 (0.6) -> 2 (0.3); root -> 3 (0.2)
        self.drafted += 1
        return make_tree([ROOT, 1, 3, 2], [-1, 0, 0, 1], shape, torch.tensor([0.0, *map(math.log, (0.6, 0.2, 0.3))]))


class Scripted(CandidateSource):
    """Proposes ``tries`` in turn; records what the loop told it."""

    def __init__(self, name, tries, extra=0, skip=False) -> None:
        super().__init__()
        self.name, self.tries, self.extra, self.skip = name, list(tries), extra, skip
        self.seen, self.observed = [], []

    def reset(self, prompt_ids):
        self.seen = list(prompt_ids)

    def extend(self, tokens):
        self.seen += tokens

    def propose(self):
        return self.tries.pop(0)

    def observe(self, t, tokens):
        self.observed.append((t, tokens))

    def extra_slots(self):
        return self.extra

    def skip_draft(self, t):
        return self.skip


class Static(TreePolicy):
    def shapes(self):
        return (SHAPE,)


def proposer(sources, drafter=True):
    p = Proposer(Runtime(drafter), Static(), sources)
    p.reset([7, 8])
    return p


def test_signals_read_the_head_or_without_one_the_best_scored_child_of_the_root():
    a, b = trie({(5,): 0.3, (5, 6): 0.25}), trie({(9,): 0.6})
    assert proposer([Scripted("a", [a]), Scripted("b", [b])]).signals(4, 2).draft_top1_prob == 0.7
    sig = proposer([Scripted("a", [a]), Scripted("b", [b])], drafter=False).signals(4, 2)
    assert (sig.step, sig.last_accepted, sig.draft_top1_prob) == (4, 2, 0.6)
    assert proposer([Scripted("a", [None])], drafter=False).signals(0, -1).draft_top1_prob == 0.0


def test_signals_carry_the_root_entropy_and_what_the_sources_propose():
    a, b = trie({(5,): 0.3, (5, 6): 0.25}), trie({(9,): 0.6})
    sig = proposer([Scripted("a", [a]), Scripted("b", [b])]).signals(4, 2)
    assert (sig.draft_entropy, sig.draft_top4_prob, sig.source_nodes, sig.source_top) == (1.25, 0.9, 3, 0.6)
    sig = proposer([Scripted("a", [None])]).signals(0, -1)
    assert (sig.source_match, sig.source_nodes, sig.source_top) == (0, 0, 0.0)


def test_head_tree_verified_as_drafted_when_no_source_proposes():
    p = proposer([Scripted("a", [None]), Scripted("b", [CandidateTrie()])])  # an empty trie proposes nothing
    p.signals(0, -1)
    proposal = p.propose(SHAPE)
    assert proposal.fused is None and paths_of(proposal)[1:] == [(1,), (3,), (1, 2)]


def test_budget_is_ndt_plus_the_extra_slots_of_the_sources_that_proposed():
    many = trie({(t,): 0.9 - 0.01 * t for t in range(10, 20)})
    for tries, want in (([many, None], SHAPE.ndt + 2), ([None, many], SHAPE.ndt + 5), ([many, many], SHAPE.ndt + 5)):
        p = proposer([Scripted("a", [tries[0]], extra=2), Scripted("b", [tries[1]], extra=5)])
        p.signals(0, -1)
        assert p.propose(SHAPE).tree.size == want
    p = proposer([Scripted("a", [None], extra=2)], drafter=False)  # nothing at all: the root alone
    p.signals(0, -1)
    assert p.propose(SHAPE).tree.size == 1


def test_skip_draft_verifies_the_candidates_without_drafting():
    t = trie({(5,): 0.8, (5, 6): 0.7})
    p = proposer([Scripted("a", [t], skip=True)])
    p.signals(0, -1)
    proposal = p.propose(SHAPE)
    assert p.runtime.drafted == 0 and paths_of(proposal.fused)[1:] == [(5,), (5, 6)]
    p = proposer([Scripted("a", [t], skip=False)])
    p.signals(0, -1)
    assert {(5,), (1,)} <= set(paths_of(p.propose(SHAPE).fused)) and p.runtime.drafted == 1


def test_observe_extends_every_source_teaches_the_proposers_and_counts_per_source():
    t = trie({(1,): 0.9, (1, 2): 0.8})  # the head's path 1 -> 2 too: both are credited
    a, b = Scripted("a", [t, None]), Scripted("b", [None, None])
    p = proposer([a, b])
    p.extend([100])
    p.signals(0, -1)
    proposal = p.propose(SHAPE)
    path = [0, paths_of(proposal.fused).index((1,)), paths_of(proposal.fused).index((1, 2))]
    assert proposal.fused.origin[path[2]] == HEAD | 2
    result = VerifyResult(path=path, tokens=[1, 2, 5])
    assert p.observe(proposal, result, [1, 2]) == {"head": 2, "a": 2, "b": 0}
    assert a.seen == b.seen == [7, 8, 100, 1, 2]  # emitted tokens (cut at EOS/limit) extend every source
    assert a.observed == [(t, [1, 2, 5])] and b.observed == []  # only a proposer learns, from the target's tokens
    p.signals(1, 2)
    proposal = p.propose(SHAPE)  # the head's tree alone
    assert p.observe(proposal, VerifyResult(path=[0, 1], tokens=[1, 4]), [1, 4]) == {"head": 1, "a": 0, "b": 0}
    assert p.accepted == {"head": 3, "a": 2, "b": 0}
    p = proposer([Scripted("a", [t])], drafter=False)
    assert p.accepted == {"a": 0}  # no head, no head count
