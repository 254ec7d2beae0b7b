"""Sampling at temperature > 0: the warpers, tree speculative sampling's exact distribution, the
margin rule's sampling form, seeds and refusals.

The distribution tests draw >= 20k verifications of hand-built trees with a fixed seed and compare
the emitted sequences (accepted path + last token) with the target's exact joint distribution by a
chi-square test: deterministic, and a wrong rule (e.g. accepting a child with p instead of the
residual probability) fails them by a wide margin.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch

from adaptivespec.config import load_config
from adaptivespec.errors import ConfigError
from adaptivespec.sampling import Sampler, greedy_ids, warp
from adaptivespec.tree import make_tree
from adaptivespec.types import TreeShape
from adaptivespec.verifiers.margin import MarginParams, MarginVerifier
from adaptivespec.verifiers.strict import StrictVerifier

V = 8


def tree_of(tokens, parents):
    m = max(len(tokens) - 1, 1)
    return make_tree(tokens, parents, shape=TreeShape(m, m, m + 1))


def exact_joint(tree, probs) -> dict[tuple[int, ...], float]:
    """The target's law of one step's emitted tokens: walk the tree while the sampled token is a
    drafted child (the first child carrying it), stop after the first token that is not."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rows = probs.double().tolist()
    out: dict[tuple[int, ...], float] = {}

    def walk(u: int, prefix: tuple[int, ...], mass: float) -> None:
        children = {}
        for c in range(len(tokens)):
            if parents[c] == u and tokens[c] not in children:
                children[tokens[c]] = c
        for y, py in enumerate(rows[u]):
            if py <= 0:
                continue
            if y in children:
                walk(children[y], prefix + (y,), mass * py)
            else:
                out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + mass * py

    walk(0, (), 1.0)
    return out


def chi_square_pvalue(counts: Counter, joint: dict, draws: int) -> float:
    """Pearson chi-square p-value; outcomes expected fewer than 5 times are pooled."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for outcome, prob in joint.items():
        exp = prob * draws
        if exp < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += exp
            continue
        stat += (counts.get(outcome, 0) - exp) ** 2 / exp
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def depth2_tree():
    # root(7) -> 0, 1, 2 ; node1(0) -> 3, 4 ; node2(1) -> 0, 5 ; node3(2) is a leaf
    return tree_of([7, 0, 1, 2, 3, 4, 0, 5], [-1, 0, 0, 0, 1, 1, 2, 2])


def target_logits(n: int, seed: int = 0, scale: float = 1.2, tree=None, boost: float = 1.5) -> torch.Tensor:
    """[n, V] random logits; with ``tree``, each node's drafted children get ``boost`` more (so
    drafts are often accepted and several siblings are tried)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g) * scale
    if tree is not None:
        z[tree.parents[1:], tree.tokens[1:]] += boost
    return z


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny verifications: intra-op threads only add contention (10x on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_draws(verifier, tree, logits, sampler, draws: int) -> Counter:
    verifier.sampler = sampler
    return Counter(tuple(verifier.verify(tree, logits).tokens) for _ in range(draws))


# -- the warpers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.1), dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
])
def test_warp_matches_transformers_generate_order(settings):
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    z = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if settings.get("top_k"):
        procs.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(settings["top_p"]))
    if settings.get("min_p") is not None:
        procs.append(MinPLogitsWarper(settings["min_p"]))
    expected = procs(torch.zeros(6, 1, dtype=torch.long), z.clone())
    got = warp(z, **settings)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got.softmax(-1), expected.softmax(-1))


# -- tree speculative sampling: exact distribution ------------------------------------------------------
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.85)])
def test_strict_tree_sampling_matches_the_exact_joint(settings):
    tree = depth2_tree()
    logits = target_logits(8, seed=3, tree=tree)
    sampler = Sampler(device="cpu", seed=11, **settings)
    joint = exact_joint(tree, sampler.probs(logits))
    draws = 20_000
    counts = run_draws(StrictVerifier(), tree, logits, sampler, draws)
    assert set(counts) <= set(joint)  # truncated tokens (p = 0) never appear
    assert sum(len(o) > 1 for o in counts.elements()) > draws // 4  # drafts are actually accepted
    assert chi_square_pvalue(counts, joint, draws) > 1e-3


