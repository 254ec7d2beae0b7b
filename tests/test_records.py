"""The bench's JSON is a contract: the keys (and their order) of records.jsonl, results.json and
settings.json as the bench wrote them before its records were typed; the runner drives contenders
through the Contender protocol only; the evaluation modules import one another without a cycle."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaptivespec.config import load_config
from adaptivespec.evaluation import bench, report
from adaptivespec.evaluation.datasets import load_dataset
from adaptivespec.evaluation.records import RunRecord
from adaptivespec.evaluation.spec import WARMUP_TOKENS, BenchSpec, Entry

ROOT = Path(__file__).resolve().parents[1]
EVALUATION = ROOT / "adaptivespec" / "evaluation"

# -- the keys, in order, as the bench wrote them before this refactor -------------------------------------
ENGINE_LINE = ["config", "id", "index", "new_tokens", "target_forwards", "accept_length_mean", "wall_seconds",
               "tokens_per_second", "prefill_seconds", "promoted_tokens", "accepted_by_source", "mask_ms_per_step",
               "correct", "extracted", "grade_reason", "accepted", "text", "finished_at"]
PEER_LINE = ["config", "id", "index", "seed", "new_tokens", "target_forwards", "accept_length_mean", "wall_seconds",
             "tokens_per_second", "promoted_tokens", "correct", "extracted", "grade_reason", "accepted", "text",
             "finished_at"]
TOTALS = ["prompts", "new_tokens", "wall_seconds", "tokens_per_second", "prefill_seconds", "decode_tokens_per_second",
          "target_forwards", "accept_length_mean", "promoted_tokens", "accuracy", "graded", "correct",
          "accepted_per_step", "complete", "speedup_vs_ar", "decode_speedup_vs_ar", "speedup_vs_eagle3",
          "speedup_vs_reference", "retention", "answers_compared", "answers_equal", "answer_agreement",
          "identical_outputs", "records"]
CONFIG_ROW = ["name", "kind", "config", "source", "lossless", "autoregressive", "sampling", *TOTALS]
SWEEP_ROW = ["name", "kind", "config", "source", "lossless", "autoregressive", "sampling", "sweep", *TOTALS]
PEER_ROW = ["name", "kind", "lossless", "autoregressive", "sampling", "config", *TOTALS]
ROW_RECORD = ["id", "new_tokens", "target_forwards", "wall_seconds", "tokens_per_second", "accept_length_mean",
              "promoted_tokens", "correct", "extracted", "prefill_seconds"]
CATEGORY_ROW = ["name", "kind", "lossless", "autoregressive", "prompts", "complete", "new_tokens", "wall_seconds",
                "tokens_per_second", "speedup_vs_ar", "speedup_vs_eagle3", "speedup_vs_reference",
                "accept_length_mean", "accuracy", "correct", "graded", "retention", "answer_agreement",
                "accepted_per_step", "prefill_seconds", "decode_tokens_per_second", "decode_speedup_vs_ar"]
META = ["command", "date", "dataset", "data", "limit", "prompts", "max_new_tokens", "sampling", "warmup_tokens",
        "order", "machine", "torch", "versions"]
SETTINGS = ["command", "dataset", "data", "limit", "max_new_tokens", "configs", "peers", "reference", "problems"]

ENGINE_STATS = {"new_tokens": 5, "target_forwards": 3, "accept_length_mean": 5 / 3, "wall_seconds": 0.5,
                "tokens_per_second": 10.0, "prefill_seconds": 0.1, "promoted_tokens": 1,
                "accepted_by_source": {"head": 2}, "mask_ms_per_step": 0.3}
PEER_STATS = {"new_tokens": 5, "target_forwards": None, "accept_length_mean": None, "wall_seconds": 0.5,
              "tokens_per_second": 10.0, "promoted_tokens": 0}


class FakeContender:
    """A Contender with canned stats: what the runner may call, and nothing else."""

    def __init__(self, name: str, kind: str, stats: dict, seed: int | None, log: list) -> None:
        self.name, self.kind, self.lossless, self.stats, self.seed, self.log = name, kind, True, stats, seed, log

    def encode(self, text: str) -> list[int]:
        return [len(text)]

    def seed_for(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index

    def generate_ids(self, ids, *, max_new_tokens, on_step=None, seed=None, response_format=None):
        self.log.append(("generate", self.name, max_new_tokens))
        for accepted in (2, 0):
            if on_step is not None:
                on_step(SimpleNamespace(accepted=accepted))
        return SimpleNamespace(text="The answer is 18.", stats=dict(self.stats))

    def warm_up(self, problems, max_new_tokens, formats) -> None:
        self.log.append(("warm_up", self.name, len(problems), max_new_tokens, set(formats)))

    def close(self) -> None:
        self.log.append(("close", self.name))


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    """A bench run of an engine-like config and a sampling peer on 2 GSM8K prompts, with fake contenders."""
    log: list = []
    fakes = {"ar": FakeContender("ar", "config", ENGINE_STATS, None, log),
             "hf-generate": FakeContender("hf-generate", "peer", PEER_STATS, 7, log)}
    monkeypatch.setattr(bench, "build_contenders", lambda spec, names, structured=False, **_: {n: fakes[n] for n in spec.names if n in names})
    entries = (Entry(name="ar", config=load_config(ROOT / "configs" / "ar.yaml")),
               Entry(name="lossy[k=0.5]", config=load_config(ROOT / "configs" / "adaptivespec-lossy.yaml"),
                     sweep={"verifier.kappa": 0.5}))
    spec = BenchSpec(entries=entries[:1], peers=("hf-generate",), dataset="gsm8k", limit=2, max_new_tokens=16)
    problems = load_dataset("gsm8k", limit=2)
    out = tmp_path / "run"
    results = bench.run_bench(spec, problems, out, progress=False)
    return SimpleNamespace(out=out, results=results, log=log, spec=spec, problems=problems, sweep_entry=entries[1])


def test_records_jsonl_lines_keep_their_keys_in_order(fake_run):
    lines = [json.loads(line) for line in (fake_run.out / "records.jsonl").read_text().splitlines()]
    assert [(r["index"], r["config"]) for r in lines] == [(0, "ar"), (0, "hf-generate"), (1, "hf-generate"), (1, "ar")]
    for line in lines:
        assert list(line) == (ENGINE_LINE if line["config"] == "ar" else PEER_LINE), line["config"]
        assert line["accepted"] == [2, 0]
    assert [r["seed"] for r in lines if r["config"] == "hf-generate"] == [7, 8]
    assert lines[0]["accepted_by_source"] == {"head": 2} and lines[0]["mask_ms_per_step"] == 0.3


def test_runner_drives_contenders_through_the_protocol(fake_run):
    log = fake_run.log
    warm = [e for e in log if e[0] == "warm_up"]
    assert warm == [("warm_up", "ar", 2, WARMUP_TOKENS, set()), ("warm_up", "hf-generate", 2, WARMUP_TOKENS, set())]
    assert max(log.index(w) for w in warm) < min(i for i, e in enumerate(log) if e[0] == "generate")
    assert [e for e in log if e[0] == "generate"] == [("generate", n, 16) for n in ("ar", "hf-generate", "hf-generate", "ar")]
    assert log[-2:] == [("close", "ar"), ("close", "hf-generate")]


def test_results_json_keeps_its_keys_in_order(fake_run):
    saved = json.loads((fake_run.out / "results.json").read_text())
    assert saved == fake_run.results and list(saved) == ["meta", "reference", "ar", "eagle3", "configs"]
    assert list(saved["meta"]) == META
    rows = {r["name"]: r for r in saved["configs"]}
    assert list(rows["ar"]) == CONFIG_ROW and list(rows["hf-generate"]) == PEER_ROW
    assert all(list(rec) == ROW_RECORD for r in rows.values() for rec in r["records"])
    assert list(rows["ar"]["accepted_per_step"]) == ["steps", "mean", "histogram"]
    settings = json.loads((fake_run.out / "settings.json").read_text())
    assert list(settings) == SETTINGS


def test_sweep_and_category_rows_keep_their_keys(fake_run):
    spec = BenchSpec(entries=(fake_run.spec.entries[0], fake_run.sweep_entry), dataset="specbench", max_new_tokens=16,
                     extra={"sweep": {"params": {"verifier.kappa": [0.5]}}})
    problems = load_dataset("specbench", limit=2)
    recs = [RunRecord.from_stats(ENGINE_STATS, config=name, id=p.id, index=i, text="x")
            for i, p in enumerate(problems) for name in ("ar", "lossy[k=0.5]")]
    res = report.summarize(spec, problems, recs)
    assert list(res) == ["meta", "reference", "ar", "eagle3", "sweep", "configs", "categories"]
    assert list(res["configs"][1]) == SWEEP_ROW
    cat = next(iter(res["categories"].values()))
    assert list(cat) == ["prompts", "reference", "ar", "eagle3", "configs"]
    assert list(cat["configs"][0]) == CATEGORY_ROW and list(cat["configs"][1]) == [*CATEGORY_ROW, "sweep"]


def test_a_line_reads_back_to_the_same_json(fake_run):
    for text in (fake_run.out / "records.jsonl").read_text().splitlines():
        assert json.dumps(RunRecord.from_json(json.loads(text)).to_json()) == text
    old = {"config": "ar", "id": "gsm8k/0", "index": 0, "new_tokens": 4, "wall_seconds": 1.0}  # fields missing
    record = RunRecord.from_json(old)
    assert record.target_forwards is None and record.accepted == () and record.more_stats == {}


# -- module structure ----------------------------------------------------------------------------------------
def _evaluation_imports(tree: ast.Module, top_level: bool) -> set[str]:
    """Modules of adaptivespec.evaluation imported at module level (``top_level``) or inside functions."""
    nodes = tree.body if top_level else [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                         for n in ast.walk(f)]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("adaptivespec.evaluation"):
            if node.module == "adaptivespec.evaluation":
                out |= {a.name for a in node.names if (EVALUATION / f"{a.name}.py").is_file()}
            else:
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("adaptivespec.evaluation.")}
    return out


def test_evaluation_modules_import_downwards_only():
    """Module-level imports between evaluation modules form no cycle; none hides an import of another
    evaluation module inside a function (the CLI module alone imports lazily, to keep start-up light)."""
    trees = {p.stem: ast.parse(p.read_text()) for p in EVALUATION.glob("*.py")}
    graph = {name: _evaluation_imports(tree, top_level=True) - {name} for name, tree in trees.items()}
    assert graph["bench"] >= {"contenders", "peers", "sglang_contenders", "report", "rundir", "spec"}
    done: list[str] = []
    while len(done) < len(graph):  # peel modules whose imports are all done: a cycle leaves some forever
        ready = [m for m in graph if m not in done and graph[m] <= set(done)]
        assert ready, f"import cycle among {sorted(set(graph) - set(done))}"
        done += ready
    hidden = {name: _evaluation_imports(tree, top_level=False) for name, tree in trees.items() if name != "cli"}
    assert {k: v for k, v in hidden.items() if v} == {}


def test_evaluation_modules_are_short():
    sizes = {p.name: len(p.read_text().splitlines()) for p in EVALUATION.glob("*.py")}
    assert max(sizes.values()) <= 350, sizes


@pytest.mark.parametrize("path", ["adaptivespec.evaluation.contenders:ConfigContender",
                                  "adaptivespec.evaluation.peers:HfPeer",
                                  "adaptivespec.evaluation.sglang_contenders:SGLangContender"])
def test_every_contender_implements_the_protocol(path):
    import importlib

    from adaptivespec.evaluation.contenders import Contender

    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    methods = [m for m in ("encode", "seed_for", "generate_ids", "warm_up", "close") if not callable(getattr(cls, m, None))]
    assert methods == [], f"{name} lacks {methods}"
    assert set(Contender.__annotations__) == {"name", "kind", "lossless"}
