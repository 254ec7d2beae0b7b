"""Shared fixtures: the embedded target in float32 and drafter heads for tests."""

from __future__ import annotations

import pytest
import torch

from shared_prompts import PROMPTS  # noqa: F401 - re-exported for fixtures

MODEL_FIXTURES = frozenset({"smol32", "random_head_dir", "full_vocab_head_dir", "greedy_reference"})
"""Fixtures that load the embedded target: a test using one (even indirectly) carries ``@pytest.mark.model``."""


@pytest.fixture(autouse=True)
def _model_loads_carry_the_marker(request, monkeypatch):
    """Fail a test that loads a model without the ``model`` marker, so ``-m "not model"`` stays fast.

    Catches the shared fixtures by name and any in-process load that succeeds (the engine's
    :func:`load_models`, a transformers ``from_pretrained``); a load that fails on a bad path is left to fail
    as it would, for the tests of those error messages."""
    if request.node.get_closest_marker("model") or request.node.get_closest_marker("sglang_server"):
        yield
        return
    used = sorted(MODEL_FIXTURES.intersection(request.fixturenames))
    if used:
        pytest.fail(f"{request.node.nodeid} uses {', '.join(used)} (the embedded model) without @pytest.mark.model")

    def loaded_means_failed(load):
        def guarded(*args, **kwargs):
            load(*args, **kwargs)  # a load that fails (a bad path: an error-message test) fails as it would
            raise AssertionError(f"{request.node.nodeid} loads a model without @pytest.mark.model")

        return guarded

    import transformers

    import adaptivespec.decode

    monkeypatch.setattr(adaptivespec.decode, "load_models", loaded_means_failed(adaptivespec.decode.load_models))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        loaded_means_failed(transformers.AutoModelForCausalLM.from_pretrained))
    yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.needs("bf16_kernels")`` (any :func:`adaptivespec.hardware.has` feature, or
    ``fast_bf16``): skip where this CPU (as ``$ADAPTIVESPEC_CPU_ISA`` caps it) lacks it, saying why:
    "needs AVX512-BF16: this CPU has avx2". On such a CPU torch's bf16 runs 40-500x slower and our
    AVX-512 kernels are never compiled."""
    from adaptivespec import hardware

    for item in items:
        for mark in item.iter_markers("needs"):
            for feature in mark.args:
                if feature == "fast_bf16":
                    why = None if hardware.fast_bf16() else f"needs fast bf16 (AMX or AVX512-BF16): this CPU has {hardware.isa()}"
                else:
                    why = hardware.missing(feature)
                if why is not None:
                    item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def smol32():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in float32."""
    from adaptivespec.models import load_target

    return load_target("smollm2-135m-instruct", "float32")


@pytest.fixture(scope="session")
def random_head_dir(smol32, tmp_path_factory):
    """A randomly initialised EAGLE-3 head written in the checkpoint layout."""
    from adaptivespec.drafter import Eagle3Drafter

    out = tmp_path_factory.mktemp("random-head")
    Eagle3Drafter.random_init(smol32[0], 8192, seed=0).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def full_vocab_head_dir(smol32, tmp_path_factory):
    """A random head over the whole target vocabulary (any token can be drafted)."""
    from adaptivespec.drafter import Eagle3Drafter

    out = tmp_path_factory.mktemp("full-head")
    Eagle3Drafter.random_init(smol32[0], smol32[0].config.vocab_size, seed=1).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def greedy_reference(smol32):
    """prompt text -> (prompt ids, transformers' greedy generate ids), cached per max_new_tokens."""
    from adaptivespec.models import encode_prompt

    model, tok = smol32
    cache: dict = {}

    def ref(text: str, max_new_tokens: int = 48):
        key = (text, max_new_tokens)
        if key not in cache:
            ids = encode_prompt(tok, text)
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            cache[key] = (ids, out[0, len(ids):].tolist())
        return cache[key]

    return ref