def test_strict_rejects_a_repeated_sibling_and_stays_exact():
    # root -> 0, 1, 0 (a duplicate of the first child): the duplicate has residual mass 0
    tree = tree_of([7, 0, 1, 0, 2], [-1, 0, 0, 0, 1])
    logits = target_logits(5, seed=4, scale=0.8, tree=tree)
    sampler = Sampler(1.0, seed=5)
    verifier = StrictVerifier()
    verifier.sampler = sampler
    draws = 5_000
    results = [verifier.verify(tree, logits) for _ in range(draws)]
    assert all(r.path[:2] != [0, 3] for r in results)
    counts = Counter(tuple(r.tokens) for r in results)
    assert chi_square_pvalue(counts, exact_joint(tree, sampler.probs(logits)), draws) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_same_test():
    """The test has power: accepting each child with p(x) (not the residual) is detected."""
    tree = depth2_tree()
    logits = target_logits(8, seed=3, tree=tree)
    sampler = Sampler(1.0, seed=11)
    probs = sampler.probs(logits)

    class Naive(StrictVerifier):
        def verify(self, tree, logits):
            from adaptivespec.tree_sampling import earlier_siblings, residual_draw
            from adaptivespec.tree import accepted_path
            from adaptivespec.tree import emit

            parent = tree.parents.clamp(min=0)
            acc = self.sampler.uniform(tree.size) < probs[parent, tree.tokens]
            e = earlier_siblings(tree)
            ok = acc & ~(e & acc.unsqueeze(0)).any(-1)
            ok[0] = True
            last = accepted_path(tree, ok)
            return emit(tree, last, residual_draw(tree, probs, last, self.sampler))

    counts = run_draws(Naive(), tree, logits, sampler, 5_000)
    assert chi_square_pvalue(counts, exact_joint(tree, probs), 5_000) < 1e-6


def test_top_k_one_is_greedy():
    tree, logits = depth2_tree(), target_logits(8, seed=3)
    greedy = StrictVerifier().verify(tree, logits)
    counts = run_draws(StrictVerifier(), tree, logits, Sampler(1.5, top_k=1, seed=0), 200)
    assert list(counts) == [tuple(greedy.tokens)]


