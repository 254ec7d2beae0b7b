"""adaptivespec.analysis.tau_ceiling: static shapes and the ceiling replayed on shape_oracle.py's saved trees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptivespec.types import TreeShape

from test_shape_oracle import full_tree, oracle_mod

from adaptivespec.training import counterfactual

from adaptivespec.analysis import tau_ceiling as ceiling

SUB_SHAPES = [(n, 2, ndt) for n in (1, 2, 3) for ndt in range(2, 7) if ndt - 1 <= 2 * n]


@pytest.mark.parametrize("cont", [[5, 7, 9], [6, 8, 0], [4, 4, 4], [5, 7, 1], [6, 8]])
def test_accepted_from_a_saved_record_equals_the_oracle_on_the_tree(cont):
    tree, cont = full_tree(), torch.tensor(cont)
    record = counterfactual.tree_record(tree, cont)  # what the oracle saves: depth, parents, score, match
    want = counterfactual.accepted_for_shapes(tree, cont, [TreeShape(*s) for s in SUB_SHAPES])
    for n, k, ndt in SUB_SHAPES:
        assert ceiling.accepted(record, n, ndt) == want[TreeShape(n, k, ndt)], (n, ndt)
    # every node kept: the longest matching path of the whole tree
    assert ceiling.accepted(record, 3, None) == max(want.values())


def test_tau_counts_steps_like_a_static_decode():
    # positions 0..8; steps at 0 (accepts 2), 3 (0), 4 (3), 8 (1) -> 10 tokens, 4 steps + prefill
    assert ceiling.tau([2, 9, 9, 0, 3, 9, 9, 9, 1]) == (10, 5)
    assert ceiling.tau([0, 0, 0]) == (4, 4)  # nothing accepted: one token per forward


def _blob(tmp_path, name, conts, categories):
    trees = {2: [[counterfactual.tree_record(full_tree(), torch.tensor(c)) for c in prompt] for prompt in conts]}
    path = tmp_path / f"{name}.pt"
    torch.save({"acc": [], "p1": [], "trees": trees, "categories": categories}, path)
    return path


def test_table_groups_by_category_and_the_ceiling_bounds_every_shape(tmp_path):
    good, bad = [5, 7, 9], [4, 4, 4]
    a = _blob(tmp_path, "a", [[good] * 8, [bad] * 8], ["qa", "rag"])
    b = _blob(tmp_path, "b", [[good, bad] * 4], None)  # an older file: its stem names the category
    rows = ceiling.table(ceiling.load([a, b]), [(1, 2, 3), (3, 2, 6)])
    assert list(rows) == ["qa", "rag", "b"]
    # qa: the full tree accepts 3 at every position -> steps at 0 and 4 (8 positions), 9 tokens / 3 forwards
    assert rows["qa"]["tau"]["(3, 2, 6)"] == pytest.approx(9 / 3)
    assert rows["qa"]["tau"]["(1, 2, 3)"] == pytest.approx(9 / 5)  # depth 1 accepts 1: steps at 0, 2, 4, 6
    assert rows["qa"]["first_shape_accepts_ge"] == [1.0, 0.0, 0.0]
    assert rows["rag"]["tau"]["ceiling"] == pytest.approx(9 / 9)  # nothing ever matches
    for r in rows.values():
        assert all(r["tau"]["ceiling"] >= t - 1e-12 for t in r["tau"].values())


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert ceiling.main([str(tmp_path / "missing.pt")]) == 2
    assert ceiling.main([str(_blob(tmp_path, "a", [[[5, 7, 9]]], ["qa"])), "--shape", "3,4"]) == 2
    assert ceiling.main([str(_blob(tmp_path, "a", [[[5, 7, 9]]], ["qa"])), "--shape", "3,4,8"]) == 2  # no topk-4 trees
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert "missing.pt" in err[0] and "--shape" in err[1] and "'3,4'" in err[1] and "branching 4" in err[2]
