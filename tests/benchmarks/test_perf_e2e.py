"""End-to-end decoding speed: configs/ar.yaml, configs/eagle3.yaml and the int8 target's ar-int8.yaml /
hybrid-int8.yaml on 2 fixed prompts x 32 tokens; and the target's packed forward by rows, bf16 against int8.

EOS is ignored (``generation.stop_at_eos=false``) so every round generates exactly 64 tokens; the
mean tokens/s and accept length are stored in each benchmark's ``extra_info``. ``eagle3`` needs the
shipped head and is skipped without it; ``eagle3-random-head`` (a seeded random head, so almost
nothing is accepted) always runs and tracks the cost of the speculative loop itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptivespec.config import load_config
from adaptivespec.drafter import EMBEDDED_HEAD

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did she sell altogether?",
    "Write a Python function that returns the factorial of n.",
)
TOKENS = 32


@pytest.fixture(scope="module")
def random_head_bf16(tmp_path_factory):
    from adaptivespec.decode import load_models
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.plugins import get_plugin_host

    target, _, _ = load_models(load_config(CONFIGS / "ar.yaml", []), get_plugin_host())
    out = tmp_path_factory.mktemp("random-head")
    Eagle3Drafter.random_init(target, 8192, seed=0).save_pretrained(out)
    return out


@pytest.mark.model
@pytest.mark.parametrize("name", ["ar", "eagle3", "eagle3-random-head", "ar-int8", "hybrid-int8"])
def test_end_to_end_tokens_per_second(benchmark, name, request):
    from adaptivespec.decode import Engine

    benchmark.group = f"end to end, {len(PROMPTS)} prompts x {TOKENS} tokens (bf16, CPU)"
    overrides = ["generation.stop_at_eos=false", f"generation.max_new_tokens={TOKENS}"]
    if name == "eagle3" and not (EMBEDDED_HEAD / "config.json").is_file():
        pytest.skip(f"the shipped EAGLE-3 head is not built ({EMBEDDED_HEAD} has no config.json); "
                    "train it with `adaptivespec train-drafter`; eagle3-random-head still measures the loop")
    if name == "eagle3-random-head":
        overrides.append(f"model.drafter={request.getfixturevalue('random_head_bf16')}")
    engine = Engine(load_config(CONFIGS / f"{name.removesuffix('-random-head')}.yaml", overrides))
    prompts = [engine.encode(p) for p in PROMPTS]

    def run():
        return [engine.generate_ids(ids, max_new_tokens=TOKENS).stats for ids in prompts]

    stats = benchmark.pedantic(run, rounds=3, warmup_rounds=1, iterations=1)
    new = sum(s["new_tokens"] for s in stats)
    assert new == len(PROMPTS) * TOKENS
    benchmark.extra_info["tokens_per_second"] = new / benchmark.stats.stats.mean
    benchmark.extra_info["accept_length_mean"] = new / sum(s["target_forwards"] for s in stats)


@pytest.mark.model
@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_target_forward_by_rows(benchmark, precision, rows):
    """One packed target forward of ``rows`` rows over 256 cached keys (the row budget's unit of cost)."""
    import torch

    from adaptivespec.fastpath.batched import Part, layer_pieces, packed_forward
    from adaptivespec.fastpath.kvcache import buffered_cache
    from adaptivespec.models import load_target

    benchmark.group = f"target forward, {rows} rows over 256 keys (CPU)"
    kw = {"quantization": "int8", "groups": {"down_proj": 4, "lm_head": 3}} if precision == "int8" else {}
    model, _ = load_target("smollm2-135m-instruct", "bfloat16", **kw)
    pieces, cache = layer_pieces(model), buffered_cache(model.config, 512)
    ids, pos = torch.zeros(rows, dtype=torch.long), torch.arange(256, 256 + rows)

    def run():
        for layer in cache.layers:
            layer.length = 256
            layer._view()
        return packed_forward(pieces, ids, pos, [Part(cache=cache, rows=rows, mask=None, slot=None)], torch.arange(rows))

    logits, _ = benchmark.pedantic(run, rounds=10, warmup_rounds=2, iterations=1)
    assert logits.shape == (rows, model.config.vocab_size)
