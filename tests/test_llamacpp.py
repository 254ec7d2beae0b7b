"""The llamacpp runtime: trees verified in one llama_decode, the commit, the head's features, and
generate end to end on the shipped GGUF file (no timings: speed lives in docs/llamacpp.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp", reason="the llamacpp runtime needs llama-cpp-python (pip install -e '.[llamacpp]')")

from adaptivespec.cli import main  # noqa: E402
from adaptivespec.llamacpp.binding import Context, Model  # noqa: E402
from adaptivespec.llamacpp.cells import TreeCells, tree_rows  # noqa: E402
from adaptivespec.models import embedded_gguf  # noqa: E402
from adaptivespec.tree import make_tree  # noqa: E402

pytestmark = pytest.mark.model  # the shipped GGUF file (and, for some, its torch copy)
ROOT = Path(__file__).resolve().parents[1]
LIDS = (2, 15, 27)  # the shipped head's layers 1, 14, 26, as layer inputs
NOISE = 1e-2
"""Largest logit difference taken as the file's numeric noise (measured: 0 on Q4_1, this build)."""


@pytest.fixture(scope="module")
def model():
    return Model(embedded_gguf())


@pytest.fixture(scope="module")
def prompt(model):
    return model.tokenize("<|im_start|>user\nExplain how a bicycle works in simple terms.<|im_end|>\n"
                          "<|im_start|>assistant\n", special=True)


def context(model, prompt):
    ctx = Context(model, n_ctx=512, n_batch=128, n_seq_max=18, threads=1, layer_inputs=LIDS)
    P = len(prompt)
    ctx.decode(np.array(prompt), np.arange(P), None, np.arange(P) == P - 1)
    return ctx


def one_by_one(model, prompt, tokens):
    """Logits [len(tokens) + 1, V] and layer inputs {lid: [len(tokens), H]} of ``tokens`` decoded one at a time after the prompt."""
    ctx = context(model, prompt)
    logits, feats = [ctx.logits(1)[0].copy()], {lid: [] for lid in LIDS}
    for k, t in enumerate(tokens):
        ctx.decode(np.array([t]), np.array([len(prompt) + k]), None, True)
        logits.append(ctx.logits(1)[0].copy())
        for lid in LIDS:
            feats[lid].append(ctx.layer_input(lid, 1)[0].copy())
    return np.stack(logits), {lid: np.stack(v) for lid, v in feats.items()}


@pytest.fixture(scope="module")
def greedy(model, prompt):
    """The prompt's greedy continuation (24 tokens), decoded one by one."""
    ctx = context(model, prompt)
    out, t = [], int(ctx.logits(1)[0].argmax())
    for k in range(24):
        out.append(t)
        ctx.decode(np.array([t]), np.array([len(prompt) + k]), None, True)
        t = int(ctx.logits(1)[0].argmax())
    return out


def test_a_tree_node_reads_as_its_path_decoded_one_by_one(model, prompt, greedy):
    # root g0; g1 -> g2 -> g3 down the greedy path, a wrong sibling x beside g1 with a child y, and a
    # wrong z below g2 listed last: every node's logits and layer inputs as its own path's, one by one
    x, y, z = 1000, 2000, 3000
    tokens = [greedy[0], x, greedy[1], y, greedy[2], greedy[3], z]
    parents = [-1, 0, 0, 1, 2, 4, 2]
    tree = make_tree(torch.tensor(tokens), torch.tensor(parents))
    ctx = context(model, prompt)
    rows = tree_rows(tree, len(prompt))
    TreeCells(ctx).open(rows)
    ctx.decode(rows.tokens, rows.positions, rows.seqs, True)
    logits = ctx.logits(tree.size).copy()
    feats = {lid: ctx.layer_input(lid, tree.size).copy() for lid in LIDS}
    paths = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5], 6: [0, 2, 6]}
    for node, path in paths.items():
        ref_logits, ref_feats = one_by_one(model, prompt, [tokens[i] for i in path])
        assert np.abs(logits[node] - ref_logits[-1]).max() <= NOISE, node
        assert logits[node].argmax() == ref_logits[-1].argmax()
        for lid in LIDS:
            assert np.allclose(feats[lid][node], ref_feats[lid][-1], rtol=1e-3, atol=1e-3), (node, lid)


