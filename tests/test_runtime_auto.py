"""``runtime.name: auto``: llama.cpp where it is installed and was measured faster on this kind of
CPU, torch elsewhere (no model: the choice is made when the config loads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from adaptivespec import hardware
from adaptivespec.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def runtime(config: str, *extra: str) -> str:
    return load_config(ROOT / "configs" / f"{config}.yaml", ["runtime.name=auto", *extra]).runtime.name


@pytest.fixture
def installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))


def test_without_llama_cpp_auto_is_torch(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    monkeypatch.setenv("ADAPTIVESPEC_CPU_ISA", "avx2")
    assert {runtime(c) for c in ("ar", "hybrid", "cost-aware-hybrid")} == {"torch"}


def test_without_fast_bf16_every_config_takes_llama_cpp(installed, monkeypatch):
    monkeypatch.setenv("ADAPTIVESPEC_CPU_ISA", "avx2")
    assert {runtime(c) for c in ("ar", "hybrid", "adaptivespec", "cost-aware-hybrid")} == {"llamacpp"}
    assert runtime("hybrid", "model.target=/models/x.q8_0.gguf") == "llamacpp"
    # what llama.cpp cannot run: a transformers folder, torch's int8, a GPU
    assert runtime("hybrid", "model.target=/models/some-folder") == "torch"
    assert runtime("ar-int8") == "torch"
    assert runtime("hybrid", "runtime.device=cuda") == "torch"


@pytest.mark.parametrize("level", ["avx512_bf16", "amx"])
def test_with_fast_bf16_auto_is_torch(installed, monkeypatch, level):
    monkeypatch.delenv("ADAPTIVESPEC_CPU_ISA", raising=False)
    monkeypatch.setattr(hardware, "isa", lambda flags=None: level)
    monkeypatch.setattr(hardware, "fast_bf16", lambda device="cpu": True)
    assert {runtime(c) for c in ("ar", "hybrid", "cost-aware-hybrid")} == {"torch"}


def test_an_explicit_runtime_is_kept(installed):
    assert load_config(ROOT / "configs" / "hybrid.yaml").runtime.name == "torch"


def test_serving_on_llamacpp_is_one_generation_at_a_time(capsys):
    from adaptivespec.cli import main

    assert main(["serve", "--config", str(ROOT / "configs" / "hybrid.yaml"), "--runtime", "llamacpp", "--parallel", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--parallel: 2 with --runtime llamacpp; expected 1" in err[0]


def test_the_bench_serves_a_llamacpp_config_with_serve_runtime_llamacpp():
    from adaptivespec.server.launch import torch_command

    argv = torch_command("c.yaml", 9999, runtime="llamacpp")
    assert argv[argv.index("--runtime") + 1] == "llamacpp"
    assert torch_command("c.yaml", 9999)[torch_command("c.yaml", 9999).index("--runtime") + 1] == "torch"
