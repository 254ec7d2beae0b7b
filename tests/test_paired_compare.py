"""adaptivespec.analysis.paired_compare: per-category comparison on the prompts where two contenders agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptivespec.analysis import paired_compare as paired


def record(config: str, pid: int, text: str, tokens: int, wall: float, forwards: int) -> dict:
    return {"config": config, "id": str(pid), "text": text, "new_tokens": tokens, "wall_seconds": wall,
            "target_forwards": forwards}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    questions = [{"question_id": 1, "category": "translation", "turns": ["a"]},
                 {"question_id": 2, "category": "translation", "turns": ["b"]},
                 {"question_id": 3, "category": "writing", "turns": ["c"]}]
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "settings.json").write_text(json.dumps({"dataset": "specbench", "data": str(data)}))
    recs = [record("x", 1, "same", 10, 1.0, 4), record("y", 1, "same", 10, 2.0, 5),
            record("x", 2, "loop", 100, 1.0, 20), record("y", 2, "short", 5, 1.0, 5),
            record("x", 3, "w", 8, 1.0, 8), record("y", 3, "w", 8, 0.5, 2)]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp_path


def test_only_identical_texts_enter_the_paired_figures(run: Path) -> None:
    records, category = paired.load_run(run)
    assert category == {"1": "translation", "2": "translation", "3": "mt_bench"}
    rows = {r["category"]: r for r in paired.compare(records, category, "x", "y")}
    tr = rows["translation"]
    assert (tr["prompts"], tr["identical"]) == (2, 1)
    assert (tr["same_forwards_a"], tr["same_forwards_b"]) == (4, 5)
    assert tr["same_tps_a"] == pytest.approx(10.0) and tr["same_tps_b"] == pytest.approx(5.0)
    assert tr["tps_a"] == pytest.approx(55.0) and tr["tau_b"] == pytest.approx(15 / 10)  # all prompts: both texts
    ov = rows["overall"]
    assert (ov["prompts"], ov["identical"], ov["same_forwards_a"], ov["same_forwards_b"]) == (3, 2, 12, 7)
    assert list(rows) == ["mt_bench", "translation", "overall"]


def test_cli_prints_a_table_and_refuses_an_unknown_contender(run: Path, capsys) -> None:
    assert paired.main([str(run), "--a", "x", "--b", "y", "--json", str(run / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "| translation | 2 |" in out and "2.00x" in out  # identical prompt: 10 vs 5 tok/s
    assert len(json.loads((run / "out.json").read_text())) == 3
    assert paired.main([str(run), "--a", "x", "--b", "z"]) == 2
    err = capsys.readouterr().err
    assert "--b" in err and "'z'" in err and "x, y" in err
    assert paired.main([str(run.parent), "--a", "x", "--b", "y"]) == 2