def test_after_commits_the_cache_answers_as_one_by_one(model, prompt, greedy):
    """Steps whose rejected nodes sit before, between and after the accepted ones; then plain steps,
    a compaction, and more plain steps: every row as the greedy path decoded one by one."""
    ref, _ = one_by_one(model, prompt, greedy)
    ctx = context(model, prompt)
    cells = TreeCells(ctx)
    P, done = len(prompt), 0  # greedy[done] is the root, at position P
    for wrong_before, depth in ((2, 2), (0, 3), (3, 1), (1, 0), (2, 3)):
        tokens, parents = [greedy[done]], [-1]
        tokens += list(range(500, 500 + wrong_before))  # rejected siblings listed before the path
        parents += [0] * wrong_before
        prev = 0
        for d in range(depth):
            tokens.append(greedy[done + 1 + d])
            parents.append(prev)
            prev = len(tokens) - 1
        tokens += [900, 901]  # rejected children of the path's last node, listed after it
        parents += [prev, prev]
        tree = make_tree(torch.tensor(tokens), torch.tensor(parents))
        rows = tree_rows(tree, P)
        cells.room(P, tree.size)
        cells.open(rows)
        ctx.decode(rows.tokens, rows.positions, rows.seqs, True)
        logits = ctx.logits(tree.size).copy()
        path = [0] + [1 + wrong_before + d for d in range(depth)]
        for j, node in enumerate(path):
            assert np.abs(logits[node] - ref[done + 1 + j]).max() <= NOISE
        cells.commit(rows, path, P)
        P, done = P + len(path), done + len(path)
    assert cells.parked == 2 + 3 + 2  # the wrong siblings listed before a path's last node
    for k in range(3):
        if k == 1:
            cells.compact()
            assert cells.parked == 0
        ctx.decode(np.array([greedy[done]]), np.array([P]), None, True)
        assert np.abs(ctx.logits(1)[0] - ref[done + 1]).max() <= NOISE
        assert ctx.seq_pos_max(0) == P
        P, done = P + 1, done + 1


def test_layer_inputs_are_the_torch_targets_hidden_states(model, prompt):
    """lid = head layer + 1 holds transformers' hidden_states[layer + 1] (the Q4_1 file against its
    float32 dequantization: close, not equal)."""
    from adaptivespec.models import load_target

    target, _ = load_target("smollm2-135m-instruct", "float32")
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ctx = Context(model, n_ctx=256, n_batch=128, n_seq_max=2, threads=1, layer_inputs=LIDS)
    ctx.decode(np.array(prompt), np.arange(len(prompt)), None, True)
    for lid in LIDS:
        ours, theirs = ctx.layer_input(lid, len(prompt)), hidden[lid][0].numpy()
        assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 0.03, lid


def generate(capsys, config: str, prompts: Path, *extra: str) -> list[list[int]]:
    assert main(["generate", "--config", str(ROOT / "configs" / config), "--runtime", "llamacpp", "--prompts", str(prompts),
                 "--max-new-tokens", "40", "--json", "--set", "runtime.threads=1", *extra]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_hybrid_generates_the_text_of_plain_decoding_on_the_same_runtime(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "Write a short poem about the sea.", "What is 17 times 23? Explain step by step.",
        "Write a Python function that reverses a string.")))
    ar = generate(capsys, "ar.yaml", prompts)
    assert len(ar) == 3 and sum(map(len, ar)) > 60
    assert generate(capsys, "hybrid.yaml", prompts) == ar
    assert generate(capsys, "cost-aware-hybrid.yaml", prompts) == ar  # plain steps (min_keep 0) among its trees


