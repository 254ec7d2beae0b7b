"""adaptivespec.analysis.served_cost: a served step's cost model from ``serve --trace`` lines."""

from __future__ import annotations

import json

import pytest

from adaptivespec.analysis import served_cost
from adaptivespec.costmodel import CostModel


def write_trace(path, steps):
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))


def test_fit_recovers_a_linear_step_cost_and_ignores_stalls(tmp_path):
    # 25 ms fixed, 0.5 ms per verified row, 2 ms per draft level, 0.05 ms per drafted node
    def ms(bs, n, k, d):
        return 25 + 0.5 * bs * d + 2 * n + 0.05 * bs * n * k

    # each step: ms (draft + verify) is all but 5 ms of it; the next line's gap_ms carries the 5 ms
    steps = []
    for bs in (1, 2, 4, 8):
        for shape in ((1, 2, 2), (2, 3, 5), (3, 4, 8), (5, 2, 8)):
            for i in range(7):
                steps.append({"step": i, "shape": list(shape), "bs": bs, "accepted": 1,
                              "ms": ms(bs, *shape) * (1 + 0.01 * (i % 3 - 1)) - 5, "gap_ms": 5.0 if i else None})
    steps.append({"step": 0, "shape": [3, 4, 8], "bs": 1, "accepted": 0, "ms": 90000.0, "gap_ms": None})  # a stall
    steps.append({"step": 1, "shape": [3, 4, 8], "bs": 1, "accepted": 0, "ms": 20.0, "gap_ms": 1.0})
    trace = tmp_path / "t.steps.jsonl"
    write_trace(trace, steps)
    out = tmp_path / "p.json"
    assert served_cost.main([str(trace), "--out", str(out), "--note", "synthetic"]) == 0
    model = CostModel.load(out)
    assert model.fixed == pytest.approx(25, rel=0.05)
    assert model.per_verified_token == pytest.approx(0.5, rel=0.05)
    assert model.per_draft_level == pytest.approx(2, rel=0.1)
    assert model.meta["backend"] == "sglang" and model.meta["measured"] == "synthetic"
    # 6 of 7 steps per cell have a next line with a gap (the last one of a cell does not: the batch changed)
    assert model.meta["per_cell"]["bs=8 (3, 4, 8)"]["steps"] == 6


def test_missing_or_untimed_traces_are_one_line_exit_2(tmp_path, capsys):
    assert served_cost.main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "p.json")]) == 2
    assert "not found" in capsys.readouterr().err
    old = tmp_path / "old.jsonl"
    write_trace(old, [{"step": 0, "shape": [3, 4, 8], "bs": 1, "accepted": 1}] * 10)
    assert served_cost.main([str(old), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step times" in err


def test_a_whole_step_is_its_draft_and_verify_plus_the_next_lines_gap():
    lines = [{"bs": 2, "shape": [2, 3, 5], "ms": 40.0, "gap_ms": None},
             {"bs": 2, "shape": [3, 4, 8], "ms": 50.0, "gap_ms": 6.0},
             {"bs": 3, "shape": [3, 4, 8], "ms": 55.0, "gap_ms": None},  # a new request joined
             {"bs": 3, "shape": [1, 2, 2], "ms": 45.0, "gap_ms": 7.0}]
    assert served_cost.step_times(lines) == [(2, (2, 3, 5), 46.0), (3, (3, 4, 8), 62.0)]
    old = [{"bs": 1, "shape": [3, 4, 8], "ms": 44.0}]  # written before gap_ms: ms alone
    assert served_cost.step_times(old) == [(1, (3, 4, 8), 44.0)]
