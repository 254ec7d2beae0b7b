"""``adaptivespec bench`` / ``sweep``: end to end through the CLI, resume, errors, aggregation, plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adaptivespec.cli import main
from adaptivespec.config import ConfigError, load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import bench, plots, report
from adaptivespec.evaluation.contenders import warmup_problems
from adaptivespec.evaluation.datasets import load_dataset
from adaptivespec.evaluation.plots import pareto_front
from adaptivespec.evaluation.records import RECORD_FIELDS, RunRecord
from adaptivespec.evaluation.spec import BenchSpec, Entry, config_lossless
from adaptivespec.evaluation.summary import contender_infos, pick_reference
from adaptivespec.evaluation.sweep import parse_param, reference_entry, sweep_entries

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
AR, EAGLE3, LOSSY = (str(CONFIGS / f) for f in ("ar.yaml", "eagle3.yaml", "adaptivespec-lossy.yaml"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small(head, out, tokens: int = 6) -> list[str]:
    """Arguments shared by the model runs: 2 GSM8K prompts, few tokens, float32, one thread."""
    return ["--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", str(tokens), "--set", f"model.drafter={head}",
            "--set", "runtime.dtype=float32", "--set", "runtime.threads=1", "--out", str(out), "--no-progress"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


def summarize(spec: BenchSpec, problems, recs: list[dict]) -> dict:
    """The results document of ``recs``, records as ``records.jsonl`` holds them."""
    return report.summarize(spec, problems, [RunRecord.from_json(r) for r in recs])


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


@pytest.fixture(scope="module")
def models(smol32):
    """Share the session's float32 target with the engines, and restore torch's thread count."""
    from adaptivespec import decode

    decode._MODELS.setdefault(("smollm2-135m-instruct", "float32", "cpu"), smol32)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bench_run(models, random_head_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run"
    rc = main(["bench", "--configs", AR, EAGLE3, "--peers", "hf-generate", *small(random_head_dir, out)])
    assert rc == 0
    return out


# -- bench end to end -------------------------------------------------------------------------------
@pytest.mark.model
def test_bench_writes_results(bench_run, random_head_dir):
    for name in ("settings.json", "records.jsonl", "results.json", "results.md", "speedup_retention.png", "accept_lengths.png"):
        assert (bench_run / name).is_file(), name
    res = json.loads((bench_run / "results.json").read_text())
    meta = res["meta"]
    assert meta["dataset"] == "gsm8k" and meta["limit"] == 2 and meta["max_new_tokens"] == 6
    assert meta["machine"]["cpu"] and meta["machine"]["logical_cpus"] >= 1 and meta["torch"] == torch.__version__
    assert meta["date"]
    rows = {r["name"]: r for r in res["configs"]}
    assert list(rows) == ["ar", "eagle3", "hf-generate"]
    assert res["reference"] == "eagle3" and res["ar"] == "ar"
    for r in rows.values():
        for key in ("config", "lossless", "tokens_per_second", "speedup_vs_ar", "speedup_vs_eagle3",
                    "accept_length_mean", "accuracy", "retention", "records"):
            assert key in r, (r["name"], key)
        assert r["lossless"] is True and r["tokens_per_second"] > 0 and r["accuracy"] is not None
        assert len(r["records"]) == 2 and set(r["records"][0]) == set(RECORD_FIELDS)
    # --set model.drafter swapped eagle3's head and left ar autoregressive
    assert rows["ar"]["config"]["model"]["drafter"] is None
    assert rows["eagle3"]["config"]["model"]["drafter"] == str(random_head_dir)
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0) and rows["eagle3"]["speedup_vs_eagle3"] == pytest.approx(1.0)
    assert rows["eagle3"]["accepted_per_step"]["steps"] > 0 and rows["ar"]["accepted_per_step"]["steps"] == 0
    assert rows["hf-generate"]["target_forwards"] == rows["ar"]["target_forwards"]
    # the engine reports its prefill (within the wall time); a peer does not, so it has no decode rate
    for name in ("ar", "eagle3"):
        row = rows[name]
        assert 0 < row["prefill_seconds"] < row["wall_seconds"]
        assert row["decode_tokens_per_second"] == pytest.approx(
            (row["new_tokens"] - 2) / (row["wall_seconds"] - row["prefill_seconds"]))
    assert rows["ar"]["decode_speedup_vs_ar"] == pytest.approx(1.0)
    assert rows["hf-generate"]["prefill_seconds"] is None and rows["hf-generate"]["decode_speedup_vs_ar"] is None
    # all three are greedy decoding of the same float32 target: the same text
    texts = {}
    for r in records(bench_run):
        texts.setdefault(r["id"], set()).add(r["text"])
    assert len(texts) == 2 and all(len(t) == 1 for t in texts.values())
    md = (bench_run / "results.md").read_text()
    assert ("| config | lossless | tok/s | speedup vs AR | speedup vs EAGLE-3 | accept length | accuracy | retention"
            " | answer agreement | identical text |") in md
    assert all(r["answer_agreement"] == 1.0 and r["identical_outputs"] == 1.0 for r in rows.values())
    assert all(f"`{n}`" in md for n in rows)


@pytest.mark.model
def test_bench_interleaves_rotating_order(bench_run):
    order = [(r["index"], r["config"]) for r in records(bench_run)]
    assert [c for i, c in order if i == 0] == ["ar", "eagle3", "hf-generate"]
    assert [c for i, c in order if i == 1] == ["eagle3", "hf-generate", "ar"]


@pytest.mark.model
def test_bench_records_keep_their_keys_in_order(bench_run):
    """records.jsonl is read by other tools: each contender's line has the keys the bench always wrote."""
    lines = {r["config"]: list(r) for r in records(bench_run) if r["index"] == 0}
    head, tail = ["config", "id", "index"], ["correct", "extracted", "grade_reason", "accepted", "text", "finished_at"]
    stats = ["new_tokens", "target_forwards", "accept_length_mean", "wall_seconds", "tokens_per_second"]
    assert lines["ar"] == [*head, *stats, "prefill_seconds", "promoted_tokens", *tail]
    assert lines["eagle3"] == [*head, *stats, "prefill_seconds", "promoted_tokens", "accepted_by_source", *tail]
    assert lines["hf-generate"] == [*head, *stats, "promoted_tokens", *tail]


