"""Config and CLI errors: one clear line naming the key/argument, the value and what was expected; exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptivespec.cli import main
from adaptivespec.config import load_config
from adaptivespec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
AR = str(ROOT / "configs" / "ar.yaml")


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "yaml_text, overrides, expected",
    [
        ("model:\n  targt: x\n", [], "model.targt: unknown key; expected one of: target, drafter, drafter_kind"),
        ("modle: {}\n", [], "modle: unknown top-level key; expected one of: model, runtime, policy, verifier, generation"),
        ("generation:\n  max_new_tokens: '12'\n", [], "generation.max_new_tokens: expected an integer, got '12'"),
        ("generation:\n  max_new_tokens: true\n", [], "generation.max_new_tokens: expected an integer, got True"),
        ("generation:\n  max_new_tokens: 0\n", [], "generation.max_new_tokens: expected a positive integer, got 0"),
        ("runtime:\n  dtype: float16\n", [], "runtime.dtype: expected one of auto, float32, bfloat16, got 'float16'"),
        ("verifier:\n  name: margin\n  kappa: 1.5\n", [], "verifier.kappa: expected a number in (0, 1], got 1.5"),
        ("policy:\n  name: statik\n", [], "policy.name: unknown policy 'statik'; registered policies:"),
        ("verifier:\n  name: nope\n", [], "verifier.name: unknown verifier 'nope'; registered verifiers:"),
        ("policy:\n  name: static\n  nsteps: 2\n  topk: 1\n  ndt: 8\n", [], "policy.ndt: ndt - 1 = 7 drafted nodes cannot be kept from a tree of nsteps=2, topk=1"),
        ("{}\n", ["verifier.name=margin", "verifier.kappa=0"], "verifier.kappa: expected a number in (0, 1], got 0"),
        ("{}\n", ["policy.topk=two"], "policy.topk: expected an integer, got 'two'"),
        ("{}\n", ["runtime.name=jax"], "runtime.name: unknown runtime 'jax'; registered runtimes: llamacpp, torch"),
        ("- a\n- b\n", [], "expected a mapping"),
        ("model: [\n", [], "invalid YAML at line"),
    ],
)
def test_config_errors_name_key_value_and_expectation(tmp_path, yaml_text, overrides, expected):
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert message.startswith(path + ": ") or message.startswith("--set")
    assert expected in message
    assert "\n" not in message


def test_unknown_strategy_lists_registered_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "verifier:\n  name: nope\n"))
    for name in ("strict", "margin"):
        assert name in str(info.value)


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match=r"--set: expected KEY=VALUE .* got 'verifier.kappa'"):
        load_config(AR, ["verifier.kappa"])
    with pytest.raises(ConfigError, match="--set: foo.bar: unknown key; expected one of: model"):
        load_config(AR, ["foo.bar=1"])


def test_overrides_apply_with_validation():
    cfg = load_config(AR, ["model.drafter=/x", "policy.nsteps=3", "policy.topk=2", "policy.ndt=6", "runtime.dtype=float32"])
    assert cfg.model.drafter == "/x" and cfg.policy.params.nsteps == 3 and cfg.runtime.dtype == "float32"
    assert cfg.to_dict()["policy"] == {"name": "static", "nsteps": 3, "topk": 2, "ndt": 6}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "--config", "missing.yaml", "--prompt", "hi"], "missing.yaml: config file not found"),
        (["generate", "--config", AR, "--prompt", "hi", "--set", "policy.bogus=1"], "policy.bogus: unknown key"),
        (["generate", "--config", AR, "--prompt", "hi", "--set", "novalue"], "--set: expected KEY=VALUE"),
        (["generate", "--config", AR, "--prompt", "hi", "--max-new-tokens", "-3"], "argument --max-new-tokens: expected a positive integer, got '-3'"),
        (["generate", "--config", AR], "one of the arguments --prompt --prompts is required"),
        (["generate", "--config", AR, "--prompts", "nope.jsonl"], "--prompts: nope.jsonl: file not found"),
        pytest.param(["generate", "--config", AR, "--prompt", "hi", "--set", "model.drafter=/no/such/dir"],
                     "model.drafter: '/no/such/dir' is not a folder", marks=pytest.mark.model),  # the target loads first
        (["generate", "--config", AR, "--prompt", "hi", "--set", "model.target=/no/such/model"], "model.target: cannot load '/no/such/model'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["generate", "--config", AR, "--prompt", "hi", "--set", "runtime.quantization=int4"],
         "runtime.quantization: expected one of none, int8, got 'int4'"),
        (["generate", "--config", AR, "--prompt", "hi", "--set", "runtime.quantization_groups=[down_proj]"],
         "runtime.quantization_groups: expected entries NAME=G with G a positive integer (e.g. down_proj=4), got 'down_proj'"),
    ],
)
def test_cli_errors_are_one_line_exit_2(capsys, argv, expected):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("adaptivespec: error: ")
    assert expected in lines[0]
    assert "Traceback" not in err


def test_bad_prompts_file_line(tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    code, _, err = run_cli(capsys, "generate", "--config", AR, "--prompts", str(p))
    assert code == 2 and f"{p}:2: expected an object with a string \"prompt\"" in err


def test_cli_subprocess_exit_code_and_no_traceback(tmp_path):
    bad = write(tmp_path, "verifier:\n  name: margin\n  kappa: 2\n")
    proc = subprocess.run([sys.executable, "-m", "adaptivespec.cli", "generate", "--config", bad, "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"adaptivespec: error: {bad}: verifier.kappa: expected a number in (0, 1], got 2"


def test_plugins_json_lists_builtins(capsys):
    code, out, _ = run_cli(capsys, "plugins", "--json")
    assert code == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    assert rows[("verifier", "strict")]["lossless"] is True
    assert rows[("verifier", "margin")]["lossless"] is False
    assert rows[("policy", "dcs")]["provider"] == "adaptivespec"
    assert ("runtime", "torch") in rows and ("drafter", "eagle3") in rows


@pytest.mark.parametrize("argv", [
    ["generate", "--config", AR, "--prompt", "x", "--set", "generation.max_new_tokens=many", "--max-new-tokens", "4"],
    ["generate", "--config", AR, "--prompt", "x", "--set", "generation.max_new_tokens=many", "--set", "generation.max_new_tokens=4"],
    ["generate", "--config", AR, "--prompt", "x", "--set", "runtime.dtype=float16", "--set", "runtime={dtype: float32}"],
    ["bench", "--configs", AR, "--dataset", "gsm8k", "--limit", "1", "--set", "generation.max_new_tokens=0", "--max-new-tokens", "4"],
])
def test_every_set_value_is_validated_even_when_overridden(capsys, tmp_path, argv):
    code, out, err = run_cli(capsys, *argv, *(["--out", str(tmp_path / "run")] if argv[0] == "bench" else []))
    assert code == 2 and out == ""
    key = argv[argv.index("--set") + 1].partition("=")[0]
    assert key in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_later_set_may_still_replace_a_valid_one():
    cfg = load_config(AR, ["generation.max_new_tokens=8", "generation.max_new_tokens=4", "runtime.dtype=float32",
                           "runtime={dtype: bfloat16}"])
    assert cfg.generation.max_new_tokens == 4 and cfg.runtime.dtype == "bfloat16"
