"""Verifier ``fly``: the deferred window, the entropy gate, the end-of-draft blind spot, trees."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from adaptivespec.config import load_config, structure
from adaptivespec.errors import ConfigError
from adaptivespec.testing import registered, tree_with_logits
from adaptivespec.types import TreeShape
from adaptivespec.tree import greedy_matches
from adaptivespec.verifiers.strict import StrictVerifier
from adaptivespec_fly import FlyParams, FlyVerifier, strict_run_below, topk_entropy

V = 64
ROOT = 60  # token of the root node
BONUS = 30  # the target's top-1 after the last node of a chain
WRONG = 50  # the target's top-1 where a chain holds a mismatch: 50 + parent index


def chain(k: int, mismatches=(), *, top1_prob: float = 0.5, probs=None, vocab: int = V):
    """Root + drafted tokens 1..k (node i holds token i). The target's top-1 after node u is
    token u + 1 (a match) unless node u + 1 is listed in ``mismatches``; after node k it is BONUS.
    With top1_prob 0.5 and V = 64 the target's top-3 entropy is about 0.42 nats at every node."""
    top1 = {u: (WRONG + u if u + 1 in mismatches else u + 1) for u in range(k)}
    top1[k] = BONUS
    return tree_with_logits([ROOT, *range(1, k + 1)], [-1, *range(k)], target_top1=top1,
                            top1_prob=top1_prob, probs=probs, vocab=vocab)


def fly(tree, logits, **params):
    res = FlyVerifier(FlyParams(**params)).verify(tree, logits)
    assert all(type(t) is int for t in res.path + res.tokens + [res.promoted])
    return res


def entropy_of(ps) -> float:
    return -sum(p * math.log(p) for p in ps)


# -- registration and parameters ------------------------------------------------------------------
def test_registered_by_the_plugin_distribution_as_lossy():
    entry = registered("verifier", "fly")
    assert entry.cls is FlyVerifier
    assert entry.provider == "adaptivespec-fly"
    assert not entry.lossless


def test_paper_defaults():
    p = FlyParams()
    assert (p.window, p.theta, p.entropy_topk) == (6, 0.3, 3)


@pytest.mark.parametrize(
    "raw, key, words",
    [
        ({"window": 0}, "verifier.window", "expected a positive integer, got 0"),
        ({"theta": -0.1}, "verifier.theta", "expected a number in [0, inf], got -0.1"),
        ({"entropy_topk": 0}, "verifier.entropy_topk", "expected a positive integer, got 0"),
        ({"w": 6}, "verifier.w", "unknown key"),
    ],
)
def test_yaml_errors_name_the_key_and_what_was_expected(raw, key, words):
    with pytest.raises(ConfigError) as err:
        structure(FlyParams, raw, "fly.yaml", "verifier")
    assert f"fly.yaml: {key}: " in str(err.value) and words in str(err.value)


# -- the deferred window on chains --------------------------------------------------------------------
def test_mismatch_followed_by_w_minus_1_matches_is_kept():
    tree, z = chain(7, {1})
    assert StrictVerifier().verify(tree, z).tokens == [WRONG]  # strict stops at the mismatch
    res = fly(tree, z)
    assert res.path == list(range(8))
    assert res.tokens == [1, 2, 3, 4, 5, 6, 7, BONUS]
    assert res.promoted == 1 and res.accepted == 7


@pytest.mark.parametrize("window", [2, 3, 6])
def test_a_second_mismatch_inside_the_window_rejects_the_first(window):
    k = window + 1  # the shortest chain on which depth 1 can be promoted
    for j in range(2, window + 1):  # nodes 2..W are the W - 1 positions below the mismatch
        tree, z = chain(k, {1, j})
        res = fly(tree, z, window=window)
        assert (res.path, res.tokens, res.promoted) == ([0], [WRONG], 0), j


@pytest.mark.parametrize("window", [2, 3, 6])
def test_a_mismatch_just_after_the_window_does_not_matter(window):
    k = window + 1
    tree, z = chain(k, {1, window + 1})  # node W + 1 is the first position after the window
    res = fly(tree, z, window=window)
    assert res.path == list(range(window + 1))  # promoted 1, matches 2..W; node W+1 is in the last W levels
    assert res.tokens == [*range(1, window + 1), WRONG + window]
    assert res.promoted == 1


