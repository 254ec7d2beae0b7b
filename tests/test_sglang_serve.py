"""adaptivespec serve: the SGLang command line and environment (nothing is launched)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

import pytest

from adaptivespec.errors import AdaptiveSpecError
import adaptivespec
from adaptivespec import plugins
from adaptivespec import serve as front_door
from adaptivespec.policies.static import StaticPolicy
from adaptivespec.sglang import CONFIG_ENV, platform, serve
from adaptivespec.sglang.controller import build_strategies
from adaptivespec.strategies import Verifier
from adaptivespec.sglang.api import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = "meta-llama/Llama-3.1-8B-Instruct", "/models/eagle3-llama3.1-8b"


@pytest.fixture(autouse=True)
def cuda_by_default(monkeypatch):
    """Commands as on a CUDA machine unless a test says ``device="cpu"`` (this one may have no GPU)."""
    monkeypatch.setattr(serve, "detect_device", lambda: "cuda")
    monkeypatch.setattr(platform, "detect_device", lambda: "cuda")


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "static.yaml"
    path.write_text("policy: {name: static, nsteps: 5, topk: 4, ndt: 8}\nverifier: strict\n")
    return path


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_build_command_launches_eagle3_at_the_largest_shape(config):
    argv = serve.build_command(config, TARGET, DRAFTER, "0.0.0.0", 31000, ["--mem-fraction-static", "0.8"])
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == TARGET
    assert flag(argv, "--speculative-algorithm") == "EAGLE3"
    assert flag(argv, "--speculative-draft-model-path") == DRAFTER
    assert (flag(argv, "--speculative-num-steps"), flag(argv, "--speculative-eagle-topk"),
            flag(argv, "--speculative-num-draft-tokens")) == ("5", "4", "8")
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("0.0.0.0", "31000")
    assert "--disable-overlap-schedule" in argv and "--speculative-adaptive" not in argv
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert "--disable-overlap-schedule" not in serve.build_command(config, TARGET, DRAFTER, overlap=True)


def test_bank_shapes_and_start_shape(config):
    shapes, top = serve.bank_shapes(config)
    assert [str(s) for s in shapes] == ["(5,4,8)"] and str(top) == "(5,4,8)"


def test_models_default_to_the_config(tmp_path, config):
    path = tmp_path / "models.yaml"
    path.write_text(f"model: {{target: {TARGET}, drafter: {DRAFTER}}}\npolicy: {{name: static}}\n")
    argv = serve.build_command(path)
    assert flag(argv, "--model-path") == TARGET and flag(argv, "--speculative-draft-model-path") == DRAFTER
    ar = tmp_path / "ar.yaml"
    ar.write_text("model: {drafter: null}\n")
    plain = serve.build_command(ar, TARGET, device="cuda")  # plain decoding: SGLang alone
    assert flag(plain, "--model-path") == TARGET and not any(a.startswith("--speculative") for a in plain)
    assert "--disable-overlap-schedule" not in plain  # no policy to feed: SGLang's default scheduler
    assert serve.CONFIG_ENV not in serve.build_env(ar, {"PATH": "/bin"}, device="cuda")  # the plugin stays out


def test_configs_with_sources_are_served_with_their_draft_stage(tmp_path):
    for name in ("hybrid.yaml", "cost-aware-hybrid.yaml", "learned-hybrid.yaml"):
        path = ROOT / "configs" / name
        assert serve.unservable(path) is None
        argv = serve.build_command(path, device="cuda")
        assert flag(argv, "--speculative-algorithm") == "EAGLE3"
        assert serve.build_env(path, {"PATH": "/bin"}, device="cuda")[serve.CONFIG_ENV] == str(path.resolve())


def test_embedded_pair_serves_the_converted_folder_and_the_head_folder(capsys, monkeypatch):
    from adaptivespec.drafter import EMBEDDED_HEAD
    from adaptivespec.models import EMBEDDED, cache_dir

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    cli = pytest.importorskip("adaptivespec.cli")
    code = cli.main(["serve", "--config", str(ROOT / "configs" / "adaptivespec.yaml"), "--print-command"])
    out, err = capsys.readouterr()
    assert code == 0, err
    argv = shlex.split(out.strip())
    assert flag(argv, "--model-path") == str(cache_dir() / EMBEDDED)
    assert (cache_dir() / EMBEDDED / "config.json").is_file()  # converted if it was not already
    assert flag(argv, "--speculative-draft-model-path") == str(EMBEDDED_HEAD)
    assert (EMBEDDED_HEAD / "model.safetensors").is_file()


def test_env_points_the_plugin_at_the_config(config):
    env = serve.build_env(config, {"PATH": "/bin"})
    assert env[CONFIG_ENV] == str(config.resolve()) and env["PATH"] == "/bin" and "SGLANG_PLUGINS" not in env
    assert serve.build_env(config, {"SGLANG_PLUGINS": "xpu_hooks"})["SGLANG_PLUGINS"] == "xpu_hooks,adaptivespec"
    assert serve.build_env(config, {"SGLANG_PLUGINS": "adaptivespec"})["SGLANG_PLUGINS"] == "adaptivespec"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adaptivespec")
    front_door.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_print_command(config, capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    args = parse(["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--port", "31000",
                  "--print-command", "--", "--mem-fraction-static", "0.8"])
    assert args.func is front_door.run_serve
    assert front_door.run_serve(args) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{CONFIG_ENV}={config.resolve()} {sys.executable} -m sglang.launch_server ")
    for part in ("--speculative-algorithm EAGLE3", f"--speculative-draft-model-path {DRAFTER}", "--speculative-num-steps 5",
                 "--speculative-eagle-topk 4", "--speculative-num-draft-tokens 8", "--port 31000"):
        assert part in line
    assert line.endswith("--disable-overlap-schedule --enable-metrics --mem-fraction-static 0.8")


def test_context_length_becomes_sglangs_own_flag_once(config, capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    base = ["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--print-command"]
    assert front_door.run_serve(parse([*base, "--context-length", "4096"])) == 0
    assert capsys.readouterr().out.strip().endswith("--context-length 4096")
    # given to SGLang by hand as well: SGLang's value stands, the flag is not repeated
    assert front_door.run_serve(parse([*base, "--context-length", "4096", "--", "--context-length", "2048"])) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("--context-length 2048") and line.count("--context-length") == 1


def test_cli_subcommand_prints_the_command(config, capsys):
    cli = pytest.importorskip("adaptivespec.cli")
    code = cli.main(["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--print-command"])
    assert code == 0 and "--speculative-algorithm EAGLE3" in capsys.readouterr().out


def test_serve_without_sglang_fails_in_one_line(config, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    monkeypatch.setattr(serve.os, "execvpe", lambda *a: pytest.fail("must not exec"))
    args = parse(["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--runtime", "sglang"])
    with pytest.raises(AdaptiveSpecError) as err:
        front_door.run_serve(args)
    assert str(err.value) == (f"sglang is not installed; install it on a CUDA machine with: "
                              f"pip install 'adaptivespec[sglang]' (sglang=={SGLANG_VERSION}); "
                              "on an x86 CPU with AMX or AVX-512 bf16: scripts/install_sglang_cpu.sh")


def test_serve_checks_the_api_then_execs(config, monkeypatch):
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(platform, "installed_version", lambda: SGLANG_VERSION)
    monkeypatch.setattr(platform, "check_api", lambda: ["x.y: not found"])
    args = parse(["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--runtime", "sglang"])
    with pytest.raises(AdaptiveSpecError, match="lacks what the plugin .* needs: x.y: not found"):
        front_door.run_serve(args)
    calls = []
    monkeypatch.setattr(platform, "check_api", lambda: [])
    monkeypatch.setattr(serve.os, "execvpe", lambda *a: calls.append(a))
    front_door.run_serve(args)
    (file, argv, env), = calls
    assert file == sys.executable and argv[1:3] == ["-m", "sglang.launch_server"]
    assert env[CONFIG_ENV] == str(config.resolve())


def test_sampling_settings_become_sglang_defaults(tmp_path):
    path = tmp_path / "sampled.yaml"
    path.write_text("policy: {name: static, nsteps: 5, topk: 4, ndt: 8}\nverifier: strict\n"
                    "generation: {temperature: 0.7, top_p: 0.9}\n")
    argv = serve.build_command(path, TARGET, DRAFTER)
    import json

    assert json.loads(flag(argv, "--preferred-sampling-params")) == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0}
    mine = ["--preferred-sampling-params", '{"temperature": 1.0}']
    assert serve.build_command(path, TARGET, DRAFTER, extra_args=mine).count("--preferred-sampling-params") == 1


def test_greedy_config_adds_no_sampling_flag(config):
    assert "--preferred-sampling-params" not in serve.build_command(config, TARGET, DRAFTER)


def test_margin_at_temperature_is_refused(tmp_path, capsys):
    path = tmp_path / "margin.yaml"
    path.write_text("policy: {name: dcs}\nverifier: {name: margin, kappa: 0.5}\ngeneration: {temperature: 0.7}\n")
    with pytest.raises(AdaptiveSpecError, match="verifier 'margin' at generation.temperature 0.7: SGLang samples"):
        serve.build_command(path, TARGET, DRAFTER)
    from adaptivespec.cli import main

    assert main(["serve", "--config", str(path), "--target", TARGET, "--drafter", DRAFTER, "--print-command"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no form" in err


# -- CPU (SGLang's Intel AMX backend) ---------------------------------------------------------------
def test_cpu_command_has_device_dtype_and_kv_size(config):
    argv = serve.build_command(config, TARGET, DRAFTER, device="cpu")
    assert flag(argv, "--device") == "cpu" and flag(argv, "--dtype") == "bfloat16"
    assert int(flag(argv, "--max-total-tokens")) >= 8192
    assert flag(argv, "--host") == "127.0.0.1"
    assert argv.count("--sleep-on-idle") == 1  # an idle CPU server does not busy-poll a core
    # what the user passes after -- wins and is not doubled
    argv = serve.build_command(config, TARGET, DRAFTER, extra_args=["--max-total-tokens", "4096"], device="cpu")
    assert argv.count("--max-total-tokens") == 1 and flag(argv, "--max-total-tokens") == "4096"


def test_gpu_command_is_unchanged_by_the_cpu_path(config):
    argv = serve.build_command(config, TARGET, DRAFTER, device="cuda")
    assert "--device" not in argv and "--dtype" not in argv and "--max-total-tokens" not in argv
    assert "--sleep-on-idle" not in argv
    env = serve.build_env(config, {"PATH": "/bin"}, device="cuda")
    assert "SGLANG_USE_CPU_ENGINE" not in env and "LD_PRELOAD" not in env


def test_cpu_refuses_float32(config):
    with pytest.raises(AdaptiveSpecError, match="--dtype float32: SGLang's CPU kernels run bfloat16 only"):
        serve.build_command(config, TARGET, DRAFTER, extra_args=["--dtype", "float32"], device="cpu")


def test_kv_tokens_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64, '
                                          '"hidden_size": 576, "num_attention_heads": 9}')
    per_token = 30 * 2 * 3 * 64 * 2
    assert platform.kv_tokens(str(tmp_path), available=20 * (1 << 30)) == (1 << 30) // per_token // 1024 * 1024
    assert platform.kv_tokens(str(tmp_path), available=1 << 20) == 8192  # floor: one 8k request
    assert platform.kv_tokens(str(tmp_path / "missing"), available=20 * (1 << 30)) > 8192


def test_cpu_env_binds_threads_and_preloads_what_exists(config, monkeypatch):
    env = serve.build_env(config, {"PATH": "/bin"}, device="cpu", trace="steps.jsonl")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    cpus = sorted(os.sched_getaffinity(0))
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].split(",")[0].startswith(str(cpus[0]))
    assert all(Path(p).is_file() for p in env.get("LD_PRELOAD", "").split(":") if p)
    assert env[serve.TRACE_ENV] == str(Path("steps.jsonl").resolve())
    kept = serve.build_env(config, {"SGLANG_CPU_OMP_THREADS_BIND": "3", "LD_PRELOAD": ""}, device="cpu")
    assert kept["SGLANG_CPU_OMP_THREADS_BIND"] == "3" and kept["LD_PRELOAD"] == ""
    assert platform._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("name,missing", [("grammar.yaml", "sources [grammar] with model.drafter null"),
                                          ("retrieval.yaml", "sources [retrieval] with model.drafter null")])
def test_serve_refuses_what_sglang_cannot_express_in_one_line(name, missing, capsys):
    cli = pytest.importorskip("adaptivespec.cli")
    code = cli.main(["serve", "--config", str(ROOT / "configs" / name), "--print-command"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and missing in err and "Traceback" not in err


def test_print_command_on_cpu_shows_the_cpu_environment(capsys, monkeypatch):
    cli = pytest.importorskip("adaptivespec.cli")
    monkeypatch.setattr(serve, "detect_device", lambda: "cpu")
    monkeypatch.setattr(platform, "detect_device", lambda: "cpu")
    code = cli.main(["serve", "--config", str(ROOT / "configs" / "adaptivespec-dynamic.yaml"), "--print-command",
                     "--trace", "t.jsonl"])
    out = capsys.readouterr().out
    assert code == 0 and "SGLANG_USE_CPU_ENGINE=1" in out and "SGLANG_CPU_OMP_THREADS_BIND=" in out
    assert "--device cpu" in out and "--dtype bfloat16" in out and f"{serve.TRACE_ENV}=" in out


def test_load_profile_auto_serves_adaptive_policies_load_aware_on_cpu_and_leaves_static_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "detect_device", lambda: "cpu")
    monkeypatch.setattr(platform, "detect_device", lambda: "cpu")
    dynamic, static = ROOT / "configs" / "adaptivespec-dynamic.yaml", ROOT / "configs" / "eagle3.yaml"
    shipped = serve.load_profile(dynamic)
    assert shipped is not None and shipped.name == serve.SERVED_CPU_PROFILE and shipped.is_file()
    assert serve.load_profile(static) is None  # the static baseline stays static
    assert serve.load_profile(dynamic, "none") is None
    assert serve.load_profile(dynamic, device="cuda") is None  # no GPU profile ships
    env = serve.build_env(dynamic, {}, device="cpu", load_profile=shipped)
    assert env[serve.LOAD_PROFILE_ENV] == str(shipped)
    with pytest.raises(AdaptiveSpecError, match="--load-profile: file 'nope.json' not found"):
        serve.load_profile(dynamic, "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(AdaptiveSpecError, match="not a cost profile"):
        serve.load_profile(dynamic, str(bad))


def test_bad_load_profile_is_one_line_exit_2(capsys):
    cli = pytest.importorskip("adaptivespec.cli")
    code = cli.main(["serve", "--config", str(ROOT / "configs" / "adaptivespec-dynamic.yaml"), "--print-command",
                     "--load-profile", "missing.json"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--load-profile" in err and "missing.json" in err


def test_metrics_are_on_by_default_and_no_metrics_turns_both_off(config, capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    base = ["serve", "--config", str(config), "--target", TARGET, "--drafter", DRAFTER, "--print-command"]
    assert front_door.run_serve(parse(base)) == 0
    on = capsys.readouterr().out
    assert " --enable-metrics" in on and "ADAPTIVESPEC_SGLANG_METRICS" not in on
    assert front_door.run_serve(parse(base + ["--no-metrics"])) == 0
    off = capsys.readouterr().out
    assert "--enable-metrics" not in off and "ADAPTIVESPEC_SGLANG_METRICS=0" in off
    given = serve.build_command(config, TARGET, DRAFTER, extra_args=["--enable-metrics"])
    assert given.count("--enable-metrics") == 1  # passed after --: not twice


class ExactVerifier(Verifier):
    """A third-party verifier that declares itself lossless (as strict does)."""

    name = "exact"
    lossless = True
    supports_sampling = True


class NearVerifier(Verifier):
    name = "near"
    lossless = False
    supports_sampling = True


class FixedPolicy(StaticPolicy):
    """A third-party policy that keeps one shape (as static does), under another name."""

    name = "fixed"
    adapts_shape = False


class Capabilities:
    @staticmethod
    @adaptivespec.hookimpl
    def adaptivespec_register_verifiers(registry):
        registry.register(ExactVerifier)
        registry.register(NearVerifier)

    @staticmethod
    @adaptivespec.hookimpl
    def adaptivespec_register_policies(registry):
        registry.register(FixedPolicy)


def test_capabilities_not_names_decide_how_a_strategy_is_served(monkeypatch, tmp_path):
    monkeypatch.setattr(plugins, "_HOST", plugins.make_plugin_host([Capabilities]))
    monkeypatch.setattr(serve, "detect_device", lambda: "cpu")

    def write(name, text):
        (tmp_path / name).write_text("model:\n  target: smollm2-135m-instruct\n  drafter: embedded\n" + text)
        return tmp_path / name

    exact = write("exact.yaml", "policy: fixed\nverifier: exact\ngeneration:\n  temperature: 0.7\n")
    sc = serve.served_config(exact)
    assert build_strategies(sc.config)[1] is None  # SGLang's own verify stands in, as for strict
    assert serve.load_profile(sc) is None  # a policy that keeps one shape is not shrunk, as static is not
    assert "--preferred-sampling-params" in serve.sampling_args(sc)  # lossless: SGLang's tree sampling serves it
    near = write("near.yaml", "policy: dcs\nverifier: near\ngeneration:\n  temperature: 0.7\n")
    assert isinstance(build_strategies(serve.served_config(near).config)[1], NearVerifier)
    assert serve.load_profile(near) is not None  # dcs adapts its shape
    with pytest.raises(AdaptiveSpecError, match="verifier 'near' at generation.temperature 0.7"):
        serve.sampling_args(near)


@pytest.mark.parametrize("kind,name,flag,expected", [
    ("policies", "static", "adapts_shape", False), ("policies", "dcs", "adapts_shape", True),
    ("policies", "cost_aware", "adapts_shape", True), ("policies", "talon", "adapts_shape", True),
    ("verifiers", "strict", "lossless", True), ("verifiers", "margin", "lossless", False),
    ("verifiers", "fly", "lossless", False),
])
def test_shipped_strategies_declare_the_capabilities_serving_reads(kind, name, flag, expected):
    """static keeps its one shape and strict is SGLang's own rule; TALON inherits the base's adapting
    default and FLy declares itself lossy, so neither is served as a built-in of the other kind."""
    registry = getattr(plugins.get_plugin_host(), kind)
    if name not in registry:
        pytest.skip(f"{kind[:-1]} {name!r} is not installed (plugins/adaptivespec-{name})")
    assert getattr(registry.get(name).cls, flag) is expected


@pytest.mark.parametrize("config_name,shrunk", [("talon.yaml", True), ("eagle3.yaml", False)])
def test_load_profile_auto_follows_the_policy_capability_of_a_shipped_config(config_name, shrunk, monkeypatch):
    monkeypatch.setattr(serve, "detect_device", lambda: "cpu")
    sc = serve.served_config(ROOT / "configs" / config_name)
    assert (serve.load_profile(sc) is not None) is shrunk


def test_a_lossy_plugin_verifier_runs_in_the_plugin_not_in_sglangs_kernel():
    if "fly" not in plugins.get_plugin_host().verifiers:
        pytest.skip("verifier 'fly' is not installed (plugins/adaptivespec-fly)")
    sc = serve.served_config(ROOT / "configs" / "fly.yaml")
    assert build_strategies(sc.config)[1].name == "fly"  # the eagle_sample hook runs it on greedy batches
    assert build_strategies(serve.served_config(ROOT / "configs" / "eagle3.yaml").config)[1] is None  # strict: SGLang's