def test_a_full_cache_is_compacted_and_the_text_stays_plain_decodings(monkeypatch):
    """Parked cells fill a cache with no slack: compactions happen mid-generation, the text is ar's."""
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.llamacpp import runtime

    monkeypatch.setattr(runtime, "CONTEXT_SLACK", 8)
    texts, engines = [], []
    for config in ("ar", "hybrid"):
        engine = Engine(load_config(ROOT / "configs" / f"{config}.yaml",
                                    ["runtime.name=llamacpp", "runtime.threads=1", "generation.max_new_tokens=128"]))
        texts.append(engine.generate("Write a long story about a dragon who learns to cook.").token_ids)
        engines.append(engine)
    assert engines[1].runtime.cells.compactions > 0
    assert texts[0] == texts[1]


@pytest.mark.parametrize("extra", [("--set", "generation.temperature=0.8", "--set", "generation.seed=7"),
                                   ("--regex", "[0-9]{3}-[0-9]{4}, [A-Z][a-z]+")], ids=["sampled", "grammar"])
def test_sampling_with_a_seed_and_grammars_run_alike_on_trees(tmp_path, capsys, extra):
    if extra[0] == "--regex":
        pytest.importorskip("xgrammar", reason="grammars need xgrammar (pip install -e '.[structured]')")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Give me a phone number and a name, then tell a story."}) + "\n")
    assert generate(capsys, "hybrid.yaml", prompts, *extra) == generate(capsys, "ar.yaml", prompts, *extra)


def test_the_summary_line_names_the_runtime_and_the_file(capsys):
    assert main(["generate", "--config", str(ROOT / "configs" / "ar.yaml"), "--runtime", "llamacpp", "--prompt", "Hi",
                 "--max-new-tokens", "4", "--set", "runtime.threads=1"]) == 0
    assert "llamacpp SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["missing", "folder", "not-gguf"])
def test_a_bad_target_is_one_line_and_exit_2(tmp_path, capsys, kind):
    target = {"missing": tmp_path / "nope.gguf", "folder": tmp_path, "not-gguf": tmp_path / "x.gguf"}[kind]
    if kind == "folder":
        (tmp_path / "config.json").write_text("{}")
    if kind == "not-gguf":
        target.write_bytes(b"not a model")
    assert main(["generate", "--config", str(ROOT / "configs" / "ar.yaml"), "--runtime", "llamacpp", "--prompt", "Hi",
                 "--set", f"model.target={target}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("adaptivespec: error: model.target:")
    if kind == "folder":
        assert "convert_hf_to_gguf.py" in err


def engine(config: str, *extra: str):
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    return Engine(load_config(ROOT / "configs" / f"{config}.yaml", ["runtime.name=llamacpp", "runtime.threads=1",
                                                                    "generation.max_new_tokens=64", *extra]))


def test_the_head_caught_up_on_plain_steps_is_the_head_run_at_every_step():
    """k plain steps leave the head's rows pending; one catch-up forward gives the state k forwards give."""
    rt = engine("hybrid", "runtime.dtype=float32").runtime
    ids = rt.target.tokenizer("Explain how a bicycle works.")["input_ids"]
    logps = []
    for every_step in (False, True):
        rt.prefill(ids, 32)
        for _ in range(6):
            rt.ar_step()
            if every_step:
                rt.catch_up()
        assert len(rt.pending) == (0 if every_step else 6)
        rt.catch_up()
        logps.append((rt.root_logp.clone(), rt.drafter.length))
    (lazy, n_lazy), (eager, n_eager) = logps
    assert n_lazy == n_eager == len(ids) + 6
    assert torch.allclose(lazy, eager, atol=1e-4)


def test_a_policys_plain_steps_keep_the_text_of_plain_decoding():
    """Plain steps the policy asks for (plain_next), between drafted ones: ar's text, the head still accepting."""
    prompt = "Write a Python function that reverses a string, then explain it."
    ar = engine("ar").generate(prompt).token_ids
    hybrid = engine("hybrid")
    pattern = iter([False, True, True] * 100)
    hybrid.policy.plain_next = lambda: next(pattern)
    result = hybrid.generate(prompt)
    assert result.token_ids == ar
    plain = [r for r in result.records if r.undrafted == "policy"]
    drafted = [r for r in result.records if r.undrafted is None]
    assert plain and drafted and sum(r.accepted for r in drafted) >= len(drafted)  # the head still drafts well
