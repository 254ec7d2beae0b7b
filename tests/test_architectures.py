"""Your own model (issue 53): Llama, Qwen2, Qwen3 and Mistral targets with EAGLE-3 heads in the published layout.

Every target here is a tiny random-weight model built by transformers inside the test and saved as a
Hugging Face folder with a byte-level tokenizer; every head is a random EAGLE-3 head written as the
published checkpoints are (``config.json`` with ``draft_vocab_size`` and no ``head_dim`` or RoPE keys,
as yuhuili's EAGLE3-LLaMA3.1 head; ``fc`` over three target layers, one ``midlayer``, ``d2t`` offsets,
``t2d``) and loaded from disk. Nothing is downloaded.

* the fused bfloat16 forward reproduces transformers' forward bit for bit on every architecture;
* float32 strict decoding equals transformers' greedy ``generate`` token for token for ``ar``,
  ``eagle3``, ``hybrid`` and ``cost-aware`` (the shipped configs, target and head overridden), with the
  random head and with a head that knows the continuation (so drafts are accepted);
* a sliding window narrower than the model's positions, and hybrid layers, are refused when the model
  loads, in one line with exit status 2; a window as wide as the positions decodes like full attention;
* heads: the head's own config decides its shape and RoPE; a cached Hugging Face id loads; a head that
  does not fit says which keys;
* stopping: every EOS id of ``generation_config.json``, and per-request stop ids;
* profiles fitted on another target are not used silently, and ``calibrate`` measures any target.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.model  # loads models (tiny ones, built here)

VOCAB, DRAFT_VOCAB, MAX_NEW = 320, 300, 24
EOS, EOM = 256, 259  # the tokenizer's <|im_end|> and <|eom|>
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1, eos_token_id=EOS, bos_token_id=None,
              pad_token_id=257)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ARCHS = {  # name -> (transformers config class name, its arguments beyond COMMON)
    "llama3-tied": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),  # biases on q, k and v
    "qwen3": ("Qwen3Config", dict(head_dim=48, tie_word_embeddings=True)),  # q/k norms; head_dim != hidden / heads
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-wide-window": ("MistralConfig", dict(sliding_window=512)),  # a window as wide as max_position_embeddings
}


def make_tokenizer():
    """A byte-level tokenizer (256 bytes, 4 special tokens, padding ids up to VOCAB) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|eom|>"])
    fast.add_tokens([f"<x{i}>" for i in range(VOCAB - len(fast))])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert fast.eos_token_id == EOS and fast.convert_tokens_to_ids("<|eom|>") == EOM
    return fast


def build_target(arch: str, dtype=torch.float32, **over):
    import transformers

    cls_name, kw = ARCHS[arch]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kw, **over})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():  # norms and biases away from their init (ones, zeros), so that they are exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model.requires_grad_(False)


def save_target(model, out: Path) -> Path:
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


PUBLISHED_KEYS = ("architectures", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
                  "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
                  "tie_word_embeddings", "torch_dtype", "vocab_size", "draft_vocab_size")
