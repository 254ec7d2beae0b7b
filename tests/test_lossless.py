"""Lossless on the real model: every decoding path reproduces transformers' greedy output.

float32 throughout (bfloat16 multi-token and single-token passes are not bit-identical).
Two drafters: a random head (almost nothing accepted) and an *oracle* head that usually proposes
the reference continuation, with noise so that the right token is sometimes only 2nd or 3rd
choice: acceptance is high and accepted paths leave the first branch, which exercises cache
compaction and the drafter's extension with the accepted path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from adaptivespec.config import load_config
from adaptivespec.decode import Engine
from adaptivespec.drafter import Eagle3Drafter

from shared_prompts import PROMPTS

pytestmark = pytest.mark.model

SHAPES = {"chain": (7, 1, 8), "wide": (3, 4, 10), "deep": (6, 3, 16)}
POLICIES = {name: [f"policy.nsteps={n}", f"policy.topk={k}", f"policy.ndt={d}"] for name, (n, k, d) in SHAPES.items()}
POLICIES["dcs"] = ["policy.name=dcs"]  # shapes change every step between (3,4,4) and (7,1,8)
# the policy exactly as configs/adaptivespec-dynamic.yaml ships it (CPU-tuned ends)
_SHIPPED = yaml.safe_load((Path(__file__).parents[1] / "configs" / "adaptivespec-dynamic.yaml").read_text())["policy"]
POLICIES["dcs-shipped"] = [f"policy.{k}={json.dumps(v)}" for k, v in _SHIPPED.items()]
# depth-1 trees among the shapes of one sequence (the ends that shipped until 2026-12-05)
POLICIES["dcs-depth1"] = ["policy.name=dcs", "policy.wide=[1,4,4]", "policy.deep=[5,2,8]", "policy.levels=4",
                          "policy.weight=0.7"]
# the cost-aware policy as configs/cost-aware.yaml ships it: levels and verify budget vary within a step
_COST = yaml.safe_load((Path(__file__).parents[1] / "configs" / "cost-aware.yaml").read_text())["policy"]
POLICIES["cost-aware-shipped"] = [f"policy.{k}={json.dumps(v)}" for k, v in _COST.items()]
# the same with a tree at every step (min_keep 1): the oracle's drafts, which the real head's calibration
# values low, are verified too (shipped, min_keep 0 verifies the root alone where they do not pay)
POLICIES["cost-aware-trees"] = [*POLICIES["cost-aware-shipped"], "policy.min_keep=1"]
# the post-draft policy as configs/post-draft.yaml ships it: depth, branching and verified subtree vary per step
_POST = yaml.safe_load((Path(__file__).parents[1] / "configs" / "post-draft.yaml").read_text())["policy"]
POLICIES["post-draft-shipped"] = [f"policy.{k}={json.dumps(v)}" for k, v in _POST.items()]
for _name in ("cost-aware-shipped", "cost-aware-trees", "post-draft-shipped"):  # priced by the shipped profile, as
    POLICIES[_name].append("policy.costs=profile")  # shipped: not by a table this machine measured for float32


class OracleDrafter(Eagle3Drafter):
    """Boosts the reference token at each position by a random margin in [-1, 3) nats."""

    reference: torch.Tensor
    gen: torch.Generator

    def step(self, tokens, state, positions, mask):
        self._positions = positions
        return super().step(tokens, state, positions, mask)

    def log_probs(self, out_state):
        logits = self.lm_head(self.norm(out_state)).float()
        rows = logits.reshape(-1, logits.shape[-1])
        # one state: the root's, at the last committed position (a padded prefill ran rows past it)
        pos = (self._positions if out_state.dim() > 1 else torch.tensor([self.length - 1])) + 2
        ok = pos < self.reference.shape[0]
        tok = self.reference[pos.clamp(max=self.reference.shape[0] - 1)]
        bump = torch.rand(rows.shape[0], generator=self.gen) * 4 - 1
        r = torch.arange(rows.shape[0])[ok]
        rows[r, tok[ok]] = rows.max(-1).values[ok] + bump[ok]
        return torch.log_softmax(rows.reshape(logits.shape), -1)


def engine_for(overrides):
    return Engine(load_config(None, ["runtime.dtype=float32", *overrides]))


def test_ar_matches_transformers_generate(greedy_reference):
    engine = engine_for(["model.drafter=null"])
    for text in PROMPTS:
        ids, ref = greedy_reference(text)
        res = engine.generate_ids(ids, max_new_tokens=48)
        assert res.token_ids == ref, text
        assert res.stats["target_forwards"] == len(ref)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_random_drafter_static_strict_is_lossless(shape, random_head_dir, greedy_reference):
    n, k, d = SHAPES[shape]
    engine = engine_for([f"model.drafter={random_head_dir}", f"policy.nsteps={n}", f"policy.topk={k}", f"policy.ndt={d}"])
    for text in PROMPTS[:2]:  # nothing is accepted: two prompts cover this path; the oracle covers five
        ids, ref = greedy_reference(text)
        assert engine.generate_ids(ids, max_new_tokens=48).token_ids == ref, text


@pytest.mark.parametrize("policy", list(POLICIES))
def test_oracle_drafter_strict_is_lossless(policy, full_vocab_head_dir, greedy_reference):
    engine = engine_for([f"model.drafter={full_vocab_head_dir}", *POLICIES[policy]])
    drafter = engine.runtime.drafter
    drafter.__class__ = OracleDrafter
    drafter.gen = torch.Generator().manual_seed(0)
    paths, shapes, sizes = [], set(), set()
    commit = engine.runtime.commit
    engine.runtime.commit = lambda tree, res, hidden: (paths.append(res.path), commit(tree, res, hidden))
    try:
        forwards = tokens = 0
        for text in PROMPTS:
            ids, ref = greedy_reference(text)
            drafter.reference = torch.tensor(ids + ref)
            res = engine.generate_ids(ids, max_new_tokens=48)
            assert res.token_ids == ref, text
            shapes |= {r.shape for r in res.records}
            sizes |= {r.tree_size for r in res.records}
            forwards += res.stats["target_forwards"]
            tokens += res.stats["new_tokens"]
    finally:
        drafter.__class__ = Eagle3Drafter
    # the test really exercised acceptance (DCS's shipped and depth-1 ends draft shallower trees, and
    # the cost-aware policy, whose calibration prior is the real head's, includes depth-1 trees: less per step)
    shallow = ("dcs-shipped", "dcs-depth1", "cost-aware-trees", "post-draft-shipped")
    if policy == "cost-aware-shipped":  # the oracle's drafts do not pay at the real head's calibration: root alone, lossless
        assert 1 in sizes
        return
    assert tokens / forwards > (1.5 if policy in shallow else 1.8)
    # post_draft values this head's root distribution (not boosted: p ~ 0.003) as worth one row and
    # stops drafting there, so its trees are the root's best child; tests/test_post_draft.py checks its
    # varying depth, budget and branches losslessly on the real head
    if any(s.topk > 1 for s in shapes) and policy != "post-draft-shipped":
        assert any(p != list(range(len(p))) for p in paths)  # accepted paths that are not the first-ranked chain
    if policy.startswith("cost"):  # the verify budget really varied within the one drafting shape
        assert len(sizes) >= 3
    if policy.startswith("dcs"):  # the policy really switched shapes
        assert len(shapes) >= (3 if policy == "dcs" else 2)


def test_generation_stops_exactly_at_limit_and_eos(full_vocab_head_dir, greedy_reference, smol32):
    engine = engine_for([f"model.drafter={full_vocab_head_dir}", "policy.nsteps=7", "policy.topk=1", "policy.ndt=8"])
    drafter = engine.runtime.drafter
    drafter.__class__ = OracleDrafter
    drafter.gen = torch.Generator().manual_seed(1)
    try:
        ids, ref = greedy_reference(PROMPTS[2], 48)
        drafter.reference = torch.tensor(ids + ref)
        for limit in (1, 5, 13):
            res = engine.generate_ids(ids, max_new_tokens=limit)
            assert res.token_ids == ref[:limit]
        eos = smol32[1].eos_token_id
        full = engine.generate_ids(ids, max_new_tokens=48)
        if eos in ref:  # short answers end with EOS: generation stops right there, EOS included
            assert full.token_ids == ref[: ref.index(eos) + 1]
    finally:
        drafter.__class__ = Eagle3Drafter


# -- candidate sources: retrieval fused with the head (hybrid.yaml) and alone (retrieval.yaml) ------
REPEATING = [
    "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Rename the variable x to total in this code and show the whole code:\ndef f(x):\n    x = x + 1\n    return x * x",
]
RETRIEVAL_CONFIGS = {  # name: (config file, overrides, prompts)
    "hybrid": ("hybrid.yaml", [], [*REPEATING, PROMPTS[0]]),
    "hybrid-skip-draft": ("hybrid.yaml", ["sources=[{name: retrieval, extra_slots: 4, skip_draft_match: 2}]"], REPEATING[:1]),
    "retrieval": ("retrieval.yaml", [], [*REPEATING, PROMPTS[0]]),
    "cost-aware-hybrid": ("cost-aware-hybrid.yaml", ["policy.costs=profile"], [*REPEATING, PROMPTS[0]]),  # priced as
    "post-draft-hybrid": ("post-draft-hybrid.yaml", ["policy.costs=profile"], [*REPEATING, PROMPTS[0]]),  # shipped
}


@pytest.mark.parametrize("name", list(RETRIEVAL_CONFIGS))
def test_retrieval_configs_are_lossless(name, greedy_reference):
    file, extra, prompts = RETRIEVAL_CONFIGS[name]
    config = Path(__file__).parents[1] / "configs" / file
    engine = Engine(load_config(config, ["runtime.dtype=float32", *extra]))
    by_source: dict[str, int] = {}
    sizes = set()
    for text in prompts:
        ids, ref = greedy_reference(text)
        res = engine.generate_ids(ids, max_new_tokens=48)
        assert res.token_ids == ref, text
        for k, v in res.stats["accepted_by_source"].items():
            by_source[k] = by_source.get(k, 0) + v
        sizes |= {r.tree_size for r in res.records}
    assert by_source["retrieval"] > 10  # copied spans were really drafted from the context
    if "head" in by_source and name in ("hybrid", "cost-aware-hybrid", "post-draft-hybrid"):
        assert by_source["head"] > 0
    policy = engine.config.policy.params
    if hasattr(policy, "buckets"):  # a variable budget (the policy's cost rule): within the bank's rows
        assert max(sizes) <= max(policy.buckets) + engine.sources[0].extra_slots() and len(sizes) >= 3
    else:
        assert max(sizes) > policy.ndt if engine.sources[0].extra_slots() else max(sizes) <= policy.ndt


# -- chunked prefill and caches reused across generations -------------------------------------------
def test_chunked_prefill_with_reused_caches_is_lossless(greedy_reference):
    """A prompt prefilled in chunks of 5 tokens (the drafter following each chunk), into caches
    reserved once and reused by every generation: transformers' greedy output, and the drafter's
    first distribution as after a one-forward prefill."""
    whole = Engine(load_config(None, ["runtime.dtype=float32", "runtime.prefill_chunk=0"]))
    chunked = Engine(load_config(None, ["runtime.dtype=float32", "runtime.prefill_chunk=5"]))
    chunked.reserve(400)
    buffers = chunked.runtime.cache.layers[0]._k.data_ptr(), chunked.runtime.drafter._k.data_ptr()
    accepted = 0
    for text in (*PROMPTS, PROMPTS[0]):  # lengths up and down, the first one again last
        ids, ref = greedy_reference(text)
        assert len(ids) > 5
        assert whole.runtime.prefill(ids, 48) == chunked.runtime.prefill(ids, 48) == ref[0]
        torch.testing.assert_close(chunked.runtime.root_logp, whole.runtime.root_logp, rtol=1e-4, atol=1e-4)
        assert chunked.runtime.drafter.length == whole.runtime.drafter.length == len(ids)
        res = chunked.generate_ids(ids, max_new_tokens=48)
        assert res.token_ids == ref, text
        # the head drafts from the chunked prefill's states as from the whole one's: the same steps
        assert [r.accepted for r in res.records] == [r.accepted for r in whole.generate_ids(ids, max_new_tokens=48).records]
        accepted += len(res.token_ids) - len(res.records)
    assert accepted > 20  # drafted tokens were accepted
    # every generation fitted the reserved room: nothing was allocated again
    assert (chunked.runtime.cache.layers[0]._k.data_ptr(), chunked.runtime.drafter._k.data_ptr()) == buffers