def test_same_seed_same_draws():
    tree, logits = depth2_tree(), target_logits(8, seed=3)
    runs = []
    for _ in range(2):
        v = StrictVerifier()
        v.sampler = Sampler(1.0, seed=42)
        runs.append([v.verify(tree, logits).tokens for _ in range(300)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 5


# -- the margin rule's sampling form ---------------------------------------------------------------------
def random_tree(rng: random.Random, n: int):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(V)]
    for i in range(1, n):  # distinct siblings
        used = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(rng.choice([t for t in range(V) if t not in used]))
    return tree_of(tokens, parents)


@pytest.mark.parametrize("params", [dict(kappa=0.5), dict(kappa=0.3, max_promotions=None), dict(kappa=0.7, top_k=3),
                                    dict(form="additive", delta=0.2)])
def test_margin_at_temperature_zero_is_the_greedy_rule(params):
    rng = random.Random(0)
    for trial in range(60):
        tree = random_tree(rng, rng.randrange(2, 12))
        logits = target_logits(tree.size, seed=trial, scale=2.0)
        greedy = MarginVerifier(MarginParams(**params)).verify(tree, logits)
        v = MarginVerifier(MarginParams(**params))
        v.sampler = Sampler(0.0, top_p=0.5, top_k=2, seed=trial)
        assert v.verify(tree, logits) == greedy


def test_margin_without_a_passing_child_is_the_lossless_test():
    tree = depth2_tree()
    logits = target_logits(8, seed=3, tree=tree)
    logits[:, 6] = logits.max(-1).values + 0.5  # token 6, never drafted, is every node's top-1
    kappa_above_every_ratio = 1.0  # only exact ties with the top-1 pass; none here
    strict, margin = StrictVerifier(), MarginVerifier(MarginParams(kappa=kappa_above_every_ratio))
    strict.sampler, margin.sampler = Sampler(1.0, seed=9), Sampler(1.0, seed=9)
    for _ in range(300):
        a, b = strict.verify(tree, logits), margin.verify(tree, logits)
        assert a.tokens == b.tokens and a.path == b.path and b.promoted == 0


def test_margin_accepts_a_near_miss_outright_and_caps_promotions():
    # chain root -> 1 -> 2 -> 3; at each node token 0 is the top-1 and the drafted token is close
    tree = tree_of([7, 1, 2, 3], [-1, 0, 1, 2])
    logits = torch.full((4, V), -6.0)
    for node, drafted in ((0, 1), (1, 2), (2, 3)):
        logits[node, 0], logits[node, drafted] = 2.0, 2.0 + math.log(0.8)
    v = MarginVerifier(MarginParams(kappa=0.7, max_promotions=1))
    v.sampler = Sampler(1.0, seed=1)
    results = [v.verify(tree, logits) for _ in range(400)]
    assert all(r.path[:2] == [0, 1] and r.promoted == 1 for r in results)  # node 1: always, outright
    # below the cap node 2 goes through the lossless test: accepted with p(2 | 1) ~ 0.44
    deeper = sum(len(r.path) > 2 for r in results) / len(results)
    assert 0.3 < deeper < 0.6
    v = MarginVerifier(MarginParams(kappa=0.7, max_promotions=None))
    v.sampler = Sampler(1.0, seed=1)
    assert all(r.path == [0, 1, 2, 3] and r.promoted == 3 for r in (v.verify(tree, logits) for _ in range(50)))


def test_margin_never_accepts_a_truncated_token():
    # the drafted token 1 is outside top_k=1; the additive form with delta=1 would pass any gap
    tree = tree_of([7, 1], [-1, 0])
    logits = torch.full((2, V), -6.0)
    logits[0, 0], logits[0, 1] = 2.0, 1.9
    v = MarginVerifier(MarginParams(form="additive", delta=1.0))
    v.sampler = Sampler(1.0, top_k=1, seed=0)
    assert all(v.verify(tree, logits).tokens == [0] for _ in range(100))


# -- refusals ----------------------------------------------------------------------------------------------
def test_a_verifier_without_a_sampling_form_is_refused():
    from adaptivespec.plugins import get_plugin_host

    host = get_plugin_host()
    if "fly" not in host.verifiers:
        pytest.skip("the FLy plugin is not installed")
    with pytest.raises(ConfigError, match=r"generation.temperature: verifier 'fly' has no sampling form"):
        load_config(None, ["verifier.name=fly", "generation.temperature=0.7"])
    load_config(None, ["verifier.name=fly", "generation.temperature=0"])  # greedy: fine
    load_config(None, ["verifier.name=fly", "model.drafter=null", "generation.temperature=0.7"])  # no verification


def test_cli_refusal_is_one_line_exit_2():
    cmd = [sys.executable, "-m", "adaptivespec.cli", "generate", "--config", "configs/fly.yaml", "--prompt", "hi",
           "--set", "generation.temperature=0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if "unknown verifier" in proc.stderr:
        pytest.skip("the FLy plugin is not installed")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "verifier 'fly' has no sampling form" in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("generation.temperature=-0.1", "generation.temperature: expected a number in [0, inf], got -0.1"),
    ("generation.top_p=0", "generation.top_p: expected a number in (0, 1], got 0"),
    ("generation.top_k=0", "generation.top_k: expected a positive integer, got 0"),
    ("generation.min_p=1.5", "generation.min_p: expected a number in [0, 1], got 1.5"),
    ("generation.seed=1.5", "generation.seed: expected an integer, got 1.5"),
])
def test_generation_keys_are_validated(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


# -- the real model --------------------------------------------------------------------------------------
def _engine(*overrides):
    from adaptivespec.decode import Engine

    return Engine(load_config(None, ["runtime.dtype=float32", *overrides]))


@pytest.mark.model
@pytest.mark.parametrize("drafter", [[], ["model.drafter=null"], ["policy.name=dcs"]])
def test_top_k_one_at_temperature_one_is_greedy_decoding(drafter, greedy_reference):
    """Truncation to the top-1 leaves one token with mass: sampling must reproduce greedy decoding."""
    from shared_prompts import PROMPTS

    engine = _engine("generation.temperature=1.0", "generation.top_k=1", *drafter)
    ids, ref = greedy_reference(PROMPTS[0], 16)
    assert engine.generate_ids(ids, max_new_tokens=16, seed=5).token_ids == ref


@pytest.mark.model
@pytest.mark.parametrize("drafter", [[], ["model.drafter=null"]])
def test_seeded_runs_repeat_bit_for_bit_and_seeds_differ(drafter):
    engine = _engine("generation.temperature=1.0", *drafter)
    ids = engine.encode("Name a color.")
    runs = {s: engine.generate_ids(ids, max_new_tokens=6, seed=s).token_ids for s in range(4)}
    assert engine.generate_ids(ids, max_new_tokens=6, seed=2).token_ids == runs[2]
    assert len({tuple(r) for r in runs.values()}) > 1


@pytest.mark.model
def test_speculative_first_tokens_are_distributed_as_plain_sampling():
    """Cheap version of adaptivespec.analysis.sampling_check (whose 300-sample run is in the notes): 48 seeded
    2-token samples of eagle3's static tree and of plain decoding, top-k 5 so the sample is dense."""
    from adaptivespec.analysis import sampling_check as check

    settings = ["generation.temperature=1.0", "generation.top_k=5", "policy.nsteps=3", "policy.topk=4", "policy.ndt=8"]
    out = {}
    for k, (name, extra) in enumerate((("ar", ["model.drafter=null"]), ("eagle3", []))):
        engine = _engine(*settings, *extra)
        ids = engine.encode(check.PROMPT)
        seeds = range(k * check.SEED_STRIDE, k * check.SEED_STRIDE + 48)  # independent samples
        out[name] = [tuple(engine.generate_ids(ids, max_new_tokens=2, seed=s).token_ids) for s in seeds]
    assert len(set(out["ar"])) > 3 and len(set(out["eagle3"])) > 3  # both actually vary across seeds
    result = check.compare(out["ar"], out["eagle3"], permutations=400)
    assert min(r["p"] for r in result.values()) > 0.01, result


def test_permutation_test_has_power():
    from adaptivespec.analysis import sampling_check as check

    rng = random.Random(0)
    a = [(rng.choices([1, 2, 3], [0.5, 0.3, 0.2])[0], rng.randrange(3)) for _ in range(64)]
    b = [(rng.choices([1, 2, 3], [0.2, 0.3, 0.5])[0], rng.randrange(3)) for _ in range(64)]
    c = [(rng.choices([1, 2, 3], [0.5, 0.3, 0.2])[0], rng.randrange(3)) for _ in range(64)]
    assert check.compare(a, b, permutations=400)["first"]["p"] < 0.01
    assert check.compare(a, c, permutations=400)["first"]["p"] > 0.05


@pytest.mark.model
def test_cli_record_seeds(tmp_path, capsys):
    """Record i uses generation.seed + i unless it carries "seed": equal seeds, equal outputs."""
    from adaptivespec.cli import main

    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "Name a color.", "id": "a"}, {"prompt": "Name a color.", "id": "b", "seed": 0},
            {"prompt": "Name a color.", "id": "c", "seed": 7}, {"prompt": "Name a color.", "id": "d"},
            {"prompt": "Name a color.", "id": "e", "seed": 4}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["generate", "--config", "configs/ar.yaml", "--prompts", str(prompts), "--json", "--max-new-tokens", "5",
            "--set", "generation.temperature=1.0", "--set", "generation.seed=4", "--set", "runtime.dtype=float32"]
    assert main(argv) == 0
    out = {r["id"]: r["token_ids"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert out["a"] == out["e"]  # a: 4 + 0; e: its own 4
    assert out["d"] == out["c"]  # d: 4 + 3; c: its own 7
    assert len({tuple(v) for v in out.values()}) >= 2


def test_prompts_file_seed_is_validated(tmp_path):
    from adaptivespec.cli import read_prompts
    from adaptivespec.errors import AdaptiveSpecError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x", "seed": -3}\n')
    with pytest.raises(AdaptiveSpecError, match='p.jsonl:1: "seed": expected a non-negative integer, got -3'):
        read_prompts(str(path))


def test_greedy_ids_is_argmax_first_maximum_included():
    """The fast greedy pick must be torch's argmax exactly, ties (common in bfloat16 logits) included."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8, 49152).to(dtype)
        x[:, [7, 300, 40000]] = x.max() + 1  # three-way ties of every row's maximum
        coarse = (torch.randn(4, 1000) * 2).round().to(dtype)  # many ties anywhere
        for t in (x, coarse, x[3]):
            assert torch.equal(greedy_ids(t), t.argmax(-1))
        assert greedy_ids(x).tolist() == [7] * 8
