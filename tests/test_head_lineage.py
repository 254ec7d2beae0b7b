"""adaptivespec.analysis.head_lineage: validation points of warm-started runs placed on one token axis."""

from __future__ import annotations

import json
from pathlib import Path

from adaptivespec.analysis import head_lineage as lineage_mod


def write_run(root: Path, name: str, vals: list[tuple[int, int, list[float]]], val_tokens: int = 1000) -> Path:
    run = root / name
    (run / "training").mkdir(parents=True)
    rows = [{"kind": "start", "step": 0}]
    for step, tokens, acc in vals:
        rows.append({"step": step, "tokens": tokens, "val_acc": acc, "val_tokens": val_tokens,
                     "val_acc_by_kind": {"math": [acc[0] + 0.1] + acc[1:]}})
        rows.append({"step": step + 1, "tokens": tokens + 10, "loss": 1.0})   # training rows are skipped
    (run / "training" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_later_runs_start_where_the_earlier_ones_ended(tmp_path):
    a = write_run(tmp_path, "a", [(0, 0, [0.5, 0.3]), (10, 400, [0.6, 0.4])])
    b = write_run(tmp_path, "b", [(0, 0, [0.6, 0.4]), (5, 250, [0.7, 0.5])])
    pts = lineage_mod.lineage([a, b])
    assert [p["tokens"] for p in pts] == [0, 400, 400, 650]
    assert [round(p["acc_mean"], 6) for p in pts] == [0.4, 0.5, 0.5, 0.6]
    assert round(pts[-1]["by_kind"]["math"], 6) == 0.8


def test_runs_scored_on_other_records_are_refused(tmp_path, capsys):
    a = write_run(tmp_path, "a", [(0, 0, [0.5])])
    b = write_run(tmp_path, "b", [(0, 0, [0.6])], val_tokens=999)
    assert lineage_mod.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "999" in err and "1000" in err


def test_writes_the_plot(tmp_path):
    a = write_run(tmp_path, "a", [(0, 0, [0.5, 0.3]), (10, 400, [0.6, 0.4])])
    out = tmp_path / "lineage.png"
    assert lineage_mod.main([str(a), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