def test_several_mismatches_per_step_when_each_has_its_window():
    tree, z = chain(13, {1, 7})
    res = fly(tree, z, window=6)
    assert res.path == list(range(14)) and res.promoted == 2
    assert res.tokens == [*range(1, 14), BONUS]


def test_window_one_needs_no_match_below_but_a_level_below():
    tree, z = chain(2, {1, 2})
    res = fly(tree, z, window=1)  # node 1: depth 1 + 1 <= 2; node 2 is in the last level: strict
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [1, WRONG + 1], 1)


# -- the end-of-draft blind spot ------------------------------------------------------------------------
@pytest.mark.parametrize("window", [2, 4, 6])
def test_last_w_levels_keep_the_strict_decision(window):
    # W - 1 matches below the mismatch fit exactly, but the draft is only W deep: strict
    tree, z = chain(window, {1})
    assert (fly(tree, z, window=window).path) == [0]
    # one level more and the same mismatch is kept
    tree, z = chain(window + 1, {1})
    assert fly(tree, z, window=window).path == list(range(window + 2))
    # a mismatch at depth 2 of that chain is again within the last W levels
    tree, z = chain(window + 1, {2})
    res = fly(tree, z, window=window)
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [1, WRONG + 1], 0)


def test_paper_window_never_acts_on_a_five_deep_tree():
    tree, z = chain(5, {1})
    assert fly(tree, z).path == [0]  # W = 6 needs six levels below the mismatch


# -- the entropy gate -------------------------------------------------------------------------------------
ROW = {WRONG: 0.45, 1: 0.3, 33: 0.15}  # the target at the root: top-1 WRONG, the draft's token 2nd


@pytest.mark.parametrize("delta, kept", [(-1e-4, True), (1e-4, False)])
def test_entropy_gate_threshold(delta, kept):
    tree, z = chain(7, {1}, probs={0: ROW})
    h = entropy_of(ROW.values())
    assert topk_entropy(z, 3)[0].item() == pytest.approx(h, abs=1e-5)
    res = fly(tree, z, theta=h + delta)
    assert res.promoted == int(kept)
    assert res.path == (list(range(8)) if kept else [0])


def test_entropy_is_over_full_softmax_top3_not_renormalised():
    row = {WRONG: 0.1, 1: 0.05, 33: 0.05}  # the other 0.8 spread thinly over 197 tokens
    tree, z = chain(7, {1}, probs={0: row}, vocab=200)
    full, renormalised = entropy_of(row.values()), entropy_of([0.5, 0.25, 0.25])
    assert full < 0.8 < renormalised
    assert fly(tree, z, theta=0.8).path == [0]
    assert fly(tree, z, theta=full - 1e-4).promoted == 1


def test_entropy_topk_counts_the_k_largest_probabilities():
    tree, z = chain(7, {1}, probs={0: ROW})
    assert topk_entropy(z, 1)[0].item() == pytest.approx(entropy_of([0.45]), abs=1e-5)
    h1 = entropy_of([0.45])
    assert fly(tree, z, theta=h1 + 0.01, entropy_topk=1).path == [0]
    assert fly(tree, z, theta=h1 + 0.01, entropy_topk=3).promoted == 1


def test_confident_target_rejects_and_theta_zero_turns_the_gate_off():
    tree, z = chain(7, {1}, top1_prob=0.97)  # top-3 entropy ~0.04 nats
    assert fly(tree, z).path == [0]
    assert fly(tree, z, theta=0.0).promoted == 1


def test_a_token_the_target_rules_out_is_never_kept():
    tree, z = chain(7, {1})
    z[0, 1] = -math.inf
    assert fly(tree, z, theta=0.0).path == [0]


