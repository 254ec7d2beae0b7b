"""Per-category results: aggregation on hand-made records, --categories / --per-category selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptivespec.cli import main
from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import bench, categories, plots, report
from adaptivespec.evaluation.records import RunRecord
from adaptivespec.evaluation.spec import BenchSpec, Entry
from adaptivespec.evaluation.categories import category_of, select
from adaptivespec.evaluation.datasets import load_dataset

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
AR, EAGLE3, LOSSY = (str(CONFIGS / f) for f in ("ar.yaml", "eagle3.yaml", "adaptivespec-lossy.yaml"))


def summarize(spec: BenchSpec, problems, recs: list[dict]) -> dict:
    """The results document of ``recs``, records as ``records.jsonl`` holds them."""
    return report.summarize(spec, problems, [RunRecord.from_json(r) for r in recs])


def test_spec_bench_has_six_categories_with_mt_bench_as_one():
    problems = load_dataset("specbench")
    assert categories.categories(problems) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    counts = {c: sum(category_of(p) == c for p in problems) for c in categories.categories(problems)}
    assert counts == {"mt_bench": 80, "translation": 80, "summarization": 80, "qa": 80, "math_reasoning": 80, "rag": 80}
    assert categories.categories(load_dataset("mtbench"))[:2] == ["writing", "roleplay"]
    assert categories.categories(load_dataset("gsm8k", limit=5)) == []


def test_a_spec_bench_format_file_keeps_its_own_categories(tmp_path):
    rows = [{"question_id": 1, "category": "mix:rag", "turns": ["a"]}, {"question_id": 2, "category": "writing", "turns": ["b"]},
            {"question_id": 3, "category": "translation", "turns": ["c"]}, {"question_id": 4, "category": "mix:rag", "turns": ["d"]}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_dataset("specbench", tmp_path / "q.jsonl")
    assert [category_of(p) for p in problems] == ["mix:rag", "mt_bench", "translation", "mix:rag"]  # MT-Bench's names: mt_bench
    assert categories.categories(problems) == ["mix:rag", "mt_bench", "translation"]
    assert [p.prompt for p in select(problems, None, 1)] == ["a", "b", "c"]


def test_select_categories_and_per_category():
    problems = load_dataset("specbench")
    two = select(problems, ["rag", "qa"], None)
    assert {category_of(p) for p in two} == {"qa", "rag"} and len(two) == 160
    assert [p.id for p in two] == [p.id for p in problems if category_of(p) in ("qa", "rag")]  # file order kept
    balanced = select(problems, None, 3)
    assert len(balanced) == 18 and all(sum(category_of(p) == c for p in balanced) == 3 for c in categories.SPEC_BENCH_CATEGORIES)
    firsts = [p.id for p in problems if category_of(p) == "translation"][:3]
    assert [p.id for p in balanced if category_of(p) == "translation"] == firsts
    assert [category_of(p) for p in select(problems, ["rag"], 2)] == ["rag", "rag"]
    with pytest.raises(AdaptiveSpecError, match="--categories: unknown category 'maths'.*expected some of: mt_bench, translation"):
        select(problems, ["maths"], None, "specbench")
    with pytest.raises(AdaptiveSpecError, match="--per-category: dataset 'gsm8k' has no categories"):
        select(load_dataset("gsm8k", limit=3), None, 1, "gsm8k")


def _spec_and_records():
    """4 translation prompts, 2 qa, 1 rag; eagle3 is fast on translation, slow on qa; the lossy
    config never ran rag (a category with one contender missing)."""
    problems = load_dataset("specbench")
    chosen = select(problems, ["translation", "qa", "rag"], None)
    by_cat = {c: [p for p in chosen if category_of(p) == c] for c in ("translation", "qa", "rag")}
    probs = by_cat["translation"][:4] + by_cat["qa"][:2] + by_cat["rag"][:1]
    probs.sort(key=lambda p: [q.id for q in problems].index(p.id))
    entries = tuple(Entry(name=n, config=load_config(p, [])) for n, p in (("ar", AR), ("eagle3", EAGLE3), ("lossy", LOSSY)))
    spec = BenchSpec(entries=entries, dataset="specbench", max_new_tokens=64)
    tps = {"ar": {"translation": 10, "qa": 10, "rag": 10}, "eagle3": {"translation": 20, "qa": 8, "rag": 15},
           "lossy": {"translation": 30, "qa": 12}}
    forwards = {"ar": 1.0, "eagle3": 0.5, "lossy": 0.25}  # forwards per token: tau 1, 2, 4
    recs = []
    for i, p in enumerate(probs):
        c = category_of(p)
        for name in ("ar", "eagle3", "lossy"):
            if c not in tps[name]:
                continue
            new = 20 + i  # different lengths per prompt
            recs.append({"config": name, "id": p.id, "index": i, "new_tokens": new, "wall_seconds": new / tps[name][c],
                         "target_forwards": int(new * forwards[name]) or 1, "tokens_per_second": tps[name][c],
                         "accept_length_mean": 1.0, "promoted_tokens": 0, "correct": None, "extracted": None,
                         "accepted": [], "text": "x"})
    return spec, probs, recs


def test_per_category_aggregation():
    spec, probs, recs = _spec_and_records()
    res = summarize(spec, probs, recs)
    cats = res["categories"]
    assert list(cats) == ["translation", "qa", "rag"]
    assert [cats[c]["prompts"] for c in cats] == [4, 2, 1]
    rows = {c: {r["name"]: r for r in v["configs"]} for c, v in cats.items()}
    assert rows["translation"]["eagle3"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert rows["translation"]["lossy"]["speedup_vs_eagle3"] == pytest.approx(1.5)
    assert rows["qa"]["eagle3"]["speedup_vs_ar"] == pytest.approx(0.8)
    assert rows["qa"]["lossy"]["speedup_vs_eagle3"] == pytest.approx(1.5)
    assert rows["rag"]["eagle3"]["speedup_vs_ar"] == pytest.approx(1.5) and rows["rag"]["eagle3"]["prompts"] == 1
    missing = rows["rag"]["lossy"]
    assert missing["prompts"] == 0 and missing["tokens_per_second"] is None and missing["speedup_vs_ar"] is None
    assert missing["complete"] is False and rows["qa"]["lossy"]["complete"] is True
    tr = [r for r in recs if r["config"] == "eagle3" and category_of(next(p for p in probs if p.id == r["id"])) == "translation"]
    assert rows["translation"]["eagle3"]["accept_length_mean"] == pytest.approx(
        sum(r["new_tokens"] for r in tr) / sum(r["target_forwards"] for r in tr))
    # the overall figures are unchanged by the split and weigh categories by their tokens
    overall = {r["name"]: r for r in res["configs"]}
    assert overall["eagle3"]["prompts"] == 7 and overall["lossy"]["complete"] is False
    # results.md carries the overview and the long table; the plot is written
    md = report.markdown(res)
    line = next(x for x in md.splitlines() if x.startswith("| `eagle3` | 2.00× ("))
    assert "## By category" in md and [c.split(" (")[0] for c in line.split(" | ")[1:]] == ["2.00×", "0.80×", "1.50×"]
    assert "| `lossy` | 3.00× (" in md and md.splitlines()[md.splitlines().index(line) + 1].endswith("| – |")
    assert "| rag | `lossy` | 0/1 | – |" in md and "* incomplete" not in md  # not run at all: a dash, no mark


def test_per_category_reach_of_drafted_depths():
    """Each category's row keeps the accepted-per-step histogram of that category's steps, and results.md
    shows the share of steps accepting >= 1, 2, 3 drafted tokens (their sum is tau - 1 when no step accepts more)."""
    from adaptivespec.evaluation.categories import reach

    spec, probs, recs = _spec_and_records()
    cat = {p.id: category_of(p) for p in probs}
    for r in recs:
        if r["config"] == "eagle3":
            r["accepted"] = [0, 1, 2, 3] if cat[r["id"]] == "translation" else [0, 0, 1, 1]
    res = summarize(spec, probs, recs)
    rows = {c: {r["name"]: r for r in v["configs"]} for c, v in res["categories"].items()}
    assert rows["translation"]["eagle3"]["accepted_per_step"]["histogram"] == {"0": 4, "1": 4, "2": 4, "3": 4}
    assert reach(rows["translation"]["eagle3"]["accepted_per_step"]) == [0.75, 0.5, 0.25]
    assert reach(rows["qa"]["eagle3"]["accepted_per_step"]) == [0.5, 0.0, 0.0]
    assert reach(rows["qa"]["ar"]["accepted_per_step"]) is None
    md = report.markdown(res)
    assert "steps accepting ≥1/≥2/≥3" in md
    assert next(x for x in md.splitlines() if x.startswith("| translation | `eagle3` |")).split(" | ")[7].rstrip(" |") == "0.75 / 0.50 / 0.25"
    assert next(x for x in md.splitlines() if x.startswith("| qa | `ar` |")).split(" | ")[7].rstrip(" |") == "–"


def test_category_outputs_written(tmp_path):
    spec, probs, recs = _spec_and_records()
    res = summarize(spec, probs, recs)
    report.write_outputs(res, tmp_path)
    assert (tmp_path / "category_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = plots.category_speedups(res).axes[0]  # a bar per contender and category it ran, vs ar
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eagle3", "lossy"]
    assert [[b.get_height() for b in c] for c in ax.containers] == [pytest.approx([2.0, 0.8, 1.5]), pytest.approx([3.0, 1.2])]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["translation\n(4)", "qa\n(2)", "rag\n(1)"]
    assert ax.get_ylabel() == "speedup vs ar (tokens/s ratio)"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["categories"]) == {"translation", "qa", "rag"}


def test_datasets_without_categories_have_no_table():
    entries = (Entry(name="ar", config=load_config(AR, [])),)
    problems = load_dataset("gsm8k", limit=2)
    recs = [{"config": "ar", "id": p.id, "index": i, "new_tokens": 10, "wall_seconds": 1.0, "target_forwards": 10,
             "correct": True, "extracted": "1", "text": "x"} for i, p in enumerate(problems)]
    res = summarize(BenchSpec(entries=entries, dataset="gsm8k", max_new_tokens=8), problems, recs)
    assert "categories" not in res and "By category" not in report.markdown(res)


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "specbench", "--categories", "qa,poetry"], "--categories: unknown category 'poetry'"),
    (["--dataset", "gsm8k", "--per-category", "2"], "--per-category: dataset 'gsm8k' has no categories"),
    (["--dataset", "specbench", "--per-category", "0"], "--per-category: expected a positive integer"),
])
def test_selection_errors_are_one_line(argv, message, tmp_path, capsys):
    try:
        code = main(["bench", "--configs", AR, *argv, "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_selection_reaches_the_run(tmp_path, monkeypatch):
    seen = {}

    def fake_run(spec, problems, out, progress=True):
        seen["ids"], seen["extra"] = [p.id for p in problems], spec.extra
        return summarize(spec, problems, [])

    monkeypatch.setattr(bench, "run_bench", fake_run)
    code = main(["bench", "--configs", AR, "--dataset", "specbench", "--categories", "rag,qa", "--per-category", "2",
                 "--out", str(tmp_path / "o")])
    assert code == 0
    problems = {p.id: p for p in load_dataset("specbench")}
    assert [category_of(problems[i]) for i in seen["ids"]] == ["qa", "qa", "rag", "rag"]
    assert seen["extra"] == {"selection": {"categories": ["rag", "qa"], "per_category": 2}}
    code = main(["bench", "--configs", AR, "--dataset", "specbench", "--per-category", "2", "--limit", "3",
                 "--out", str(tmp_path / "o2")])
    assert code == 0 and len(seen["ids"]) == 3


def test_sweep_reports_per_category_with_its_swept_values():
    spec, probs, recs = _spec_and_records()
    entries = (spec.entries[1], Entry(name="lossy[k=0.5]", config=spec.entries[2].config, sweep={"verifier.kappa": 0.5}))
    sweep = BenchSpec(entries=entries, dataset="specbench", max_new_tokens=64, reference="eagle3", command="sweep",
                      columns=("verifier.kappa",), extra={"sweep": {"params": {"verifier.kappa": [0.5]}}})
    renamed = [dict(r, config="lossy[k=0.5]") if r["config"] == "lossy" else r for r in recs if r["config"] != "ar"]
    res = summarize(sweep, probs, renamed)
    qa = {r["name"]: r for r in res["categories"]["qa"]["configs"]}
    assert qa["lossy[k=0.5]"]["sweep"] == {"verifier.kappa": 0.5} and "sweep" not in qa["eagle3"]
    assert qa["lossy[k=0.5]"]["speedup_vs_reference"] == pytest.approx(1.5) and qa["lossy[k=0.5]"]["speedup_vs_ar"] is None
    md = report.markdown(res, ["verifier.kappa"])
    assert "Speedup vs `eagle3`" in md and "| `lossy[k=0.5]` | 1.50× (" in md