@pytest.mark.model
def test_bench_plots_are_pngs(bench_run):
    assert_png(bench_run / "speedup_retention.png")
    assert_png(bench_run / "accept_lengths.png")


@pytest.mark.model
def test_bench_resumes_and_skips_done_pairs(bench_run, random_head_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(bench_run, out)
    lines = (out / "records.jsonl").read_text().splitlines()
    # a run killed while writing its last record: one pair missing, a half-written line
    (out / "records.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])
    calls = []
    real = bench.run_one
    monkeypatch.setattr(bench, "run_one", lambda c, p, i, m: calls.append((c.name, p.id)) or real(c, p, i, m))
    argv = ["bench", "--configs", AR, EAGLE3, "--peers", "hf-generate", *small(random_head_dir, out)]
    assert main(argv) == 0
    done = json.loads(lines[-1])
    assert calls == [(done["config"], done["id"])]
    assert (out / "records.jsonl").read_text().splitlines()[:-1] == lines[:-1]
    assert len(records(out)) == 6
    calls.clear()
    assert main(argv) == 0  # complete: no generation at all
    assert calls == [] and len(records(out)) == 6


@pytest.mark.model
def test_bench_refuses_resume_with_other_settings(bench_run, random_head_dir, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(bench_run, out)
    rc = main(["bench", "--configs", AR, EAGLE3, "--peers", "hf-generate", *small(random_head_dir, out, tokens=7)])
    err = capsys.readouterr().err
    assert rc == 2 and "different settings" in err and "max_new_tokens: 6 -> 7" in err and "--out" in err
    assert len(err.strip().splitlines()) == 1


# -- errors (no model) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["bench", "--configs", AR, "--dataset", "gsm9k"], "--dataset: unknown dataset 'gsm9k'; expected one of: gsm8k"),
    (["bench", "--configs", "nope/missing.yaml", "--dataset", "gsm8k"], "nope/missing.yaml: config file not found"),
    (["bench", "--configs", AR, "--dataset", "gsm8k", "--peers", "hf-beam"], "--peers: unknown peer 'hf-beam'"),
    (["bench", "--configs", AR, AR, "--dataset", "gsm8k", "--limit", "1"], "two contenders are named 'ar'"),
    (["bench", "--configs", AR, "--dataset", "gsm8k", "--data", "nope.jsonl"], "--data: dataset file not found"),
    (["sweep", "--config", LOSSY, "--param", "verifier.kappa=0.1,x", "--dataset", "gsm8k"], "expected a comma-separated list of numbers"),
    (["sweep", "--config", LOSSY, "--param", "verifier.kappa=0.1", "--reference", LOSSY, "--dataset", "gsm8k"], "is lossy"),
    (["sweep", "--config", LOSSY, "--param", "verifier.kapa=0.1", "--dataset", "gsm8k"], "verifier.kapa: unknown key"),
])
def test_user_errors_are_one_line(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_parse_param():
    assert parse_param("verifier.kappa=0.1, 0.25,1") == ("verifier.kappa", [("0.1", 0.1), ("0.25", 0.25), ("1", 1)])
    for bad in ("kappa", "=0.1", "verifier.kappa=", "verifier.kappa=0.1,0.1", "verifier.kappa=true"):
        with pytest.raises(Exception, match="--param"):
            parse_param(bad)


def test_sweep_grid_skips_invalid_shapes_only_when_asked():
    grid = ["policy.nsteps=2,5", "policy.topk=1", "policy.ndt=4"]  # (2, 1, 4): 3 nodes from a 2-node chain
    with pytest.raises(ConfigError, match=r"policy\.ndt: ndt - 1 = 3 drafted nodes"):
        sweep_entries(EAGLE3, grid, [])
    entries, params, skipped = sweep_entries(EAGLE3, grid, [], skip_invalid=True)
    assert [e.config.policy.params.nsteps for e in entries] == [5] and params["policy.nsteps"] == [2, 5]
    assert [s["point"] for s in skipped] == ["eagle3[policy.nsteps=2,policy.topk=1,policy.ndt=4]"]
    assert "at most 2 candidates" in skipped[0]["error"]
    with pytest.raises(AdaptiveSpecError, match="no valid point"):
        sweep_entries(EAGLE3, ["policy.nsteps=2", "policy.topk=1", "policy.ndt=4"], [], skip_invalid=True)


def test_default_reference_is_the_strict_variant():
    ref = reference_entry(LOSSY, None, ["verifier.kappa=0.3", "runtime.dtype=float32"])
    assert ref.name == "adaptivespec-lossy-strict" and ref.config.verifier.name == "strict"
    assert ref.config.runtime.dtype == "float32" and config_lossless(ref.config)


# -- aggregation and plots on synthetic records (no model) -------------------------------------------------
def synthetic(tmp_path):
    entries = tuple(Entry(name=n, config=load_config(p, []), sweep=s) for n, p, s in
                    (("ar", AR, None), ("eagle3", EAGLE3, None), ("lossy[k=0.2]", LOSSY, {"verifier.kappa": 0.2}),
                     ("lossy[k=0.5]", LOSSY, {"verifier.kappa": 0.5})))
    problems = load_dataset("gsm8k", limit=4)
    spec = BenchSpec(entries=entries, peers=("hf-generate",), dataset="gsm8k", limit=4, max_new_tokens=64,
                     extra={"sweep": {"params": {"verifier.kappa": [0.2, 0.5]}}})
    # (tokens/s, correct count of 4, accepted per step)
    plan = {"ar": (10, 4, []), "eagle3": (20, 4, [1, 2]), "lossy[k=0.2]": (30, 2, [3, 3]),
            "lossy[k=0.5]": (25, 3, [2, 3]), "hf-generate": (11, 4, [])}
    recs = []
    for name, (tps, n_ok, acc) in plan.items():
        for i, p in enumerate(problems):
            recs.append({"config": name, "id": p.id, "index": i, "new_tokens": 10 * tps, "wall_seconds": 10.0,
                         "target_forwards": 50, "tokens_per_second": tps, "accept_length_mean": 2.0 * tps,
                         "promoted_tokens": 0, "correct": i < n_ok, "accepted": acc,
                         # lossy[k=0.2] changes the answer of the last two prompts, lossy[k=0.5] only the text
                         "extracted": "2" if name == "lossy[k=0.2]" and i >= 2 else "1",
                         "text": f"answer {i}" + (" (lossy)" if name.startswith("lossy") else "")})
    return spec, problems, recs


def test_summarize_speedups_and_retention(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    res = summarize(spec, problems, recs)
    rows = {r["name"]: r for r in res["configs"]}
    assert res["reference"] == "eagle3" and res["ar"] == "ar" and res["eagle3"] == "eagle3"
    assert rows["eagle3"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert rows["lossy[k=0.2]"]["speedup_vs_eagle3"] == pytest.approx(1.5)
    assert rows["lossy[k=0.2]"]["retention"] == pytest.approx(0.5) and rows["lossy[k=0.5]"]["retention"] == pytest.approx(0.75)
    assert rows["lossy[k=0.2]"]["lossless"] is False and rows["hf-generate"]["kind"] == "peer"
    assert rows["eagle3"]["accepted_per_step"] == {"steps": 8, "mean": 1.5, "histogram": {"1": 4, "2": 4}}
    assert rows["ar"]["accept_length_mean"] == pytest.approx(400 / 200)
    assert all(r["complete"] for r in rows.values())
    assert pick_reference(contender_infos(spec), forced="ar") == "ar"


def test_decode_rate_leaves_the_prefill_out(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    for r in recs:  # 4 prompts x 10 s each, 4 s of them prefill; ar makes 100 tokens a prompt, eagle3 200
        if r["config"] != "hf-generate":
            r["prefill_seconds"] = 4.0
    res = summarize(spec, problems, recs)
    rows = {r["name"]: r for r in res["configs"]}
    assert rows["ar"]["prefill_seconds"] == pytest.approx(16.0)
    assert rows["ar"]["decode_tokens_per_second"] == pytest.approx((400 - 4) / 24.0)
    assert rows["eagle3"]["decode_speedup_vs_ar"] == pytest.approx((800 - 4) / (400 - 4))
    assert rows["eagle3"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert rows["hf-generate"]["decode_tokens_per_second"] is None
    # per category too, and the category table shows the decode speedup where there is one
    assert "decode speedup vs AR" not in report.markdown(res)  # gsm8k has no categories
    from adaptivespec.evaluation import categories

    md = categories.markdown({"ar": "ar", "configs": res["configs"], "categories": {"all": {"prompts": 4, "configs": res["configs"]}}})
    assert "decode speedup vs AR" in md and "2.01×" in md


def test_answer_agreement_against_the_reference(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    rows = {r["name"]: r for r in summarize(spec, problems, recs)["configs"]}
    assert rows["eagle3"]["answer_agreement"] == 1.0 and rows["eagle3"]["identical_outputs"] == 1.0
    assert rows["lossy[k=0.2]"]["answer_agreement"] == pytest.approx(0.5) and rows["lossy[k=0.2]"]["answers_equal"] == 2
    assert rows["lossy[k=0.5]"]["answer_agreement"] == 1.0 and rows["lossy[k=0.5]"]["identical_outputs"] == 0.0
    # only prompts run by both count: a contender that ran one prompt is compared on that one
    partial = [r for r in recs if not (r["config"] == "lossy[k=0.2]" and r["index"] != 3)]
    row = {r["name"]: r for r in summarize(spec, problems, partial)["configs"]}["lossy[k=0.2]"]
    assert (row["answers_compared"], row["answers_equal"], row["answer_agreement"]) == (1, 0, 0.0)
    md = report.markdown(summarize(spec, problems, recs))
    assert "50.0% (2/4)" in md


def test_speedup_retention_plot_places_every_contender(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    ax = plots.speedup_retention(summarize(spec, problems, recs)).axes[0]
    # one point per contender at (retention vs eagle3 in %, tokens/s over ar's), labelled with its name
    assert [t.get_text() for t in ax.texts] == ["ar", "eagle3", "lossy[k=0.2]", "lossy[k=0.5]", "hf-generate"]
    points = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert points == [pytest.approx(p) for p in ((100, 1.0), (100, 2.0), (50, 3.0), (75, 2.5), (100, 1.1))]
    assert ax.get_xlabel() == "accuracy retention vs eagle3 (%)" and ax.get_ylabel() == "speedup vs ar (tokens/s ratio)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lossless", "lossy", "peer"]
    # without retention (an ungraded set): bars, one per contender
    ungraded = [dict(r, correct=None) for r in recs]
    ax = plots.speedup_retention(summarize(spec, problems, ungraded)).axes[0]
    assert [b.get_height() for b in ax.containers[0]] == pytest.approx([1.0, 2.0, 3.0, 2.5, 1.1])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ar", "eagle3", "lossy[k=0.2]", "lossy[k=0.5]", "hf-generate"]


def test_accept_length_plot_has_a_bar_group_per_speculative_config(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    ax = plots.accept_lengths(summarize(spec, problems, recs)).axes[0]
    heights = [[b.get_height() for b in c] for c in ax.containers]  # share of steps accepting k = 0..3
    assert heights == [pytest.approx(h) for h in ([0, 0.5, 0.5, 0], [0, 0, 0, 1], [0, 0, 0.5, 0.5])]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "eagle3 (mean 1.50, 8 steps)", "lossy[k=0.2] (mean 3.00, 8 steps)", "lossy[k=0.5] (mean 2.50, 8 steps)"]
    assert ax.get_xlabel().endswith("(no steps: ar, hf-generate)")


def test_pareto_plot_draws_the_frontier_through_the_reference(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    ax = plots.pareto(summarize(spec, problems, recs)).axes[0]
    front = next(line for line in ax.lines if line.get_label() == "Pareto frontier")
    assert list(front.get_xdata()) == pytest.approx([50, 75, 100]) and list(front.get_ydata()) == pytest.approx([30, 25, 20])
    assert [t.get_text() for t in ax.texts] == ["0.2", "0.5"]
    assert "reference eagle3" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_write_outputs_writes_every_plot(tmp_path):
    spec, problems, recs = synthetic(tmp_path)
    report.write_outputs(summarize(spec, problems, recs), tmp_path, ("verifier.kappa",))
    for name in ("speedup_retention.png", "accept_lengths.png", "pareto.png"):
        assert_png(tmp_path / name)
    assert not (tmp_path / "category_speedup.png").exists()  # gsm8k has no categories
    assert "| verifier.kappa |" in (tmp_path / "results.md").read_text().splitlines()[6]


def test_pareto_front():
    pts = [(50.0, 30.0), (75.0, 25.0), (100.0, 20.0), (70.0, 20.0), (float("nan"), 99.0), (100.0, 10.0)]
    assert pareto_front(pts) == [0, 1, 2]


# -- sweep end to end ------------------------------------------------------------------------------------
@pytest.mark.model
def test_sweep_end_to_end(models, random_head_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--config", LOSSY, "--param", "verifier.kappa=0.2,0.8", "--reference", EAGLE3,
               *small(random_head_dir, out, tokens=4)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in res["configs"]]
    assert names == ["eagle3", "adaptivespec-lossy[verifier.kappa=0.2]", "adaptivespec-lossy[verifier.kappa=0.8]"]
    assert res["reference"] == "eagle3" and res["sweep"]["params"] == {"verifier.kappa": [0.2, 0.8]}
    points = res["configs"][1:]
    assert [p["sweep"] for p in points] == [{"verifier.kappa": 0.2}, {"verifier.kappa": 0.8}]
    assert [p["config"]["verifier"]["kappa"] for p in points] == [0.2, 0.8]
    assert all(len(r["records"]) == 2 and r["speedup_vs_reference"] for r in res["configs"])
    assert_png(out / "pareto.png")
    md = (out / "results.md").read_text()
    assert "| verifier.kappa |" in md and "speedup vs eagle3" in md
    assert "adaptivespec-lossy[verifier.kappa=0.8]" in capsys.readouterr().out


@pytest.mark.model
def test_bench_samples_with_per_prompt_seeds_and_records_the_settings(models, random_head_dir, tmp_path):
    out = tmp_path / "sampled"
    args = small(random_head_dir, out, tokens=4) + ["--set", "generation.temperature=0.7", "--set", "generation.seed=10"]
    assert main(["bench", "--configs", AR, EAGLE3, "--peers", "hf-generate", *args]) == 0
    recs = records(out)
    assert {(r["config"], r["index"], r["seed"]) for r in recs} == {
        (c, i, 10 + i) for c in ("ar", "eagle3", "hf-generate") for i in range(2)}
    res = json.loads((out / "results.json").read_text())
    expected = {"temperature": 0.7, "top_k": None, "top_p": 1.0, "min_p": None, "seed": 10}
    assert res["meta"]["sampling"] == expected
    assert all(r["sampling"] == expected for r in res["configs"])
    peer = next(r for r in res["configs"] if r["name"] == "hf-generate")
    assert peer["config"]["generate"]["do_sample"] is True and peer["config"]["generate"]["top_k"] == 0
    assert "Sampling: temperature 0.7" in (out / "results.md").read_text()


def test_warmup_takes_the_first_and_the_longest_prompt():
    problems = load_dataset("longctx")[:6]
    longest = max(problems, key=lambda p: len(p.prompt))
    assert longest is not problems[0]
    assert warmup_problems(problems) == [problems[0], longest]
    assert warmup_problems([longest]) == [longest] and warmup_problems([]) == []
