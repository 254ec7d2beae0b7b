"""Per-step trace: generate --trace writes one record per step; plot-trace draws it."""

from __future__ import annotations

import json

import pytest

from adaptivespec.cli import main

pytestmark = pytest.mark.model


def test_trace_and_plot(tmp_path, random_head_dir, capsys):
    trace, png = tmp_path / "t.jsonl", tmp_path / "t.png"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "id": "a"}\n{"prompt": "Count to three.", "id": "b"}\n')
    code = main(["generate", "--config", "configs/adaptivespec-dynamic.yaml", "--prompts", str(prompts),
                 "--set", f"model.drafter={random_head_dir}", "--max-new-tokens", "6", "--json", "--trace", str(trace)])
    assert code == 0
    outs = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [o["id"] for o in outs] == ["a", "b"]
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    for o in outs:  # one record per speculative step (prefill is not a step)
        mine = [r for r in rows if r["id"] == o["id"]]
        assert len(mine) == o["stats"]["target_forwards"] - 1
        assert sum(r["new_tokens"] for r in mine) == o["stats"]["new_tokens"] - 1
    r = rows[0]
    assert len(r["shape"]) == 3 and r["tree_size"] == r["shape"][2]
    for key in ("accepted", "promoted", "draft_ms", "verify_ms", "other_ms", "signals", "policy_state"):
        assert key in r
    assert 0.0 <= r["signals"]["draft_top1_prob"] <= 1.0
    assert main(["plot-trace", str(trace), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_trace_missing_file(tmp_path, capsys):
    assert main(["plot-trace", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert "none.jsonl: file not found" in capsys.readouterr().err
