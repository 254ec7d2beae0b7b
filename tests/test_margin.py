"""Verifier ``margin``: hand-built trees with chosen target logits, and a loop-based reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from adaptivespec.params import structure
from adaptivespec.errors import ConfigError
from adaptivespec.plugins import Registry
from adaptivespec.strategies import TreePolicy
from adaptivespec.tree import draft_tree, make_tree
from adaptivespec.types import TreeShape
from adaptivespec.verifiers import margin
from adaptivespec.verifiers.margin import MarginParams, MarginVerifier
from adaptivespec.verifiers.strict import StrictVerifier

V = 10
LOW = -8.0  # logit of every token a test does not mention


def logits_for(n: int, rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """[n, V] logits, LOW everywhere except ``rows[node][token] = logit``."""
    z = torch.full((n, V), LOW)
    for node, row in rows.items():
        for tok, val in row.items():
            z[node, tok] = val
    return z


def tree_of(tokens, parents):
    """make_tree with an explicit shape large enough for any tree of this size (the default shape
    make_tree infers, ``(depth, 1, n)``, is invalid for trees that branch)."""
    m = max(len(tokens) - 1, 1)
    return make_tree(tokens, parents, shape=TreeShape(m, m, m + 1))


def verify(tree, logits, **params):
    return MarginVerifier(MarginParams(**params)).verify(tree, logits)


# -- the threshold ------------------------------------------------------------------------------
@pytest.mark.parametrize("kappa", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("offset", [0.0, 5.3, -0.7])  # nonzero offsets round z_c - z_top in float32
def test_ratio_exactly_at_kappa_is_promoted_and_just_below_is_not(kappa, offset):
    tree = tree_of([9, 1], [-1, 0])  # root -> token 1; the target prefers token 0
    at = logits_for(2, {0: {0: offset, 1: offset + math.log(kappa)}})
    below = logits_for(2, {0: {0: offset, 1: offset + math.log(kappa) - 1e-3}})
    res = verify(tree, at, kappa=kappa)
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [1, 0], 1)  # bonus: top-1 at node 1 (all LOW -> 0)
    res = verify(tree, below, kappa=kappa)
    assert (res.path, res.tokens, res.promoted) == ([0], [0], 0)


def test_bonus_is_target_top1_at_last_accepted_node():
    # root -> 1 (promoted) -> 2 (match) -> 3 (mismatch, far off): bonus is top-1 at node 2
    tree = tree_of([9, 1, 2, 3], [-1, 0, 1, 2])
    z = logits_for(4, {0: {0: 0.0, 1: -0.1}, 1: {2: 1.0}, 2: {7: 2.0, 3: -5.0}, 3: {4: 1.0}})
    res = verify(tree, z, kappa=0.5)
    assert res.path == [0, 1, 2]
    assert res.tokens == [1, 2, 7]
    assert res.promoted == 1 and res.accepted == 2
    assert all(type(t) is int for t in res.path + res.tokens + [res.promoted])


# -- max_promotions -----------------------------------------------------------------------------
def chain_with_two_near_misses():
    tree = tree_of([9, 1, 2, 3], [-1, 0, 1, 2])
    z = logits_for(4, {0: {0: 0.0, 1: math.log(0.8)}, 1: {5: 0.0, 2: math.log(0.7)}, 2: {3: 1.0}, 3: {6: 1.0}})
    return tree, z


def test_single_promotion_stops_at_the_second_near_miss():
    tree, z = chain_with_two_near_misses()
    res = verify(tree, z, kappa=0.5, max_promotions=1)
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [1, 5], 1)


def test_unlimited_promotions_walk_through_both_near_misses():
    tree, z = chain_with_two_near_misses()
    for cap in (None, 2, 3):
        res = verify(tree, z, kappa=0.5, max_promotions=cap)
        assert (res.path, res.tokens, res.promoted) == ([0, 1, 2, 3], [1, 2, 3, 6], 2)


def test_promotion_cap_is_per_path_not_per_tree():
    # Two branches below a promoted node: only the strict one may continue once the cap is spent.
    tree = tree_of([9, 1, 2, 3, 4], [-1, 0, 1, 1, 3])
    z = logits_for(5, {0: {0: 0.0, 1: -0.1}, 1: {3: 0.0, 2: -0.1}, 3: {4: 0.0}, 4: {8: 0.0}})
    res = verify(tree, z, kappa=0.5, max_promotions=1)
    assert (res.path, res.tokens, res.promoted) == ([0, 1, 3, 4], [1, 3, 4, 8], 1)


# -- which child ---------------------------------------------------------------------------------
def test_strict_match_wins_over_a_promotable_sibling_with_a_longer_future():
    # root's children: 1 = the target's top-1 (a leaf); 2 = near miss (ratio 0.95) with a
    # matching grandchild. Strict matching comes first, so the promoted branch is never taken.
    tree = tree_of([9, 1, 2, 3], [-1, 0, 0, 2])
    z = logits_for(4, {0: {1: 0.0, 2: math.log(0.95)}, 1: {6: 0.0}, 2: {3: 0.0}, 3: {4: 0.0}})
    res = verify(tree, z, kappa=0.5, max_promotions=None)
    assert (res.path, res.tokens, res.promoted) == ([0, 1], [1, 6], 0)


def test_strict_match_wins_over_an_exact_tie_listed_first():
    # target: tokens 0 and 3 tie at the root, argmax picks 0. Node 1 (token 3, the tie, lower
    # node index) has a matching child; node 2 (token 0) is the strict match and must win.
    tree = tree_of([9, 3, 0, 5], [-1, 0, 0, 1])
    z = logits_for(4, {0: {0: 1.0, 3: 1.0}, 1: {5: 0.0}, 2: {6: 0.0}})
    res = verify(tree, z, kappa=0.5, max_promotions=None)
    assert (res.path, res.tokens, res.promoted) == ([0, 2], [0, 6], 0)


@pytest.mark.parametrize("order", [[1, 2, 3], [2, 3, 1], [3, 1, 2]])
def test_best_ratio_sibling_is_promoted(order):
    # three mismatching siblings with ratios 0.6, 0.8, 0.7 (tokens 1, 2, 3); node order varies
    ratios = {1: 0.6, 2: 0.8, 3: 0.7}
    tree = tree_of([9, *order], [-1, 0, 0, 0])
    z = logits_for(4, {0: {0: 0.0, **{t: math.log(r) for t, r in ratios.items()}}})
    res = verify(tree, z, kappa=0.5)
    assert res.tokens[:1] == [2] and res.path == [0, 1 + order.index(2)] and res.promoted == 1


def test_best_sibling_below_kappa_stops_even_if_a_worse_one_has_children():
    tree = tree_of([9, 1, 2, 3], [-1, 0, 0, 2])
    z = logits_for(4, {0: {0: 0.0, 1: math.log(0.4), 2: math.log(0.3)}, 2: {3: 0.0}})
    res = verify(tree, z, kappa=0.5)
    assert (res.path, res.tokens, res.promoted) == ([0], [0], 0)


def test_tied_siblings_promote_exactly_one():
    tree = tree_of([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2])
    z = logits_for(5, {0: {0: 0.0, 1: -0.2, 2: -0.2}, 1: {3: 0.0}, 2: {4: 0.0}})
    res = verify(tree, z, kappa=0.5, max_promotions=None)
    assert res.path == [0, 1, 3] and res.promoted == 1  # the lower node index wins the tie


# -- options --------------------------------------------------------------------------------------
def test_top_k_restricts_promotable_tokens():
    # at the root: top-1 is 0, tokens 5 and 6 are closer than the drafted token 7 (rank 4)
    tree = tree_of([9, 7], [-1, 0])
    z = logits_for(2, {0: {0: 0.0, 5: -0.1, 6: -0.1, 7: -0.2}})
    assert verify(tree, z, kappa=0.5).promoted == 1
    assert verify(tree, z, kappa=0.5, top_k=3).path == [0]
    assert verify(tree, z, kappa=0.5, top_k=4).path == [0, 1]
    assert verify(tree, z, kappa=0.5, top_k=100).path == [0, 1]  # k larger than the vocabulary


def test_additive_form_uses_probability_gap():
    probs = torch.tensor([0.40, 0.35, 0.05] + [0.20 / 7] * 7)  # token 1 is drafted
    tree = tree_of([9, 1], [-1, 0])
    z = torch.stack([probs.log(), torch.zeros(V)])
    assert verify(tree, z, form="additive", delta=0.06).path == [0, 1]  # gap 0.05 <= 0.06
    assert verify(tree, z, form="additive", delta=0.04).path == [0]  # gap 0.05 > 0.04
    # same logits shifted: probabilities, hence the decision, do not change
    assert verify(tree, z + 7.0, form="additive", delta=0.06).path == [0, 1]
    # a flatter distribution with the same ratio 0.875 has a smaller gap
    flat = torch.stack([torch.tensor([0.08, 0.07] + [0.85 / 8] * 8).log(), torch.zeros(V)])
    assert verify(tree, flat, form="additive", delta=0.04).path == [0, 1]
    # the ratio form ignores delta and sees 0.35 / 0.40 = 0.875
    assert verify(tree, z, form="ratio", kappa=0.9, delta=1.0).path == [0]
    assert verify(tree, z, form="ratio", kappa=0.85, delta=0.0).path == [0, 1]


def test_kappa_one_promotes_only_exact_ties():
    tree = tree_of([9, 3], [-1, 0])
    tie = logits_for(2, {0: {0: 1.0, 3: 1.0}})  # argmax picks token 0; token 3 ties
    assert StrictVerifier().verify(tree, tie).path == [0]
    res = verify(tree, tie, kappa=1.0)
    assert (res.path, res.promoted) == ([0, 1], 1)
    near = logits_for(2, {0: {0: 1.0, 3: 1.0 - 1e-3}})
    assert verify(tree, near, kappa=1.0).path == [0]


def test_root_only_tree_emits_the_bonus():
    res = verify(tree_of([4], [-1]), logits_for(1, {0: {6: 1.0}}))
    assert (res.path, res.tokens, res.promoted) == ([0], [6], 0)


def test_bfloat16_logits():
    tree, z = chain_with_two_near_misses()
    res = verify(tree, z.to(torch.bfloat16), kappa=0.5, max_promotions=None)
    assert (res.path, res.promoted) == ([0, 1, 2, 3], 2)


# -- reference walk over random trees -------------------------------------------------------------
def reference(tokens, parents, z, kappa=0.5, max_promotions=1, top_k=None, form="ratio", delta=0.1):
    """The rule as a plain loop over the walk, in float64."""
    n = len(tokens)
    children = {u: [i for i in range(1, n) if parents[i] == u] for u in range(n)}
    z = z.double()
    path, promoted, u = [0], 0, 0
    while True:
        top = int(z[u].argmax())
        match = [c for c in children[u] if tokens[c] == top]
        if match:
            u = match[0]
        else:
            if not children[u] or (max_promotions is not None and promoted >= max_promotions):
                break
            c = max(children[u], key=lambda c: (float(z[u, tokens[c]]), -c))
            zc, zt = float(z[u, tokens[c]]), float(z[u, top])
            if form == "ratio":
                ok = zc - zt >= math.log(kappa) - margin.THRESHOLD_TOL
            else:
                pr = torch.softmax(z[u], -1)
                ok = float(pr[top] - pr[tokens[c]]) <= delta + margin.THRESHOLD_TOL
            if top_k is not None:
                ok = ok and int((z[u] > zc).sum()) < top_k
            if not ok:
                break
            u, promoted = c, promoted + 1
        path.append(u)
    return path, [tokens[i] for i in path[1:]] + [int(z[u].argmax())], promoted


def random_tree(rng: random.Random, n: int):
    """Random topological tree with distinct sibling tokens (as drafted trees have)."""
    parents, tokens, used = [-1], [rng.randrange(V)], {0: set()}
    for i in range(1, n):
        p = rng.randrange(i)
        tok = rng.choice(sorted(set(range(V)) - used[p]))
        used[p].add(tok)
        used[i] = set()
        parents.append(p), tokens.append(tok)
    return tokens, parents


def random_logits(rng: random.Random, tokens, parents, scale=1.5):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    z = torch.randn(len(tokens), V, generator=gen) * scale
    for u in range(len(tokens)):  # make about half of the nodes with children agree with one
        kids = [i for i in range(1, len(tokens)) if parents[i] == u]
        if kids and rng.random() < 0.5:
            z[u, tokens[rng.choice(kids)]] += 4.0
    return z


PARAM_GRID = [
    dict(kappa=0.5),
    dict(kappa=0.2, max_promotions=None),
    dict(kappa=0.3, max_promotions=2),
    dict(kappa=0.1, max_promotions=None, top_k=2),
    dict(kappa=0.7, top_k=3),
    dict(form="additive", delta=0.15, max_promotions=None),
    dict(form="additive", delta=0.3, top_k=2),
]


@pytest.mark.parametrize("params", PARAM_GRID, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_matches_reference_walk_on_random_trees(params):
    rng = random.Random(1234)
    promoted_total = 0
    for _ in range(60):
        tokens, parents = random_tree(rng, rng.randint(1, 10))
        z = random_logits(rng, tokens, parents)
        res = verify(tree_of(tokens, parents), z, **params)
        want = reference(tokens, parents, z, **params)
        assert (res.path, res.tokens, res.promoted) == want, (tokens, parents)
        promoted_total += res.promoted
    assert promoted_total > 0  # the grid actually exercises promotions


def test_kappa_one_equals_strict_on_random_trees():
    rng = random.Random(7)
    for _ in range(100):
        tokens, parents = random_tree(rng, rng.randint(1, 10))
        tree = tree_of(tokens, parents)
        z = random_logits(rng, tokens, parents)
        assert verify(tree, z, kappa=1.0, max_promotions=None) == StrictVerifier().verify(tree, z)


class _RandomDrafter:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, tokens, hidden, parent_slots, depth):
        logp = torch.log_softmax(torch.randn(tokens.shape[0], V, generator=self.gen) * 2, -1)
        return logp, hidden


@pytest.mark.parametrize("shape", [TreeShape(3, 4, 10), TreeShape(5, 2, 8), TreeShape(4, 1, 5)])
def test_drafted_trees_kappa_one_is_strict_and_lossy_matches_reference(shape):
    for seed in range(15):
        gen = torch.Generator().manual_seed(seed)
        tree = draft_tree(
            shape,
            root_token=torch.tensor(0),
            root_logp=torch.log_softmax(torch.randn(V, generator=gen), -1),
            root_hidden=torch.zeros(4),
            expand=_RandomDrafter(seed),
            to_target=lambda ids: ids,
            rules=TreePolicy(),
        )
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        z = random_logits(random.Random(seed), tokens, parents)
        assert verify(tree, z, kappa=1.0, max_promotions=None) == StrictVerifier().verify(tree, z)
        res = verify(tree, z, kappa=0.3, max_promotions=None)
        assert (res.path, res.tokens, res.promoted) == reference(tokens, parents, z, kappa=0.3, max_promotions=None)


# -- parameters and registration --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kappa": 1.5}, "x.yaml: verifier.kappa: expected a number in (0, 1], got 1.5"),
        ({"kappa": 0.0}, "x.yaml: verifier.kappa: expected a number in (0, 1], got 0.0"),
        ({"max_promotions": 0}, "x.yaml: verifier.max_promotions: expected a positive integer, got 0"),
        ({"top_k": 0}, "x.yaml: verifier.top_k: expected a positive integer, got 0"),
        ({"form": "ratios"}, "x.yaml: verifier.form: expected one of ratio, additive, got 'ratios'"),
        ({"delta": 1.2}, "x.yaml: verifier.delta: expected a number in [0, 1], got 1.2"),
    ],
)
def test_param_errors_name_key_value_and_expectation(raw, message):
    with pytest.raises(ConfigError) as err:
        structure(MarginParams, raw, "x.yaml", "verifier")
    assert str(err.value) == message


def test_params_from_yaml_and_defaults():
    p = structure(MarginParams, {"kappa": 1, "max_promotions": None, "top_k": 5}, "x.yaml", "verifier")
    assert (p.kappa, p.max_promotions, p.top_k, p.form) == (1.0, None, 5, "ratio")
    d = MarginParams()
    assert (d.kappa, d.max_promotions, d.top_k, d.form) == (margin.DEFAULT_KAPPA, 1, None, "ratio")


def test_registers_as_lossy_margin():
    registry = Registry("verifier")
    margin.adaptivespec_register_verifiers(registry)
    entry = registry.get("margin")
    assert entry.cls is MarginVerifier and entry.lossless is False
    assert entry.description
