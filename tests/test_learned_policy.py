"""The ``learned`` tree policy: its fitted file, its choices, its hedge, train-policy, and losslessness."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from adaptivespec.config import load_config
from adaptivespec.costmodel import CostModel
from adaptivespec.learned_model import BASIS, FORMAT, ShapeModel, basis
from adaptivespec.plugins import get_plugin_host
from adaptivespec.policies.learned import LearnedParams, LearnedPolicy
from adaptivespec.types import StepRecord, StepSignals, TreeShape

Z = [0.0] * (len(BASIS) - 1)  # weights of every basis term but the intercept
COST = {"fixed": 36.0, "per_context": 0.01, "per_draft_level": 1.6, "per_draft_node": 0.08, "per_verified_token": 1.0}


def fitted(shapes=((3, 4, 8), (1, 4, 4), (5, 2, 8)), weights=None, static=(3, 4, 8), mode="head") -> dict:
    """A fitted file whose expected accepted tokens are ``weights[s][0]`` (intercept only) unless given."""
    if weights is None:
        weights = [[1.0 + i] + [0.0] * (len(BASIS) - 1) for i in range(len(shapes))]
    return {"format": FORMAT, "mode": mode, "basis": list(BASIS), "shapes": [list(s) for s in shapes],
            "weights": weights, "static": list(static), "cost_ms": COST, "extra_slots": 8}


def write(tmp_path, data, name="m.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def sig(step=0, p1=0.5, last=-1, context=100, entropy=1.0):
    return StepSignals(step=step, draft_top1_prob=p1, last_accepted=last, context=context, draft_entropy=entropy)


def record(shape, accepted, step=0, ms=50.0):
    return StepRecord(step=step, shape=shape, tree_size=shape.ndt, accepted=accepted, promoted=0, new_tokens=accepted + 1,
                      draft_ms=ms / 2, verify_ms=ms / 2, other_ms=0.0)


def test_the_shipped_fitted_files_load_and_the_policy_only_returns_declared_shapes():
    for cfg in ("configs/learned.yaml", "configs/learned-hybrid.yaml"):
        c = load_config(cfg, [])
        pol = get_plugin_host().policies.get("learned").cls(c.policy.params)
        rng = random.Random(0)
        pol.reset()
        chosen = set()
        for i in range(300):
            s = pol.next_shape(StepSignals(step=i, draft_top1_prob=rng.random(), last_accepted=rng.randint(-1, 6),
                                           context=rng.randint(10, 3000), draft_entropy=rng.uniform(0, 8),
                                           source_match=rng.randint(0, 8), source_nodes=rng.randint(0, 16),
                                           source_top=rng.random()))
            assert s in pol.shapes()
            chosen.add(s)
            pol.observe(record(s, rng.randint(0, s.nsteps), i))
        assert len(chosen) >= 2, cfg  # the choice depends on the signals
        assert pol.decide_us < 500  # under 2% of a ~50 ms CPU step, with a wide margin


def test_the_choice_maximises_expected_tokens_per_modelled_millisecond(tmp_path):
    # (1,4,4) expects 2 tokens (1 + 1 accepted), (3,4,8) 1; (5,2,8) 4 but it costs more
    m = ShapeModel.load(write(tmp_path, fitted(weights=[[0.0] + Z, [1.0] + Z, [3.0] + Z])))
    cost = CostModel(**COST)
    rates = [(1 + e) / cost.step_ms(s.ndt, s.nsteps - 1, (s.nsteps - 1) * s.topk, 100) for s, e in zip(m.shapes, (0, 1, 3))]
    assert m.choose(basis(0.5, 1.0, 1.5, -1, 100, 0, 0, 0.0, False, 0.0, 0.8), 100) == int(np.argmax(rates))
    # expected tokens are capped at the depth: a huge intercept cannot make a depth-1 tree accept 9
    m2 = ShapeModel(fitted(shapes=((1, 4, 4),), weights=[[9.0] + Z], static=(1, 4, 4)))
    assert m2.expected(basis(0.5, 1.0, 1.5, -1, 100, 0, 0, 0.0, False, 0.0, 0.8)).tolist() == [1.0]


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.pop("weights"), "missing key 'weights'"),
    (lambda d: d.update(weights=[[1.0]]), f"weights: expected 3 x {len(BASIS)}"),
    (lambda d: d.update(format="other/1"), "format: expected"),
    (lambda d: d.update(shapes=[[3, 4, 99], [1, 4, 4], [5, 2, 8]]), "shapes: expected"),
    (lambda d: d.update(mode="both"), "mode: expected 'head' or 'hybrid'"),
    (lambda d: d.update(cost_ms={"fixed": 1.0}), "cost_ms: missing per_verified_token"),
])
def test_fitted_file_errors_are_one_line_naming_the_file_and_key(tmp_path, change, needle):
    data = fitted()
    change(data)
    path = write(tmp_path, data)
    with pytest.raises(ValueError) as err:
        ShapeModel.load(path)
    msg = str(err.value)
    assert needle in msg and path in msg and "\n" not in msg


def test_a_missing_fitted_file_names_the_key_and_the_shipped_ones():
    with pytest.raises(ValueError, match=r"model: file 'nope.json' not found .*learned-smollm2-135m-embedded.json"):
        LearnedPolicy(LearnedParams(model="nope.json"))
    with pytest.raises(ValueError, match=r"expected null or \[nsteps, topk, ndt\]"):
        LearnedParams(static=[3, 4])


def run_hedged(pol, learned_acc, static_acc, steps=60):
    arms = []
    pol.reset()
    for i in range(steps):
        s = pol.next_shape(sig(step=i))
        arms.append(pol.state()["arm"])
        pol.observe(record(s, learned_acc if pol.state()["arm"] == "learned" else static_acc, i))
    return arms


def test_the_hedge_falls_back_to_static_when_the_learned_choice_does_worse(tmp_path):
    # the model always picks (1,4,4) (most expected tokens per ms); measured, it accepts nothing
    data = fitted(shapes=((1, 4, 4), (3, 4, 8)), weights=[[5.0] + Z, [0.0] + Z])
    pol = LearnedPolicy(LearnedParams(model=write(tmp_path, data)))
    assert pol.next_shape(sig()) == TreeShape(1, 4, 4)
    arms = run_hedged(pol, learned_acc=0, static_acc=3)
    assert arms[:3].count("learned") >= 2  # it starts with the learned arm
    assert arms[-30:].count("static") >= 26  # then the static shape leads; learned is only probed
    assert pol.state()["lead"] == "static"
    # when the learned choice does better, the static shape is only probed
    arms = run_hedged(pol, learned_acc=1, static_acc=0)
    assert arms[-30:].count("learned") >= 26 and pol.state()["lead"] == "learned"
    # without the hedge, the learned shape always
    pol = LearnedPolicy(LearnedParams(model=write(tmp_path, data), hedge=False))
    assert set(run_hedged(pol, learned_acc=0, static_acc=3)) == {"learned"}


def test_train_policy_cli_fits_and_writes_a_card_on_a_tiny_slice(tmp_path, capsys):
    """Synthetic labels stand in for the model (labels are cached per prompt: nothing is relabelled)."""
    from adaptivespec.cli import main
    from adaptivespec.training.policy_data import label_shapes, pick_prompts

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i} things."}) + "\n" for i in range(12)))
    out = tmp_path / "out"
    (out / "labels").mkdir(parents=True)
    shapes = label_shapes()
    gen = torch.Generator().manual_seed(0)
    for j, p in enumerate(pick_prompts([str(data)], 12)):
        n = 40
        p1 = torch.rand(n, generator=gen)
        # deeper trees accept more when the draft is confident
        acc = torch.stack([torch.clamp((p1 * (s.nsteps + s.topk / 4)).round(), max=s.nsteps) for s in shapes], 1)
        torch.save({"id": p.id, "kind": "abc"[j % 3], "prompt_len": 30, "tokens": n + 1, "shapes": [[s.nsteps, s.topk, s.ndt] for s in shapes],
                    "acc": acc.to(torch.int8), "p1": p1, "entropy": 3 * (1 - p1), "top4": (p1 + 0.2).clamp(max=1), "src_match": torch.zeros(n, dtype=torch.int16),
                    "src_nodes": torch.zeros(n, dtype=torch.int16), "src_top": torch.zeros(n), "src_acc": torch.zeros(n, dtype=torch.int8),
                    "selfcheck": [1, 1]}, out / "labels" / f"{p.id}.pt")
    rc = main(["train-policy", "--out", str(out), "--data", str(data), "--per-file", "12", "--mode", "head",
               "--max-shapes", "3", "--no-progress"])
    assert rc == 0
    card = json.loads((out / "card.json").read_text())
    assert card["data"]["train_prompts"] and card["data"]["heldout_prompts"]
    assert not set(card["data"]["train_prompts"]) & set(card["data"]["heldout_prompts"])
    fig = card["models"]["head"]["heldout"]
    assert fig["learned_no_hedge"]["vs_ref"] >= 1.0  # p1 tells the depth: the model gains over one shape
    assert fig["oracle"]["vs_ref"] >= fig["learned_no_hedge"]["vs_ref"]
    m = ShapeModel.load(str(out / "learned-smollm2-135m-embedded.json"))
    assert 1 <= len(m.shapes) <= 3
    md = (out / "card.md").read_text()
    assert "held out" in md and "![head-choices.png](head-choices.png)" in md
    assert (out / "head-choices.png").stat().st_size > 1000 and (out / "head-vs_oracle.png").stat().st_size > 1000
    # per kind too: the oracle bounds every policy on each kind's prompts
    kinds = fig["per_kind"]
    assert set(kinds) == {"a", "b", "c"} and sum(k["prompts"] for k in kinds.values()) == fig["prompts"]
    assert all(k["oracle"]["vs_eagle3"] >= k["learned_no_hedge"]["vs_eagle3"] for k in kinds.values())
    assert "| kind | prompts |" in md

    # --evaluate: the fitted file replayed on the held-out prompts alone, nothing refitted
    fitted = out / "learned-smollm2-135m-embedded.json"
    before = fitted.read_bytes()
    again = tmp_path / "again"
    (again / "labels").mkdir(parents=True)
    for path in (out / "labels").glob("*.pt"):
        if path.stem in card["data"]["heldout_prompts"]:  # only those: anything else would be labelled with the model
            (again / "labels" / path.name).write_bytes(path.read_bytes())
    rc = main(["train-policy", "--out", str(again), "--data", str(data), "--per-file", "12", "--evaluate", str(fitted),
               "--no-progress"])
    assert rc == 0 and fitted.read_bytes() == before
    replay = json.loads((again / "card.json").read_text())["models"]["head"]["heldout"]
    assert replay["learned"]["tok_per_s"] == pytest.approx(fig["learned"]["tok_per_s"])
    assert replay["per_kind"].keys() == kinds.keys()
    assert main(["train-policy", "--out", str(again), "--data", str(data), "--per-file", "12", "--evaluate",
                 str(data)]) == 2
    assert "--evaluate" in capsys.readouterr().err


def test_train_policy_refuses_an_evaluation_set(tmp_path, capsys):
    from adaptivespec.cli import main

    bad = tmp_path / "humaneval" / "x.jsonl"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert main(["train-policy", "--out", str(tmp_path / "o"), "--data", str(bad), "--per-file", "1"]) == 2
    assert "looks like an evaluation set" in capsys.readouterr().err
    assert not (tmp_path / "o" / "labels").exists()  # refused before any labelling


@pytest.mark.model
@pytest.mark.parametrize("config", ["learned.yaml", "learned-hybrid.yaml"])
def test_learned_configs_with_the_strict_verifier_are_lossless_in_float32(config, greedy_reference):
    from pathlib import Path

    from adaptivespec.decode import Engine
    from shared_prompts import PROMPTS

    engine = Engine(load_config(Path(__file__).parents[1] / "configs" / config, ["runtime.dtype=float32"]))
    shapes = set()
    for text in PROMPTS[:2]:
        ids, ref = greedy_reference(text, 24)
        res = engine.generate_ids(ids, max_new_tokens=24)
        assert res.token_ids == ref, text
        shapes |= {r.shape for r in res.records}
    assert shapes <= set(engine.policy.shapes())
