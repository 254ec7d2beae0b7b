"""Tests of the packaged evaluation sets and :func:`load_dataset`."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import attrs
import pytest

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import DATASETS, DatasetError, Problem, load_dataset
from adaptivespec.evaluation.datasets import GSM8K_INSTRUCTION, MATH_INSTRUCTION, default_path

DATA = Path(default_path("gsm8k")).parent.parent
EXPECTED_COUNTS = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "specbench": 480, "mtbench": 80, "longctx": 72,
                   "structured": 30}


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[Problem]]:
    return {name: load_dataset(name) for name in DATASETS}


def test_known_names() -> None:
    assert set(DATASETS) == set(EXPECTED_COUNTS)


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_counts_ids_and_fields(loaded: dict[str, list[Problem]], name: str) -> None:
    problems = loaded[name]
    assert len(problems) == EXPECTED_COUNTS[name]
    assert len({p.id for p in problems}) == len(problems)
    for problem in problems:
        assert isinstance(problem, Problem)
        assert problem.task == name
        assert isinstance(problem.prompt, str) and problem.prompt.strip()
        assert isinstance(problem.meta, dict)


def test_gsm8k_records(loaded: dict[str, list[Problem]]) -> None:
    first = loaded["gsm8k"][0]
    assert first.id == "gsm8k/0"
    assert first.prompt.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.prompt.endswith(GSM8K_INSTRUCTION)
    assert "The answer is" in first.prompt
    assert first.reference == "18"
    assert first.meta["solution"].endswith("#### 18")
    assert all(re.fullmatch(r"-?[\d,]+", p.reference) for p in loaded["gsm8k"])
    assert "2,125" in {p.reference for p in loaded["gsm8k"]}  # gold kept as written


def test_math500_records(loaded: dict[str, list[Problem]]) -> None:
    first = loaded["math500"][0]
    assert first.id == "test/precalculus/807.json"
    assert first.reference == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.category == "Precalculus"
    assert first.prompt.endswith(MATH_INSTRUCTION) and "\\boxed{}" in first.prompt
    assert first.meta["level"] == 2 and "\\boxed" in first.meta["solution"]
    subjects = {p.category for p in loaded["math500"]}
    assert len(subjects) == 7 and "Number Theory" in subjects


def test_humaneval_records(loaded: dict[str, list[Problem]]) -> None:
    first = loaded["humaneval"][0]
    assert first.id == "HumanEval/0"
    assert first.meta["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in first.meta["test"]
    assert first.meta["prompt"].startswith("from typing import List")
    assert first.meta["prompt"].rstrip() in first.prompt and "```python" in first.prompt
    assert first.reference == first.meta["canonical_solution"]
    assert [p.id for p in loaded["humaneval"]][-1] == "HumanEval/163"


@pytest.mark.parametrize("name", ["specbench", "mtbench"])
def test_chat_records(loaded: dict[str, list[Problem]], name: str) -> None:
    problems = loaded[name]
    by_id = {p.id: p for p in problems}
    q95 = by_id["95"]
    assert q95.category == "roleplay"
    assert q95.prompt == q95.meta["turns"][0] and len(q95.meta["turns"]) == 2
    assert q95.reference == q95.meta["references"][0]
    assert by_id["81"].reference is None and by_id["81"].meta["references"] is None
    assert sum(p.reference is not None for p in problems) == {"specbench": 279, "mtbench": 39}[name]
    with_references = sum(p.meta["references"] is not None for p in problems)
    assert with_references == {"specbench": 359, "mtbench": 39}[name]


def test_specbench_rag_references_stay_in_meta(loaded: dict[str, list[Problem]]) -> None:
    rag = [p for p in loaded["specbench"] if p.category == "rag"]
    assert len(rag) == 80
    assert all(p.reference is None and isinstance(p.meta["references"][0], list) for p in rag)
    math = [p for p in loaded["specbench"] if p.category == "math_reasoning"]
    assert all("####" in p.reference for p in math)


def test_specbench_categories(loaded: dict[str, list[Problem]]) -> None:
    counts: dict[str, int] = {}
    for problem in loaded["specbench"]:
        counts[problem.category] = counts.get(problem.category, 0) + 1
    assert counts["math_reasoning"] == counts["translation"] == 80 and counts["writing"] == 10


@pytest.mark.parametrize("limit", [0, 1, 7])
def test_limit(limit: int) -> None:
    problems = load_dataset("math500", limit=limit)
    assert len(problems) == limit
    assert problems == load_dataset("math500")[:limit]


def test_limit_larger_than_dataset() -> None:
    assert len(load_dataset("mtbench", limit=10_000)) == 80


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3"])
def test_bad_limit(limit: object) -> None:
    with pytest.raises(DatasetError, match="limit"):
        load_dataset("gsm8k", limit=limit)  # type: ignore[arg-type]


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(AdaptiveSpecError) as info:
        load_dataset("gsm9k")
    message = str(info.value)
    assert "\n" not in message and "'gsm9k'" in message
    for name in EXPECTED_COUNTS:
        assert name in message


def test_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(AdaptiveSpecError, match=re.escape(str(missing))):
        load_dataset("gsm8k", path=str(missing))


def test_invalid_json_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n', encoding="utf-8")
    with pytest.raises(AdaptiveSpecError, match=re.escape(f"{path}:2: invalid JSON")):
        load_dataset("gsm8k", path=path)


def test_missing_field_names_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "What is 1+1?"}) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="'answer'.*'gsm8k'"):
        load_dataset("gsm8k", path=path)


def test_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="directory"):
        load_dataset("mtbench", path=tmp_path)


def test_custom_path_and_gzip(tmp_path: Path) -> None:
    rows = [
        {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "Q", "answer": "#### -1,000"},
    ]
    text = "\n".join(json.dumps(row) for row in rows) + "\n\n"
    plain, packed = tmp_path / "mine.jsonl", tmp_path / "mine.jsonl.gz"
    plain.write_text(text, encoding="utf-8")
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        problems = load_dataset("gsm8k", path=str(path))
        assert [p.reference for p in problems] == ["4", "-1,000"]
        assert [p.id for p in problems] == ["gsm8k/0", "gsm8k/1"]


def test_problem_is_frozen_and_keyword_only() -> None:
    problem = load_dataset("gsm8k", limit=1)[0]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        problem.prompt = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Problem("id", "prompt", None, "gsm8k")  # type: ignore[misc]


def _readme_rows() -> dict[str, tuple[int, str]]:
    rows = {}
    for line in (DATA / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([^`]+)` \| (\d+) \|.*\| `([0-9a-f]{64})` \|$", line)
        if match:
            rows[match.group(1)] = (int(match.group(2)), match.group(3))
    return rows


def test_packaged_files_match_provenance_table() -> None:
    rows = _readme_rows()
    assert set(rows) == {str(default_path(name).relative_to(DATA)) for name in EXPECTED_COUNTS}
    for relative, (count, sha256) in rows.items():
        data = (DATA / relative).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha256, relative
        text = gzip.decompress(data) if relative.endswith(".gz") else data
        assert len(text.decode().splitlines()) == count


def test_only_evaluation_files_and_licenses_are_packaged() -> None:
    files = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file())
    for folder in EXPECTED_COUNTS:
        assert any(f.startswith(f"{folder}/LICENSE.") for f in files), folder
    assert not any("train" in f or "distill" in f for f in files)
    data_files = [f for f in files if not f.endswith("README.md") and "/LICENSE." not in f]
    assert len(data_files) == len(EXPECTED_COUNTS)


def test_longctx_has_both_tasks_at_every_length_from_unseen_text(loaded) -> None:
    problems = loaded["longctx"]
    assert {p.category for p in problems} == {f"{t}-{n}" for t in ("summarize", "qa") for n in ("512", "1k", "2k", "4k")}
    by_doc: dict[str, list[int]] = {}
    for p in problems:
        if p.category.startswith("summarize"):
            by_doc.setdefault(p.id.split("/")[1], []).append(len(p.prompt))
    assert len(by_doc) == 9  # every article at the four lengths, each ~2x the one before
    assert all(len(v) == 4 and v == sorted(v) and v[-1] > 6 * v[0] for v in by_doc.values())
