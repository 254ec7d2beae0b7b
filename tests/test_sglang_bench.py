"""bench with SGLang contenders, on a fake server (no sglang needed): command choice, requests, stats,
trace records, servers stopped when the run ends or fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation import sglang_contenders as sc
from adaptivespec.evaluation.peers import describe_peer, parse_peers

ROOT = Path(__file__).resolve().parents[1]


class FakeServer:
    instances: list["FakeServer"] = []

    def __init__(self, argv, env, log, timeout=None):
        self.argv, self.env, self.calls, self.started, self.stopped = argv, env, [], False, False
        FakeServer.instances.append(self)

    def start(self):
        self.started = True
        self.paused = False

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def stop(self):
        self.stopped = True

    def flush_cache(self):
        self.calls.append("flush")

    def generate(self, ids, n, **sampling):
        assert not self.paused, "a request to a paused server would hang"
        self.calls.append(("generate", len(ids), n, sampling))
        trace = self.env.get("ADAPTIVESPEC_SGLANG_TRACE")
        if trace:
            with open(trace, "a") as f:
                for shape, acc in (([5, 2, 8], 3), ([1, 4, 4], 0)):
                    f.write(json.dumps({"step": 0, "shape": shape, "bs": 1, "accepted": acc, "policy": {}}) + "\n")
        return {"text": "hi", "output_ids": [1] * 6,
                "meta_info": {"completion_tokens": 6, "spec_verify_ct": 2 if "--speculative-algorithm" in self.argv else None},
                "wall_seconds": 0.5}


@pytest.fixture(autouse=True)
def clean():
    FakeServer.instances = []


def test_peer_names_and_descriptions():
    assert parse_peers("sglang,sglang-eagle3,sglang-ngram,hf-generate") == ("sglang", "sglang-eagle3", "sglang-ngram", "hf-generate")
    with pytest.raises(AdaptiveSpecError, match="unknown peer 'sglang-medusa'.*sglang-ngram"):
        parse_peers("sglang-medusa")
    config = load_config(ROOT / "configs" / "eagle3.yaml")
    assert describe_peer("sglang-ngram", config)["speculative_num_draft_tokens"] == 12


@pytest.mark.parametrize("peer,algo", [("sglang", None), ("sglang-eagle3", "EAGLE3"), ("sglang-ngram", "NGRAM")])
def test_sglang_peers_run_sglang_alone(peer, algo):
    config = load_config(ROOT / "configs" / "eagle3.yaml")
    c = sc.SGLangContender(peer, config, peer=peer, server_factory=FakeServer)
    s = FakeServer.instances[-1]
    argv = s.argv
    assert s.started and argv[1:3] == ["-m", "sglang.launch_server"] and "ADAPTIVESPEC_CONFIG" not in s.env
    assert (argv[argv.index("--speculative-algorithm") + 1] if algo else None) == algo
    if peer == "sglang-eagle3":  # the shipped head at eagle3.yaml's shape
        assert [argv[argv.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                 "--speculative-num-draft-tokens")] == ["3", "4", "8"]
    assert argv[argv.index("--max-total-tokens") + 1] == str(sc.BENCH_KV_TOKENS) and argv.count("--max-total-tokens") == 1
    result = c.generate_ids([5, 6, 7], max_new_tokens=6)
    assert s.paused  # idle between its generations
    assert s.calls[0] == "flush" and s.calls[1] == ("generate", 3, 6, {})
    assert result.stats["new_tokens"] == 6 and result.stats["tokens_per_second"] == pytest.approx(12.0)
    assert result.stats["target_forwards"] == (2 if algo else 6) and result.records == []
    c.close()
    assert s.stopped


def test_backend_sglang_serves_the_loaded_config_with_its_trace():
    config = load_config(ROOT / "configs" / "adaptivespec-dynamic.yaml", ["policy.alpha=0.5"])
    path = sc.served_config_file(config, "dyn")
    assert load_config(path).policy.params.alpha == 0.5  # --set overrides travel to the server
    c = sc.SGLangContender("dyn", config, config_path=path, server_factory=FakeServer)
    s = FakeServer.instances[-1]
    assert s.env["ADAPTIVESPEC_CONFIG"] == str(Path(path).resolve()) and c.lossless and c.kind == "config"
    seen = []
    result = c.generate_ids([1, 2], max_new_tokens=6, on_step=lambda r: seen.append(r.accepted))
    assert seen == [3, 0] and [r.shape for r in result.records] == [(5, 2, 8), (1, 4, 4)]
    assert result.stats["accept_length_mean"] == pytest.approx(3.0)


def test_backend_sglang_refuses_configs_it_cannot_serve():
    config = load_config(ROOT / "configs" / "grammar.yaml")
    with pytest.raises(AdaptiveSpecError, match="sources \\[grammar\\] with model.drafter null"):
        sc.SGLangContender("grammar", config, config_path=sc.served_config_file(config, "grammar"), server_factory=FakeServer)


def test_run_bench_stops_every_server_even_when_a_generation_fails(tmp_path, monkeypatch):
    from adaptivespec.evaluation import bench
    from adaptivespec.evaluation.datasets import Problem
    from adaptivespec.evaluation.spec import BenchSpec, Entry

    class Broken(FakeServer):
        def generate(self, ids, n, **sampling):
            if len(self.calls) > 3:
                raise AdaptiveSpecError("boom")
            return super().generate(ids, n, **sampling)

    real = sc.SGLangContender.__init__
    monkeypatch.setattr(sc.SGLangContender, "__init__",
                        lambda self, *a, **k: real(self, *a, **{**k, "server_factory": Broken}))
    entries = (Entry(name="eagle3", config=load_config(ROOT / "configs" / "eagle3.yaml")),)
    spec = BenchSpec(entries=entries, peers=("sglang",), dataset="gsm8k", max_new_tokens=6, backend="sglang")
    problems = [Problem(id=f"p{i}", prompt="2+2?", reference="4", task="gsm8k") for i in range(3)]
    with pytest.raises(AdaptiveSpecError, match="boom"):
        bench.run_bench(spec, problems, tmp_path / "run", progress=False)
    assert len(FakeServer.instances) == 2 and all(s.stopped for s in FakeServer.instances)
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["backend"] == "sglang"


def test_a_prompts_response_format_goes_to_sglangs_constrained_decoding():
    pytest.importorskip("xgrammar")
    from adaptivespec.response_format import ResponseFormat

    config = load_config(ROOT / "configs" / "eagle3.yaml")
    c = sc.SGLangContender("sglang", config, peer="sglang", server_factory=FakeServer)
    c.generate_ids([5, 6, 7], max_new_tokens=6, response_format=ResponseFormat(type="regex", pattern="[0-9]+"))
    c.generate_ids([5, 6, 7], max_new_tokens=6)
    sent = [call[3] for call in FakeServer.instances[-1].calls if call != "flush"]
    assert sent == [{"regex": "[0-9]+"}, {}]


def test_sglangs_adaptive_mode_is_a_row_that_says_not_supported_when_it_cannot_start(tmp_path, monkeypatch):
    from adaptivespec.evaluation import bench
    from adaptivespec.evaluation.datasets import Problem
    from adaptivespec.evaluation.spec import BenchSpec, Entry
    from adaptivespec.sglang.server import peer_command

    argv, _ = peer_command("sglang-adaptive", 31000, device="cuda")
    assert "--speculative-adaptive" in argv and argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"

    class RefusesAdaptive(FakeServer):
        def start(self):
            if "--speculative-adaptive" in self.argv:
                raise AdaptiveSpecError("SGLang server exited with 1 at start-up: NotImplementedError: init_cuda_graph_state")
            return super().start()

    real = sc.SGLangContender.__init__
    monkeypatch.setattr(sc.SGLangContender, "__init__",
                        lambda self, *a, **k: real(self, *a, **{**k, "server_factory": RefusesAdaptive}))
    entries = (Entry(name="eagle3", config=load_config(ROOT / "configs" / "eagle3.yaml")),)
    spec = BenchSpec(entries=entries, peers=("sglang", "sglang-adaptive"), dataset="gsm8k", max_new_tokens=6,
                     backend="sglang")
    problems = [Problem(id=f"p{i}", prompt="2+2?", reference="4", task="gsm8k") for i in range(2)]
    results = bench.run_bench(spec, problems, tmp_path / "run", progress=False)
    assert [r["name"] for r in results["configs"]] == ["eagle3", "sglang"]
    assert results["unsupported"]["sglang-adaptive"].startswith("not supported here: SGLang server exited")
    md = (tmp_path / "run" / "results.md").read_text()
    assert "| `sglang-adaptive` | not supported here: SGLang server exited" in md
    again = bench.run_bench(spec, problems, tmp_path / "run", progress=False)  # a resume does not retry it
    assert again["unsupported"] == results["unsupported"]
    # any other peer's failure to start is an error, as before
    monkeypatch.setattr(RefusesAdaptive, "start", lambda self: (_ for _ in ()).throw(AdaptiveSpecError("no server")))
    with pytest.raises(AdaptiveSpecError, match="no server"):
        bench.run_bench(spec, problems, tmp_path / "run2", progress=False)