# -- trees ------------------------------------------------------------------------------------------------------
def test_lookahead_follows_the_strictly_matching_path_below_the_candidate():
    # root -> c (1, mismatch). Under c: a branch starting with a mismatch that goes 7 deep, and
    # the matching branch b1..b5 (tokens 21..25) that goes 6 deep. The window reads the b branch.
    tokens = [ROOT, 1, 11, 12, 13, 14, 15, 16, 21, 22, 23, 24, 25]
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 1, 8, 9, 10, 11]
    top1 = {0: WRONG, 1: 21, 2: 12, 3: 13, 4: 14, 5: 15, 6: 16, 7: 5, 8: 22, 9: 23, 10: 24, 11: 25, 12: 7}
    tree, z = tree_with_logits(tokens, parents, target_top1=top1, top1_prob=0.5, vocab=V)
    run = strict_run_below(tree, greedy_matches(tree, z.argmax(-1)))
    assert run[:3].tolist() == [0, 5, 5]  # root: c mismatches; c: via b1..b5; node 2: 12..16
    res = fly(tree, z)
    assert res.path == [0, 1, 8, 9, 10, 11, 12]
    assert res.tokens == [1, 21, 22, 23, 24, 25, 7]
    assert res.promoted == 1


def test_a_deep_branch_that_is_not_strictly_matching_does_not_count():
    # as above, but the matching branch stops after 4 matches (b1..b4): the window fails
    tokens = [ROOT, 1, 11, 12, 13, 14, 15, 16, 21, 22, 23, 24]
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 1, 8, 9, 10]
    top1 = {0: WRONG, 1: 21, 2: 12, 3: 13, 4: 14, 5: 15, 6: 16, 8: 22, 9: 23, 10: 24}
    tree, z = tree_with_logits(tokens, parents, target_top1=top1, top1_prob=0.5, vocab=V)
    res = fly(tree, z)
    assert (res.path, res.tokens, res.promoted) == ([0], [WRONG], 0)


def test_the_longest_of_several_strict_paths_is_followed():
    # duplicate sibling tokens (hand-built): two strictly matching branches under c, 2 and 6 long
    tokens = [ROOT, 1, 21, 22, 21, 22, 23, 24, 25, 26]
    parents = [-1, 0, 1, 2, 1, 4, 5, 6, 7, 8]
    top1 = {0: WRONG, 1: 21, 2: 22, 3: 9, 4: 22, 5: 23, 6: 24, 7: 25, 8: 26, 9: 7}
    tree, z = tree_with_logits(tokens, parents, target_top1=top1, top1_prob=0.5, vocab=V)
    res = fly(tree, z)
    assert res.path == [0, 1, 4, 5, 6, 7, 8, 9] and res.promoted == 1


def test_a_matching_sibling_is_preferred_to_deferring_a_rejection():
    # root -> m (token WRONG, the target's choice, a leaf) and root -> c (token 1, mismatch)
    # with a 6-long matching chain below c: strict continues through m, so c is not considered
    tokens = [ROOT, WRONG, 1, 2, 3, 4, 5, 6, 7]
    parents = [-1, 0, 0, 2, 3, 4, 5, 6, 7]
    top1 = {0: WRONG, 1: 40, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, 8: BONUS}
    tree, z = tree_with_logits(tokens, parents, target_top1=top1, top1_prob=0.5, vocab=V)
    res = fly(tree, z)
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [WRONG, 40], 0)


def test_between_promotable_siblings_the_deeper_branch_wins():
    # root -> c1 (1) with 5 matches below, root -> c2 (9) with 7 matches below; both mismatch
    tokens = [ROOT, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12, 13]
    top1 = {0: WRONG, 1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 40, 7: 10, 8: 11, 9: 12, 10: 13, 11: 14, 12: 15, 13: 16, 14: BONUS}
    tree, z = tree_with_logits(tokens, parents, target_top1=top1, top1_prob=0.5, vocab=V)
    res = fly(tree, z)
    assert res.path == [0, *range(7, 15)] and res.tokens == [*range(9, 17), BONUS] and res.promoted == 1