"""The keys of a published EAGLE-3 head's config.json (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: no head_dim, no
RoPE keys, no eagle_config: the reference implementations' defaults apply)."""
PUBLISHED_WEIGHTS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
                     "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                     *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                     *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def write_head(target, out: Path, seed: int = 0, **config) -> Path:
    """A random EAGLE-3 head for ``target`` in the published layout: attention of hidden / heads (never the
    target's head_dim) unless ``config`` names a ``head_dim``, default fused layers, a random draft
    vocabulary (non-zero d2t offsets); ``config`` keys are added to (or, as None, removed from) config.json."""
    from adaptivespec.drafter import Eagle3Drafter, default_aux_layers

    tc = target.config
    head_dim = config.get("head_dim") or tc.hidden_size // tc.num_attention_heads
    cfg = Eagle3Drafter.make_config(tc, DRAFT_VOCAB, head_dim=head_dim)
    head = Eagle3Drafter(cfg, target.get_input_embeddings(), default_aux_layers(tc.num_hidden_layers), tc.hidden_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn(p.shape, generator=gen))
    head.set_vocab(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB])
    head.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    published = {k: written[k] for k in PUBLISHED_KEYS} | config
    (out / "config.json").write_text(json.dumps({k: v for k, v in published.items() if v is not None}, indent=2))
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a shared machine a second thread makes every small
    op wait for a descheduled one (the file ran 5x slower with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """arch -> (target folder, head folder): built once for the module."""
    root = tmp_path_factory.mktemp("architectures")
    out = {}
    for arch in ARCHS:
        target = build_target(arch)
        out[arch] = (save_target(target, root / arch), write_head(target, root / f"{arch}-head"))
    return out


@pytest.fixture(scope="module")
def host():
    from adaptivespec.plugins import make_plugin_host
    from adaptivespec.testing import _OraclePlugin

    return make_plugin_host(extra_plugins=[_OraclePlugin])


def engine_for(host, config: str, target: Path, head: Path | None, *extra: str):
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    overrides = [f"model.target={target}", f"model.drafter={head if head is not None else 'null'}",
                 "runtime.dtype=float32", "runtime.device=cpu", "runtime.threads=1", f"generation.max_new_tokens={MAX_NEW}",
                 *extra]
    return Engine(load_config(ROOT / "configs" / f"{config}.yaml", overrides, host=host), host=host)


def greedy(model, ids: list[int], eos: list[int] | None, max_new: int = MAX_NEW) -> list[int]:
    """transformers' greedy continuation of ``ids``, stopping at any of ``eos``."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else 0)
    return out[0, x.shape[1]:].tolist()


# -- the fused forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fused_forward_is_bit_identical_to_transformers(arch, monkeypatch):
    from test_fastforward import needs_prepack, trace

    from adaptivespec.fastpath import forward as fastforward
    from adaptivespec.fastpath.forward import FastLlama, supported
    from adaptivespec.fastpath.native import ATTENTION_ENV

    monkeypatch.setenv(fastforward.NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    model = build_target(arch, torch.bfloat16, vocab_size=320)
    needs_prepack(model)
    assert supported(model) is None
    ref, got = trace(model, model), trace(FastLlama(model, sgl=None), model)
    for r, g in zip(ref, got):
        assert torch.equal(g.logits, r.logits)
        if r.hidden_states is not None:
            assert all(torch.equal(a, b) for a, b in zip(g.hidden_states, r.hidden_states))


# -- lossless, every architecture and config ----------------------------------------------------------
LOSSLESS_CASES = [(arch, config) for arch in sorted(ARCHS) for config in ("ar", "eagle3", "hybrid", "cost-aware")
                  if arch != "mistral-wide-window" or config == "eagle3"]  # (a wide window: like mistral's full attention)


@pytest.mark.parametrize("arch, config", LOSSLESS_CASES)
def test_strict_decoding_equals_greedy_generate(arch, config, models_dir, host):
    target_dir, head_dir = models_dir[arch]
    engine = engine_for(host, config, target_dir, None if config == "ar" else head_dir)
    # (cost-aware with a tree at every step, priced by the shipped profile: the shipped min_keep 0 verifies the
    # root alone where the oracle's drafts, valued by the real head's calibration, do not pay)
    trees = ("policy.min_keep=1", "policy.costs=profile") if config == "cost-aware" else ()
    oracle = engine_for(host, config, target_dir, head_dir, "model.drafter_kind=testing-oracle", *trees) if config != "ar" else None
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        want = greedy(engine.target, ids, sorted(engine.eos_ids))
        assert engine.generate_ids(ids).token_ids == want, (arch, config, prompt)
        if oracle is not None:  # a head that knows the continuation: drafts are accepted, paths leave the first branch
            oracle.runtime.drafter.prime(ids + want)
            res = oracle.generate_ids(ids)
            assert res.token_ids == want, (arch, config, prompt, "oracle")
            accepted += sum(r.accepted for r in res.records)
    if oracle is not None:
        assert accepted >= MAX_NEW // 2  # the speculative path was exercised, not only the root


# -- refused up front ------------------------------------------------------------------------------
def _refused(tmp_path, capsys, target: Path, config: str = "eagle3") -> str:
    from adaptivespec.cli import main

    head = "null" if config == "ar" else str(tmp_path / "no-head-needed")
    rc = main(["generate", "--config", str(ROOT / "configs" / f"{config}.yaml"), "--prompt", "hi",
               "--set", f"model.target={target}", "--set", f"model.drafter={head}", "--set", "runtime.dtype=float32"])
    return _one_error(rc, capsys)


def _one_error(rc: int, capsys) -> str:
    """The one error line of a refused command (exit 2, no traceback; log lines aside)."""
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("adaptivespec: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_narrow_sliding_window_is_refused_when_the_model_loads(tmp_path, capsys):
    target = save_target(build_target("mistral", sliding_window=8), tmp_path / "mistral-swa")
    line = _refused(tmp_path, capsys, target)
    assert "model.target" in line and "'sliding_attention'" in line and "window of 8 positions" in line
    assert "max_position_embeddings 512" in line


def test_qwen2_use_sliding_window_is_refused_naming_the_first_windowed_layer(tmp_path, capsys):
    target = save_target(build_target("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2),
                         tmp_path / "qwen2-swa")
    line = _refused(tmp_path, capsys, target, "ar")
    assert "layer 2 is 'sliding_attention' with a window of 16 positions" in line


def test_hybrid_layers_are_refused_from_the_config_before_the_weights_load(tmp_path, capsys):
    from transformers import AutoConfig

    out = tmp_path / "qwen3-next"
    AutoConfig.for_model("qwen3_next", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB).save_pretrained(out)  # a config and no weights
    make_tokenizer().save_pretrained(out)
    line = _refused(tmp_path, capsys, out, "ar")
    assert "layer 0 is 'linear_attention'" in line and "full-attention layers only" in line


def test_the_attention_check_passes_full_attention_and_windows_as_wide_as_the_positions():
    from transformers import AutoConfig, MistralConfig

    from adaptivespec.models import attention_unsupported

    assert attention_unsupported(MistralConfig(**COMMON, sliding_window=None)) is None
    assert attention_unsupported(MistralConfig(**COMMON, sliding_window=512)) is None  # >= max positions: harmless
    assert "'sliding_attention'" in attention_unsupported(MistralConfig(**COMMON, sliding_window=511))
    assert "'linear_attention'" in attention_unsupported(AutoConfig.for_model("jamba", num_hidden_layers=4))


# -- heads -----------------------------------------------------------------------------------------------
def test_our_writer_saves_the_published_layout(models_dir):
    from safetensors import safe_open

    with safe_open(str(models_dir["qwen3"][1] / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == PUBLISHED_WEIGHTS
        d2t = f.get_tensor("d2t")
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,) and bool((d2t != 0).any())


def test_a_qwen3_head_gets_its_attention_and_rope_from_its_own_config(models_dir, tmp_path, caplog):
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.models import load_target

    target_dir, head_dir = models_dir["qwen3"][0], tmp_path / "qwen3-head"
    shutil.copytree(models_dir["qwen3"][1], head_dir)  # a path not loaded before: its RoPE note is new
    target, _ = load_target(str(target_dir), "float32")
    assert target.config.head_dim == 48
    with caplog.at_level(logging.WARNING, logger="adaptivespec.models"):
        head = Eagle3Drafter.from_pretrained(head_dir, target)
        Eagle3Drafter.from_pretrained(head_dir, target)
    assert head.midlayer.self_attn.head_dim == 16 and head.config.head_dim == 16  # hidden 64 / 4 heads
    assert head.config.rope_parameters["rope_theta"] == 10000.0  # not the target's 1e6
    said = [r.getMessage() for r in caplog.records if "RoPE" in r.getMessage()]
    assert len(said) == 1 and "θ 10000" in said[0] and str(head_dir) in said[0]  # once per head


def test_the_fused_head_path_follows_a_head_whose_attention_is_wider_than_its_hidden(models_dir, tmp_path, monkeypatch):
    """A head with an explicit head_dim (4 heads x 32 = 128 wide attention on a 64-wide hidden): the
    fused bfloat16 step gives the modules' outputs bit for bit (oneDNN)."""
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.fastpath.drafter import fast_drafter
    from adaptivespec.fastpath.native import ATTENTION_ENV
    from adaptivespec.fastpath.prepack import NO_SGL_ENV, can_prepack

    monkeypatch.setenv(NO_SGL_ENV, "1")
    monkeypatch.setenv(ATTENTION_ENV, "1")  # torch's attention: the path compared bit for bit
    target = build_target("qwen3", torch.bfloat16)
    wide = write_head(target, tmp_path / "wide-head", head_dim=32)
    cfg = json.loads((wide / "config.json").read_text())
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    head = Eagle3Drafter.from_pretrained(wide, target, torch.bfloat16)
    if not can_prepack(head):
        pytest.skip("oneDNN is not available in this torch build (or the bf16 fast path is off)")
    assert head.midlayer.self_attn.o_proj.weight.shape == (64, 128)

    @torch.inference_mode()
    def run():
        g = torch.Generator().manual_seed(0)
        head.reset_cache(32)
        hidden = tuple(torch.randn(1, 12, 64, generator=g).bfloat16() for _ in range(5))
        state = head.fuse(hidden)[0]
        out = head.step(torch.randint(0, VOCAB, (12,), generator=g), state, torch.arange(12), None)
        level = head.step(torch.randint(0, VOCAB, (3,), generator=g), out[-1].expand(3, -1), torch.full((3,), 12), None)
        return [state, out, level, head.log_probs(level)]

    ref = run()
    assert fast_drafter(head) is not None
    got = run()
    assert head.fast.params  # the fused path ran
    for r, g in zip(ref, got):  # (fused state, prefill, a tree level, its draft distributions)
        assert g.shape == r.shape and torch.equal(g, r)


def test_a_head_names_its_rope_scaling_in_the_legacy_keys(models_dir, tmp_path):
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.models import load_target

    target_dir, head_dir = models_dir["llama3-tied"]
    target, _ = load_target(str(target_dir), "float32")
    scaled = tmp_path / "scaled-head"
    shutil.copytree(head_dir, scaled)
    cfg = json.loads((scaled / "config.json").read_text())
    cfg.update(rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
               | {"type": "llama3"})
    del cfg["rope_scaling"]["rope_type"]
    (scaled / "config.json").write_text(json.dumps(cfg))
    head = Eagle3Drafter.from_pretrained(scaled, target)
    assert head.config.rope_parameters["rope_type"] == "llama3" and head.config.rope_parameters["factor"] == 8.0
    plain = Eagle3Drafter.from_pretrained(head_dir, target)
    assert not torch.equal(head.rotary.inv_freq, plain.rotary.inv_freq)


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_size", 96, "hidden_size 96 does not match the target's hidden_size 64"),
    ("vocab_size", 1000, "vocab_size 1000 does not match the target's 320"),
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}, "eagle_aux_hidden_state_layer_ids [0, 1, 7]"),
    ("intermediate_size", 256, "midlayer.mlp.gate_proj.weight [128, 64] (config.json makes it [256, 64])"),
    ("head_dim", 32, "midlayer.self_attn.q_proj.weight [64, 128] (config.json makes it [128, 128])"),
    ("draft_vocab_size", 100, "lm_head.weight [300, 64] (config.json makes it [100, 64])"),
])
def test_a_head_that_does_not_fit_says_which_keys(models_dir, tmp_path, capsys, key, value, expected):
    from adaptivespec.cli import main

    target_dir, head_dir = models_dir["llama-untied"]
    bad = tmp_path / "bad-head"
    shutil.copytree(head_dir, bad)
    cfg = json.loads((bad / "config.json").read_text()) | {key: value}
    (bad / "config.json").write_text(json.dumps(cfg))
    rc = main(["generate", "--config", str(ROOT / "configs" / "eagle3.yaml"), "--prompt", "hi", "--set",
               f"model.target={target_dir}", "--set", f"model.drafter={bad}", "--set", "runtime.dtype=float32"])
    err = _one_error(rc, capsys)
    assert f"drafter {bad}" in err and expected in err, err


