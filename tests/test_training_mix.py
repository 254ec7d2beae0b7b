"""The broad training mix (``train-drafter --mix``) and the row-dropping batched generation."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT, Prompt, plan_generation
from adaptivespec.training.mix import (DEFAULT_MIX, KINDS, build_mix, kind_of, mix_counts, parse_kind_weights, parse_mix,
                                       weight_records)

needs_data = pytest.mark.skipif(not (DATA_ROOT / "train" / "alpaca_prompts.jsonl").is_file(), reason="no shared/data/train")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    """Word 13-grams (GPT-3's contamination unit) with at least 8 alphabetic words."""
    w = _words(text)
    grams = (tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    return {g for g in grams if sum(x.isalpha() for x in g) >= 8}


def _eval_texts() -> list[str]:
    """Every prompt of every evaluation set in the data root."""
    out = []
    for rel, keys in [("gsm8k/test.jsonl", ["question"]), ("math500/test.jsonl", ["problem"]),
                      ("specbench/question.jsonl", ["turns"]), ("mtbench/question.jsonl", ["turns"])]:
        for line in (DATA_ROOT / rel).read_text().splitlines():
            row = json.loads(line)
            for k in keys:
                out += row[k] if isinstance(row[k], list) else [row[k]]
    with gzip.open(DATA_ROOT / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        out += [json.loads(line)["prompt"] for line in f if line.strip()]
    return out


@needs_data
def test_mix_never_emits_an_evaluation_prompt():
    """No prompt equals an evaluation prompt; no prose prompt shares a word 13-gram with one.

    Math and code prompts come from official train splits (GSM8K train, CodeAlpaca, MBPP non-test)
    that share boilerplate with test splits (GSM8K templates such as "At the same rate, how many
    additional hours would it take to travel an additional ... miles?", loop headers such as
    ``for (int i = 0; i < 3; i++)``): the split is the guarantee there, and they are checked for
    equality only. Passages (rag, summarize, qa, instruct, translate, chat2) must not overlap at all.
    """
    evals = _eval_texts()
    exact = {" ".join(_words(t)) for t in evals}
    owner: dict[tuple, int] = {}
    for i, t in enumerate(evals):
        for g in _ngrams(t):
            owner.setdefault(g, i)
    prompts = build_mix(10**6)  # every prompt of every kind
    assert len(prompts) > 20000
    for p in prompts:
        assert " ".join(_words(p.text)) not in exact, p.id
        if kind_of(p.id) in ("math", "code"):
            continue
        shared = [g for g in _ngrams(p.text) if g in owner]
        assert not shared, (p.id, evals[owner[shared[0]]][:200])


@needs_data
def test_mix_proportions_kinds_and_determinism():
    a = build_mix(2000)
    assert [p.id for p in a] == [p.id for p in build_mix(2000)]
    assert len({p.id for p in a}) == len(a)
    counts = mix_counts(a)
    assert set(counts) == set(DEFAULT_MIX)
    for kind, share in DEFAULT_MIX.items():
        assert counts[kind] == round(share * 2000), (kind, counts)
    assert all(kind_of(p.id) in KINDS for p in a)
    chats = [p for p in a if kind_of(p.id) == "chat2"]
    assert chats and all(p.follow_up for p in chats) and not any(p.follow_up for p in a if kind_of(p.id) != "chat2")
    only = build_mix(300, parse_mix("summarize=1,translate=1"))
    assert mix_counts(only) == {"summarize": 150, "translate": 150}
    summaries = [p for p in only if kind_of(p.id) == "summarize"]
    assert max(len(p.text) for p in summaries) > 2000  # long passages, not one-liners


@pytest.mark.parametrize("text", ["math=x", "poetry=1", "math=-1", "math=0,code=0"])
def test_bad_mix_is_refused_naming_the_flag(text):
    with pytest.raises(AdaptiveSpecError, match="--mix"):
        parse_mix(text)


@pytest.mark.parametrize("text", ["translate=x", "poetry=2", "rag=-1", "rag=101", "math"])
def test_bad_kind_weights_are_refused_naming_the_flag(text):
    with pytest.raises(AdaptiveSpecError, match="--kind-weights"):
        parse_kind_weights(text)


def test_kind_weights_repeat_records_per_epoch_and_no_batch_holds_a_record_twice():
    from adaptivespec.training.data import Record, plan_batches

    records = [Record(f"{kind}-{i}", [1] * (1 + i % 7), [2] * (3 + i % 5)) for kind in ("translate", "rag", "math", "code")
               for i in range(200)]
    weights = parse_kind_weights("translate=3,rag=0.5,code=0")
    out = weight_records(records, weights, seed=1)
    counts = {k: sum(kind_of(r.id) == k for r in out) for k in ("translate", "rag", "math", "code")}
    assert counts["translate"] == 600 and counts["math"] == 200 and counts["code"] == 0
    assert 70 <= counts["rag"] <= 130 and {r.id for r in out if kind_of(r.id) == "rag"} <= {r.id for r in records}
    assert out == weight_records(records, weights, seed=1) and out != weight_records(records, weights, seed=2)
    assert weight_records(records, {}, seed=1) is records

    groups = plan_batches(out, batch_tokens=64, max_len=32)
    assert sorted(i for g in groups for i in g) == list(range(len(out)))  # every copy is trained on
    assert all(len({out[i].id for i in g}) == len(g) for g in groups)  # ...each in a different batch
    assert all(sum(len(out[i].prompt_ids) + len(out[i].response_ids) for i in g) <= 64 or len(g) == 1 for g in groups)
    # without copies the plan is the length-sorted one it always was (resumed runs keep their data order)
    flat = [i for g in plan_batches(records, 64, 32) for i in g]
    assert flat == sorted(range(len(records)), key=lambda i: (records[i].length, records[i].id))


def test_generation_batches_are_length_sorted_and_within_budget():
    lengths = [5, 900, 30, 31, 2000, 40, 8, 8, 400]
    groups = plan_generation(lengths, max_new_tokens=100, batch_size=3, gen_tokens=1200)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)  # a long prompt never pads a batch of short ones
    for g in groups:
        assert len(g) <= 3
        assert len(g) == 1 or len(g) * (max(lengths[i] for i in g) + 100) <= 1200


@pytest.mark.model
def test_batched_generation_equals_one_prompt_greedy(smol32, greedy_reference):
    """Rows of different lengths that finish at different steps: each equals its own greedy decode."""
    from adaptivespec.training.data import generate_greedy

    model, tok = smol32
    texts = ["What is 2+2?", "Write a haiku about the sea.", "Name three colors.", "Translate German to English: Ein Hund."]
    refs = [greedy_reference(t, 24) for t in texts]
    got = generate_greedy(model, [r[0] for r in refs], tok.eos_token_id, 24)
    for (ids, ref), g in zip(refs, got):
        eos = tok.eos_token_id
        assert g == (ref[: ref.index(eos) + 1] if eos in ref else ref)


@pytest.mark.model
def test_continuous_batching_rows_joining_midway_equal_one_prompt_greedy(smol32, greedy_reference):
    """Two rows at a time, so later prompts join a running batch (whose cache is wider or narrower
    than theirs) as earlier rows finish: each answer still equals its own greedy decode (float32)."""
    from adaptivespec.training.data import generate_stream

    model, tok = smol32
    eos = tok.eos_token_id
    texts = ["Say yes.", "What is 2+2?", "Write a long poem about the sea, the wind and the stars at night.",
             "Translate German to English: Ein Hund läuft im Park.", "Name three colors.", "List four prime numbers."]
    refs = [greedy_reference(t, 20) for t in texts]
    stream = list(generate_stream(model, [r[0] for r in refs], eos, 20, batch_size=2, gen_tokens=None, refill=1))
    assert sorted(i for i, _ in stream) == list(range(len(texts)))  # every prompt answered once
    for i, got in stream:
        ref = refs[i][1]
        assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref), texts[i]


def test_continuous_batching_respects_the_row_and_token_budget(monkeypatch):
    """A fake model that never emits eos: batches hold at most batch_size rows, and the cache
    (rows x width) stays within gen_tokens unless a row runs alone."""
    import types

    import transformers

    from adaptivespec.training.data import generate_stream

    class Cache:  # enough of DynamicCache for the loop: no layers to pad or cut
        def __init__(self, config=None):
            self.layers = []

    prefills, decodes = [], []

    class Fake:
        config = None

        def __call__(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep=None):
            (prefills if input_ids.shape[1] > 1 else decodes).append(tuple(attention_mask.shape))
            logits = torch.zeros(input_ids.shape[0], 1, 5)
            logits[:, 0, 3] = 1.0  # token 3, never eos (0): every row runs to max_new_tokens
            return types.SimpleNamespace(logits=logits)

    monkeypatch.setattr(transformers, "DynamicCache", Cache)
    prompts = [[1] * n for n in (3, 4, 5, 6, 30, 31)]
    got = dict(generate_stream(Fake(), prompts, 0, 4, batch_size=3, gen_tokens=60))
    assert got == {i: [3, 3, 3, 3] for i in range(len(prompts))}
    assert [rows for rows, _ in prefills] == [3, 1, 1, 1]  # 30 and 31 do not fit beside another row
    assert all(rows == 1 or rows * width <= 60 for rows, width in decodes)


@pytest.mark.model
def test_two_turn_prompts_follow_the_models_own_answer(tmp_path, smol32):
    from adaptivespec.training.data import distill

    model, tok = smol32
    prompts = [Prompt("chat2-x-1", "Name a fruit.", follow_up="Now name a vegetable."), Prompt("instruct-x-2", "Say hi.")]
    recs = {r.id: r for r in distill(model, tok, prompts, tmp_path / "d.jsonl", max_new_tokens=12, progress=False)}
    assert set(recs) == {"chat2-x-1-t1", "chat2-x-1", "instruct-x-2"}
    first = tok.decode(recs["chat2-x-1-t1"].response_ids, skip_special_tokens=True).strip()
    second_prompt = tok.decode(recs["chat2-x-1"].prompt_ids)
    assert "Name a fruit." in second_prompt and first in second_prompt and second_prompt.rstrip().endswith("assistant")
    # resumable: nothing left to do, nothing appended
    n = len((tmp_path / "d.jsonl").read_text().splitlines())
    distill(model, tok, prompts, tmp_path / "d.jsonl", max_new_tokens=12, progress=False)
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == n


def test_model_card_records_the_mix_and_relative_paths(tmp_path):
    from adaptivespec.training.card import data_section

    (tmp_path / "training").mkdir()
    recs = [{"id": "rag-t0-quoref-1", "prompt_ids": [1], "response_ids": [5, 6, 2]},
            {"id": "summarize-scitldr-0-2", "prompt_ids": [1], "response_ids": [7, 2]},
            {"id": "rag-pubmedqa-9", "prompt_ids": [1], "response_ids": [2]}]
    (tmp_path / "training" / "distill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    settings = {"mix": "rag=3,summarize=1", "max_prompts": 4, "prompt_seed": 7, "val_frac": 0.25, "seed": 0}
    text = "\n".join(data_section(tmp_path, settings, {"train_response_tokens": 6}))
    assert "| rag | 0.75 | 2 | 4 |" in text and "| summarize | 0.25 | 1 | 2 |" in text
    assert "--mix rag=3,summarize=1" in text
    # the corpus grew after training: the card counts the records the run used (training/records.txt)
    (tmp_path / "training" / "records.txt").write_text("rag-t0-quoref-1\nsummarize-scitldr-0-2\n")
    text = "\n".join(data_section(tmp_path, settings, {"train_response_tokens": 6}))
    assert "| rag | 0.75 | 1 | 3 |" in text and "| summarize | 0.25 | 1 | 2 |" in text
    # --val-ids: the card names the file and counts the records the run held out
    (tmp_path / "training" / "validation.txt").write_text("rag-t0-quoref-1\n")
    text = "\n".join(data_section(tmp_path, {**settings, "val_ids": str(tmp_path / "val.txt")}, {"train_response_tokens": 6}))
    assert "the records named in `val.txt` (`--val-ids`), 1 held out" in text and "split 75.0" not in text
    assert "--reserve-ids" not in text
    text = "\n".join(data_section(tmp_path, {**settings, "reserve_ids": str(tmp_path / "reserved.txt")}, {"train_response_tokens": 6}))
    assert "`reserved.txt` (`--reserve-ids`) are set aside for tuning" in text
    assert "--kind-weights" not in text
    text = "\n".join(data_section(tmp_path, {**settings, "kind_weights": "translate=3"}, {"train_response_tokens": 6}))
    assert "(`--kind-weights translate=3`): each training record of a listed kind is seen that many times per epoch" in text
    legacy = "\n".join(data_section(tmp_path, {"distilled": str(DATA_ROOT / "distill" / "x.jsonl"), "val_frac": 0.1,
                                               "seed": 0}, {"train_response_tokens": 6}))
    assert "`shared/data/distill/x.jsonl`" in legacy and str(DATA_ROOT) not in legacy


def test_model_card_tables_vocabulary_coverage_per_kind(tmp_path):
    from adaptivespec.training.card import kind_coverage
    from adaptivespec.training.data import Record
    from adaptivespec.training.vocab import coverage_by_kind

    recs = [Record("rag-t0-quoref-1", [1], [5, 6, 2]), Record("translate-multi30k-3-4", [1], [9, 9, 5, 2])]
    cov = coverage_by_kind(recs, torch.tensor([2, 5]), kind_of)
    assert cov == {"rag": {"tokens": 3, "coverage": 2 / 3}, "translate": {"tokens": 4, "coverage": 0.5}}

    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "distill.jsonl").write_text(
        "".join(json.dumps({"id": r.id, "prompt_ids": r.prompt_ids, "response_ids": r.response_ids}) + "\n" for r in recs * 2))
    settings = {"mix": "rag=1,translate=1", "val_frac": 0.25, "seed": 0, "draft_vocab": 2, "max_prompts": None}
    text = "\n".join(kind_coverage(tmp_path, settings, {"ids": [2, 5]}))
    assert "| rag |" in text and "| translate |" in text and "0.5000" in text and "0.6667" in text
    assert kind_coverage(tmp_path, {**settings, "mix": None}, {"ids": [2, 5]}) == []  # not a mix run: no table


def _heldout_script():
    from adaptivespec.analysis import heldout_mix_set

    return heldout_mix_set


def test_heldout_mix_set_leaves_out_every_trained_prompt():
    mod = _heldout_script()
    prompts = [Prompt("math-gsm8k-train-1", "a"), Prompt("math-gsm8k-train-2", "b"), Prompt("math-gsm8k-train-3", "c"),
               Prompt("chat2-alpaca-5", "d", follow_up="e"), Prompt("rag-pubmedqa-1", "x" * 50), Prompt("rag-pubmedqa-2", "f")]
    rows = mod.heldout(prompts, {"math-gsm8k-train-1", "rag-pubmedqa-2"}, per_kind=1, max_chars=20)
    assert [(r["question_id"], r["category"], r["turns"]) for r in rows] == [("math-gsm8k-train-3", "mix:math", ["c"])]
    # from the tail of the mix: what a growing corpus reaches last
    rows = mod.heldout(prompts, {"math-gsm8k-train-3"}, per_kind=1, max_chars=20)
    assert [r["question_id"] for r in rows] == ["math-gsm8k-train-2", "rag-pubmedqa-2"]
    # a two-turn record is stored under its id and '-t1': both count as seen; chat2 is never emitted anyway
    assert mod.heldout([Prompt("chat2-alpaca-5", "d", follow_up="e")], set(), 3, 100) == []
    # --skip: a second tuning set, disjoint from the first (the next prompts back from the tail)
    rows = mod.heldout(prompts, {"math-gsm8k-train-3"}, per_kind=1, max_chars=20, skip=1)
    assert [r["question_id"] for r in rows] == ["math-gsm8k-train-1"]


@needs_data
def test_heldout_mix_set_cli(tmp_path):
    mod = _heldout_script()
    corpus = tmp_path / "c.jsonl"
    first = build_mix(20000, None, seed=20261129)[:5]
    corpus.write_text("".join(json.dumps({"id": p.id, "prompt_ids": [1], "response_ids": [2]}) + "\n" for p in first))
    assert mod.main(["--distilled", str(corpus), "--per-kind", "2", "--out", str(tmp_path / "h.jsonl")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert len(rows) == 14 and not {r["question_id"] for r in rows} & {p.id for p in first}
    assert mod.main(["--distilled", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "h.jsonl")]) == 2