# -- against a loop-by-loop reading of the rule, on random trees ----------------------------------------
def reference(tree, logits, window: int, theta: float, k: int = 3):
    """The class docstring's rule, node by node in plain Python."""
    n = tree.size
    par, tok, dep = tree.parents.tolist(), tree.tokens.tolist(), tree.depth.tolist()
    top1 = logits.argmax(-1).tolist()
    probs = torch.softmax(logits.double(), -1)
    kids = {u: [c for c in range(1, n) if par[c] == u] for u in range(n)}
    match = [True] + [tok[c] == top1[par[c]] for c in range(1, n)]

    def run(c):  # longest chain of matches below c
        return max([0] + [1 + run(x) for x in kids[c] if match[x]])

    def entropy(u):
        ps = sorted(probs[u].tolist(), reverse=True)[:k]
        return -sum(p * math.log(p) for p in ps if p > 0)

    ok = list(match)
    for c in range(1, n):
        u = par[c]
        if not match[c]:
            ok[c] = (not any(match[x] for x in kids[u]) and entropy(u) >= theta and run(c) >= window - 1
                     and dep[c] + window <= max(dep) and probs[u, tok[c]].item() > 0)
    valid = [True] * n
    for c in range(1, n):
        valid[c] = valid[par[c]] and ok[c]
    best = max(range(n), key=lambda i: (valid[i], dep[i], -i))
    path = [best]
    while path[-1] != 0:
        path.append(par[path[-1]])
    path.reverse()
    return path, [tok[x] for x in path[1:]] + [top1[best]], sum(not match[x] for x in path[1:])


def random_case(rng: random.Random, n: int):
    """A random tree whose target mostly agrees with the first child, so windows happen."""
    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]
    tokens = [ROOT] + [rng.randrange(1, 24) for _ in range(1, n)]
    kids = {u: [c for c in range(1, n) if parents[c] == u] for u in range(n)}
    top1 = {u: (tokens[rng.choice(kids[u])] if kids[u] and rng.random() < 0.8 else rng.randrange(24, 40)) for u in range(n)}
    p1 = {u: rng.choice([0.35, 0.5, 0.75, 0.95]) for u in range(n)}
    return tree_with_logits(tokens, parents, target_top1=top1, top1_prob=p1, vocab=V)


@pytest.mark.parametrize("seed", range(60))
def test_matches_the_loop_reference_on_random_trees(seed):
    rng = random.Random(seed)
    tree, z = random_case(rng, rng.randrange(2, 28))
    for window in (1, 2, 3, 6):
        for theta in (0.0, 0.3, 0.6):
            path, tokens, promoted = reference(tree, z, window, theta)
            res = fly(tree, z, window=window, theta=theta)
            assert (res.path, res.tokens, res.promoted) == (path, tokens, promoted), (window, theta)


@pytest.mark.parametrize("seed", range(30))
def test_without_a_possible_window_it_is_strict(seed):
    rng = random.Random(1000 + seed)
    tree, z = random_case(rng, rng.randrange(2, 28))
    strict = StrictVerifier().verify(tree, z)
    for params in (dict(window=100), dict(theta=1e9)):
        res = fly(tree, z, **params)
        assert (res.path, res.tokens, res.promoted) == (strict.path, strict.tokens, 0)


def test_promotions_extend_strict_acceptance_on_random_trees():
    more = 0
    for seed in range(80):
        rng = random.Random(2000 + seed)
        tree, z = random_case(rng, 24)
        strict = StrictVerifier().verify(tree, z)
        res = fly(tree, z, window=2, theta=0.0)
        assert res.accepted >= strict.accepted
        assert res.path[: strict.accepted + 1] == strict.path  # FLy only ever extends the strict path
        more += res.accepted > strict.accepted
    assert more > 0


# -- configuration and the decode loop ----------------------------------------------------------------
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "fly.yaml"


@pytest.mark.skipif(not CONFIG.is_file(), reason="configs/fly.yaml is not beside this plugin")
def test_shipped_config_loads():
    config = load_config(CONFIG)
    assert config.verifier.name == "fly" and config.policy.name == "static"
    eagle3 = load_config(Path(CONFIG).parent / "eagle3.yaml")
    assert config.policy == eagle3.policy  # FLy is measured on EAGLE-3's own static shape


@pytest.mark.model
def test_in_the_decode_loop_without_promotions_it_is_lossless(assert_lossless):
    prompts = ["What is 12 times 7? Answer briefly."]
    results = assert_lossless(["policy.nsteps=8", "policy.topk=1", "policy.ndt=9", "verifier.name=fly", "verifier.theta=1000"],
                              prompts, max_new_tokens=24, oracle=True)
    assert all(r.promoted == 0 for r in results[0].records)
    assert sum(r.accepted for r in results[0].records) > 0
