"""adaptivespec.analysis.cost_aware_trace: one cost_aware engine over prompts in order, its learned state after each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptivespec.analysis import cost_aware_trace

pytestmark = pytest.mark.model  # loads the embedded target

CONFIG = Path(__file__).parents[1] / "configs" / "cost-aware.yaml"

ROWS = [{"question_id": "a", "category": "mix:math", "turns": ["What is 12 times 7? Answer briefly."]},
        {"question_id": "b", "category": "mix:code", "turns": ["Write a Python function that adds two numbers."]}]


def test_the_trace_follows_one_engine_across_prompts(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert cost_aware_trace.main(["--data", str(data), "--config", str(CONFIG), "--max-new-tokens", "12", "--set", "runtime.dtype=float32",
                                   "--set", "policy.costs=profile"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("mix:math") and lines[1].startswith("mix:code")
    assert lines[2].startswith("pooled tau") and "target forwards" in lines[2]

    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    engine = Engine(load_config(str(CONFIG), ["runtime.dtype=float32", "policy.costs=profile"]))  # priced as shipped
    first = engine.policy.continuation()
    rows = list(cost_aware_trace.trace(engine, ROWS, 12))
    assert [r["id"] for r in rows] == ["a", "b"]
    for r in rows:
        assert 1 <= r["tokens"] <= 12 and 1.0 <= r["tau"] == pytest.approx(r["tokens"] / r["forwards"], abs=1e-3)
        assert 0 <= r["share_ge3"] <= 1 and r["max_accepted"] >= 1 and len(r["continuation"]) == len(first)
    assert rows[-1]["continuation"] != [round(c, 3) for c in first]  # the engine learnt from what it verified


def test_a_policy_without_continuation_rates_is_a_one_line_error(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    assert cost_aware_trace.main(["--data", str(data), "--config", str(CONFIG.with_name("eagle3.yaml"))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--config" in err and "'static'" in err and "expected cost_aware" in err