def test_heads_load_by_cached_hugging_face_id(models_dir, tmp_path, monkeypatch, host):
    import huggingface_hub.constants

    from adaptivespec.drafter import resolve_drafter_path
    from adaptivespec.errors import ModelLoadError

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--qwen3-head" / "snapshots" / ("0" * 40)
    shutil.copytree(models_dir["qwen3"][1], snapshot)
    (cache / "models--tiny-org--qwen3-head" / "refs").mkdir()
    (cache / "models--tiny-org--qwen3-head" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert resolve_drafter_path("tiny-org/qwen3-head") == snapshot
    engine = engine_for(host, "eagle3", models_dir["qwen3"][0], "tiny-org/qwen3-head")  # type: ignore[arg-type]
    ids = engine.encode(PROMPTS[0])
    assert engine.generate_ids(ids).token_ids == greedy(engine.target, ids, sorted(engine.eos_ids))
    with pytest.raises(ModelLoadError, match="neither a folder nor a Hugging Face id in the local cache"):
        resolve_drafter_path("tiny-org/not-cached")


# -- stopping --------------------------------------------------------------------------------------------
def test_every_eos_of_the_generation_config_stops_and_so_do_request_stop_ids(models_dir, tmp_path, host):
    target_dir, head_dir = models_dir["llama3-tied"]
    free = engine_for(host, "eagle3", target_dir, head_dir, "model.drafter_kind=testing-oracle",
                      "generation.stop_at_eos=false")
    ids = free.encode(PROMPTS[1])
    cont = free.generate_ids(ids).token_ids  # (the oracle not primed yet: a random head)
    assert len(cont) == MAX_NEW
    stop = max(set(cont) - {EOS}, key=cont.index)  # the token that first shows up latest
    k = cont.index(stop)
    # a stop id anywhere in an accepted chunk ends the output there, inclusive
    free.runtime.drafter.prime(ids + cont)
    res = free.generate_ids(ids, stop_ids=[stop])
    assert res.token_ids == cont[: k + 1] and max(r.accepted for r in res.records) >= 2
    # Llama-3 style: generation_config.json lists several EOS ids
    listed = tmp_path / "listed-eos"
    shutil.copytree(target_dir, listed)
    gen = json.loads((listed / "generation_config.json").read_text()) | {"eos_token_id": [EOS, stop]}
    (listed / "generation_config.json").write_text(json.dumps(gen))
    engine = engine_for(host, "eagle3", listed, head_dir, "model.drafter_kind=testing-oracle")
    assert engine.eos_ids == {EOS, stop} and engine.eos == EOS
    engine.runtime.drafter.prime(ids + cont)
    end = next(i for i, t in enumerate(cont) if t in (EOS, stop))
    listed_eos = engine.target.generation_config.eos_token_id
    assert listed_eos == [EOS, stop]
    assert engine.generate_ids(ids).token_ids == cont[: end + 1] == greedy(engine.target, ids, listed_eos)


def test_the_api_takes_stop_token_ids_as_vllm_names_them():
    from adaptivespec.config import load_config
    from adaptivespec.server.schema import RequestError, parse_request

    defaults = load_config(None, []).generation
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(body, chat=True, defaults=defaults, vocab_size=VOCAB).stop_token_ids == ()
    req = parse_request(body | {"stop_token_ids": [EOM, 7]}, chat=True, defaults=defaults, vocab_size=VOCAB, strict=True)
    assert req.stop_token_ids == (EOM, 7)
    for bad, shown in (([7, VOCAB], str(VOCAB)), ("7", "'7'"), ([True], "True")):
        with pytest.raises(RequestError) as err:
            parse_request(body | {"stop_token_ids": bad}, chat=True, defaults=defaults, vocab_size=VOCAB)
        assert err.value.param == "stop_token_ids" and shown in err.value.message
        assert f"a list of token ids in [0, {VOCAB})" in err.value.message


# -- profiles ------------------------------------------------------------------------------------------
def test_a_profile_fitted_on_another_target_is_said_once(models_dir, host, tmp_path, caplog):
    target_dir, head_dir = tmp_path / "qwen3", tmp_path / "qwen3-head"  # paths no engine used before
    for src, dst in zip(models_dir["qwen3"], (target_dir, head_dir)):
        shutil.copytree(src, dst)
    with caplog.at_level(logging.WARNING, logger="adaptivespec.profiles"):
        for _ in range(2):  # (costs: profile: a float32 run would otherwise price with this machine's table)
            engine_for(host, "cost-aware", target_dir, head_dir, "policy.costs=profile")
    said = [r.getMessage() for r in caplog.records if r.name == "adaptivespec.profiles"]
    assert len(said) == 1 and "\n" not in said[0]
    line = said[0]
    assert ("policy.profile (cpu-smollm2-135m-bf16.json) and policy.prior (calibration-smollm2-135m-embedded.json) "
            f"were fitted on target smollm2-135m-instruct (running {target_dir}), drafter embedded") in line
    assert f"adaptivespec calibrate --config CONFIG --target {target_dir} --drafter {head_dir}" in line


def test_calibrate_measures_any_target_and_its_profile_is_then_used_quietly(models_dir, tmp_path, host, caplog):
    from adaptivespec.cli import main
    from adaptivespec.costmodel import cpu_name

    target_dir, head_dir = models_dir["qwen3"]
    profile, prior = tmp_path / "qwen3-profile.json", tmp_path / "qwen3-prior.json"
    rc = main(["calibrate", "--config", str(ROOT / "configs" / "cost-aware.yaml"), "--target", str(target_dir),
               "--drafter", str(head_dir), "--out", str(profile), "--prior-out", str(prior), "--limit", "1",
               "--max-new-tokens", "12", "--shapes", "1,2,3", "2,2,4", "3,2,6", "--no-progress",
               "--set", "runtime.dtype=float32", "--set", "runtime.threads=1"])
    assert rc == 0
    meta = json.loads(profile.read_text())
    assert meta["model"] == {"target": str(target_dir), "drafter": str(head_dir)}
    assert meta["machine"]["cpu"] == cpu_name() and meta["coefficients_ms"]["fixed"] > 0
    assert json.loads(prior.read_text())["model"]["target"] == str(target_dir)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adaptivespec.profiles"):
        engine = engine_for(host, "cost-aware", target_dir, head_dir, f"policy.profile={profile}", f"policy.prior={prior}")
    assert not [r for r in caplog.records if r.name == "adaptivespec.profiles"]
    ids = engine.encode(PROMPTS[0])
    assert engine.generate_ids(ids).token_ids == greedy(engine.target, ids, sorted(engine.eos_ids))


def test_every_profile_reading_policy_names_its_files_and_what_they_were_fitted_on(monkeypatch):
    from adaptivespec import costmodel
    from adaptivespec.costmodel import warn_if_fitted_elsewhere
    from adaptivespec.policies.cost_aware import CostAwarePolicy
    from adaptivespec.policies.learned import LearnedPolicy
    from adaptivespec.policies.post_draft import PostDraftPolicy

    origins = {p.name: {o.key: o for o in p.fitted_on()} for p in (CostAwarePolicy(), LearnedPolicy(), PostDraftPolicy())}
    assert set(origins["cost_aware"]) == {"policy.profile", "policy.prior"}
    assert set(origins["learned"]) == {"policy.model"} and set(origins["post_draft"]) == {"policy.profile", "policy.calibration"}
    for files in origins.values():
        for o in files.values():
            assert (o.target, o.drafter) == ("smollm2-135m-instruct", "embedded"), o
    timed = origins["cost_aware"]["policy.profile"]
    assert timed.timed and timed.cpu == "AMD EPYC" and not origins["cost_aware"]["policy.prior"].timed
    assert origins["learned"]["policy.model"].cpu == "AMD EPYC"  # its cost model's CPU
    # the same pair under another name or path is the same model; the CPU counts for timings only
    monkeypatch.setattr(costmodel, "cpu_name", lambda: "AMD EPYC")
    assert warn_if_fitted_elsewhere("cost_aware", list(origins["cost_aware"].values()), device="cpu",
                                    target="HuggingFaceTB/SmolLM2-135M-Instruct", drafter="embedded") is None
    monkeypatch.setattr(costmodel, "cpu_name", lambda: "Intel(R) Xeon(R) Processor")
    line = warn_if_fitted_elsewhere("cost_aware", list(origins["cost_aware"].values()), device="cpu",
                                    target="smollm2-135m-instruct", drafter="embedded")
    assert line is not None and "policy.profile (cpu-smollm2-135m-bf16.json) was fitted on CPU 'AMD EPYC' " \
        "(running 'Intel(R) Xeon(R) Processor')" in line and "policy.prior" not in line.split(":")[1]


def test_a_fit_whose_free_intercept_goes_negative_still_writes_a_profile_that_loads(tmp_path):
    """Steps timed on a busy machine can pull the intercept below zero (seen here under load in the
    calibrate test above); the profile must still load, its intercept held at a small floor."""
    from adaptivespec.costmodel import CostModel

    rows = [(100, depth, 2 * depth, n, 3.0 * n - 5.0) for depth in range(3) for n in range(2, 9)]
    model = CostModel.fit(rows)
    assert model.fixed > 0 and model.meta["fit"]["fixed_pinned_ms"] == model.fixed
    model.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").fixed == model.fixed
    free = CostModel.fit([(100, depth, 2 * depth, n, 4.0 + 0.5 * n) for depth in range(3) for n in range(2, 9)])
    assert free.fixed == pytest.approx(4.0) and "fixed_pinned_ms" not in free.meta["fit"]
