"""``train-drafter``: TTT unroll = inference drafting, arguments, a tiny end-to-end run, the shipped head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training import cli
from adaptivespec.training.cli import parse_budget

from adaptivespec.training.data import DATA_ROOT
from shared_prompts import PROMPTS

SHIPPED = Path(__file__).resolve().parents[1] / "adaptivespec" / "heads" / "smollm2-135m-instruct-eagle3"


def run_cli(argv: list[str]) -> int:
    return cli.main(argv)


# -- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("90m", (5400.0, None)), ("2h", (7200.0, None)), ("30s", (30.0, None)),
                                            ("2e6tok", (None, 2_000_000)), ("500ktok", (None, 500_000))])
def test_budget_units(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("argv, words", [
    (["--budget", "ten minutes"], ["--budget", "ten minutes", "expected"]),
    (["--draft-vocab", "0"], ["--draft-vocab", "0", "positive integer"]),
    (["--distilled", "/no/such.jsonl"], ["--distilled", "/no/such.jsonl", "expected"]),
    (["--resume"], ["--resume", "no checkpoint"]),
    (["--data", str(DATA_ROOT / "gsm8k" / "test.jsonl")], ["--data", "evaluation set"]),
    (["--val-ids", "/no/such.txt"], ["--val-ids", "/no/such.txt", "record ids"]),
    (["--reserve-ids", "/no/such.txt"], ["--reserve-ids", "/no/such.txt", "record ids"]),
    (["--device", "gpu0"], ["--device", "gpu0", "expected cpu, cuda or cuda:N"]),
    (["--device", "mps"], ["--device", "mps", "not supported"]),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, words):
    assert run_cli(["--out", str(tmp_path / "o"), "--quiet", *argv]) == AdaptiveSpecError.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_a_one_line_error(tmp_path, capsys):
    assert run_cli(["--out", str(tmp_path / "o"), "--quiet", "--device", "cuda"]) == AdaptiveSpecError.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device: 'cuda' is not available" in err and "expected cpu" in err


def test_val_ids_hold_out_exactly_those_records():
    from adaptivespec.training.data import Record, split

    records = [Record(f"r{i}", [1], [2, 3]) for i in range(40)]
    train, val = split(records, 0.025, 0, {"r3", "r17", "not-a-record"})
    assert [r.id for r in val] == ["r3", "r17"] and len(train) == 38 and not {r.id for r in train} & {"r3", "r17"}


def test_reserved_ids_are_never_generated_or_trained_on(tmp_path, monkeypatch):
    """--reserve-ids: a reserved prompt is not handed to generation (a two-turn prompt's first turn
    neither), and reserved records in a pre-generated corpus are dropped before the split."""
    import argparse

    import adaptivespec.training.data as data
    from adaptivespec.training.data import Prompt

    reserve = tmp_path / "reserved.txt"
    reserve.write_text("math-1\nchat2-7\n")
    corpus = tmp_path / "distill.jsonl"
    ids = ["math-0", "math-1", "chat2-7-t1", "chat2-7", "code-2"]
    corpus.write_text("".join(json.dumps({"id": i, "prompt_ids": [1], "response_ids": [2]}) + "\n" for i in ids))
    args = argparse.Namespace(distilled=corpus, max_prompts=None, reserve_ids=reserve, mix=None)
    assert [r.id for r in cli.load_records(args, None, None)] == ["math-0", "code-2"]

    handed = []

    def fake_distill(model, tok, prompts, out, **kw):
        handed.extend(p.id for p in prompts)
        return data.read_records(corpus)

    prompts = [Prompt("math-0", "a"), Prompt("math-1", "b"), Prompt("chat2-7", "c", follow_up="d"), Prompt("code-2", "e")]
    monkeypatch.setattr(data, "distill", fake_distill)
    monkeypatch.setattr(data, "load_prompts", lambda *a, **k: prompts)
    args = argparse.Namespace(distilled=None, max_prompts=None, reserve_ids=reserve, mix=None, data=["x"],
                              data_root=tmp_path, prompt_seed=0, out=tmp_path / "o", gen_batch=1, max_new_tokens=4,
                              quiet=True, gen_tokens=64)
    assert [r.id for r in cli.load_records(args, None, None)] == ["math-0", "code-2"]
    assert handed == ["math-0", "code-2"]


def test_eval_sets_are_refused():
    from adaptivespec.training.data import check_not_eval

    for bad in ["/d/gsm8k/test.jsonl", "/d/math500/x.jsonl", "/d/humaneval/HumanEval.jsonl.gz", "/d/specbench/question.jsonl"]:
        with pytest.raises(AdaptiveSpecError):
            check_not_eval(Path(bad))
    check_not_eval(Path("/d/train/mbpp_nontest.jsonl"))


# -- the TTT unroll is the inference-time drafting -----------------------------------------------
@pytest.mark.model
def test_unroll_matches_inference_drafting(smol32):
    """Chain i at TTT step j == the depth-j node drafted (Eagle3Drafter.step) from root i + 1."""
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.training.ttt import unroll

    target = smol32[0]
    d = Eagle3Drafter.random_init(target, 512, seed=1)
    ids = torch.randint(0, target.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    k, first = 4, 5
    with torch.no_grad():
        g = d.fuse(target.model(input_ids=ids, output_hidden_states=True).hidden_states)
        outs = {j: (off, st) for j, off, st in unroll(d, ids, g, k, first)}
        for b, root in [(0, 8), (1, 20), (1, 27)]:
            d.reset_cache(64)
            state = d.step(ids[b, 1 : root + 1], g[b, :root], torch.arange(root), None)[-1]
            torch.testing.assert_close(state, outs[0][1][b, root - 1], atol=1e-4, rtol=1e-4)
            for j in range(1, k):
                mask = torch.zeros(1, 1, 1, d.length + 1)
                state = d.step(ids[b, root + j : root + j + 1], state[None], torch.tensor([root + j - 1]), mask)[0]
                off, st = outs[j]
                torch.testing.assert_close(state, st[b, root - 1 - off], atol=1e-4, rtol=1e-4)


# -- a tiny end-to-end run ------------------------------------------------------------------------
@pytest.mark.model
def test_tiny_run_trains_exports_and_decodes_losslessly(tmp_path, smol32, greedy_reference):
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.drafter import Eagle3Drafter

    out = tmp_path / "head"
    common = ["--out", str(out), "--max-prompts", "4", "--max-new-tokens", "16", "--gen-batch", "4", "--draft-vocab", "512",
              "--batch-tokens", "1024", "--ttt-steps", "3", "--warmup", "2", "--threads", "2", "--quiet"]
    assert run_cli([*common, "--steps", "6"]) == 0
    rows = [json.loads(x) for x in (out / "training" / "log.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[0]["step"] == 1 and train[-1]["step"] == 5 and train[-1]["loss"] < 0.7 * train[0]["loss"]
    vals = [r for r in rows if r["kind"] == "val"]
    assert vals[0]["step"] == 0 and rows.index(vals[0]) < rows.index(train[0])  # where the head started, before any step
    assert sum(vals[-1]["val_loss"]) < sum(vals[0]["val_loss"])
    val = vals[-1]
    assert len(val["val_acc"]) == 3
    # per kind of record (these ids are not mix kinds: one "other" row that is the whole validation)
    assert val["val_rows_by_kind"] == {"other": val["val_rows"][0]} and val["val_acc_by_kind"]["other"] == val["val_acc"]
    recs = (out / "training" / "distill.jsonl").read_text().splitlines()
    assert len(recs) == 4 and all(set(json.loads(x)) == {"id", "prompt_ids", "response_ids"} for x in recs)
    names = [json.loads(x)["id"] for x in recs]
    assert (out / "training" / "records.txt").read_text().split() == names
    held = (out / "training" / "validation.txt").read_text().split()
    assert len(held) == 1 and held[0] in names  # the seeded --val-frac draw, written down
    # resume continues from the checkpoint (data position, optimiser, step)
    assert run_cli([*common, "--steps", "7", "--resume"]) == 0
    rows = [json.loads(x) for x in (out / "training" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "val" and rows[-1]["step"] == 7

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    head = Eagle3Drafter.from_pretrained(out, smol32[0])
    assert int(head.t2d.sum()) == 512
    engine = Engine(load_config(None, [f"model.drafter={out}", "runtime.dtype=float32", "policy.nsteps=3",
                                       "policy.topk=2", "policy.ndt=6", "verifier.name=strict"]))
    ids, ref = greedy_reference(PROMPTS[0], 32)
    assert engine.generate_ids(ids, max_new_tokens=32).token_ids == ref

    # --init-from the shipped head: same data, a new draft vocabulary; it starts far below a random init
    if (SHIPPED / "config.json").is_file():
        warm = tmp_path / "warm"
        (tmp_path / "none.txt").write_text("no-such-record\n")  # holds out nothing: refused before training
        assert run_cli([*common, "--out", str(tmp_path / "none"), "--distilled", str(out / "training" / "distill.jsonl"),
                        "--val-ids", str(tmp_path / "none.txt")]) == AdaptiveSpecError.exit_code
        (tmp_path / "val.txt").write_text(f"{names[0]}\n{names[3]}\n")
        argv = [*common, "--steps", "1", "--distilled", str(out / "training" / "distill.jsonl"), "--init-from", "embedded",
                "--val-ids", str(tmp_path / "val.txt")]
        assert run_cli([a if a != str(out) else str(warm) for a in argv]) == 0
        assert (warm / "training" / "validation.txt").read_text().split() == [names[0], names[3]]
        first = [json.loads(x) for x in (warm / "training" / "log.jsonl").read_text().splitlines() if '"train"' in x][0]
        assert first["loss"] < 0.7 * train[0]["loss"]
        assert json.loads((warm / "training" / "run.json").read_text())["init_from"] == "embedded"


@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no shipped head in adaptivespec/heads")
@pytest.mark.model
def test_validation_counts_rows_and_hits_per_record(smol32):
    """ttt_loss(by_record=True) on a batch of two records with prompts of different lengths: at every
    draft step each row's labelled positions and top-1 hits are what the same record scores alone (a
    trained head, so hits are not all zero; no chain with a label is left out of the unroll whatever
    the batch mates), and the rows add up to the step's totals."""
    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.models import encode_prompt
    from adaptivespec.training.data import Record, collate
    from adaptivespec.training.ttt import target_features, ttt_loss

    model, tok = smol32
    head = Eagle3Drafter.from_pretrained(SHIPPED, model, dtype=torch.float32)
    vocab = torch.arange(head.d2t.shape[0]) + head.d2t.cpu()
    eos = tok.eos_token_id
    recs = [Record("math-a", encode_prompt(tok, "What is 12 times 7?"), tok.encode("12 times 7 is 84. The answer is 84.") + [eos]),
            Record("rag-b", encode_prompt(tok, "Name a color."), tok.encode("Blue is a color.") + [eos])]

    def stats(part, by_record=True):
        batch = collate(part, 256, eos)
        return ttt_loss(head, batch, target_features(model, head.aux_layers, batch, vocab, head.t2d, 3), 3, by_record=by_record)

    both = stats(recs)
    assert both.correct[0] > 0
    assert len({len(r.prompt_ids) for r in recs}) == 2
    for b, rec in enumerate(recs):
        alone = stats([rec])
        for j, (rows, hits) in enumerate(both.by_record):
            assert (int(rows[b]), int(hits[b])) == (alone.count[j], alone.correct[j]), (rec.id, j)
    for j, (rows, hits) in enumerate(both.by_record):
        assert (int(rows.sum()), int(hits.sum())) == (both.count[j], both.correct[j])
    assert stats(recs, by_record=False).by_record is None


# -- the shipped head -----------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.skipif(not (SHIPPED / "config.json").is_file(), reason="no shipped head in adaptivespec/heads")
def test_shipped_head_drafts_on_a_long_passage_summary_and_a_word_problem():
    """eagle3.yaml as shipped, in float32, on a 658-token passage to summarise and a word problem (neither
    is a training prompt).

    Issue 11 asks for tau > 2 on both. Float32, so that every head verifies its way to the same greedy text
    and tau measures the head alone: in bf16 a tree's verify forward can flip a near-tie, and a head is then
    scored on a different text (in bf16 the fourth broad run verified its way to a 96-token summary and drafted
    tau 1.50 on it, the second run to a 60-token one; in float32 both decode one text, at 1.70). At eagle3.yaml's
    (3, 4, 8), 96 tokens, float32: the seventh run (shipped 2026-12-02 evening) 1.70 and 2.29 (bf16: 1.48 and 2.00),
    the fifth 1.70 and 2.44 (bf16: 1.88 and 2.22), the fourth 1.70 and 2.05, the second 1.70 and 1.95. This floor catches a head that stops drafting outside math
    and code (the mean floor was 1.6 until the fifth run); raise it to the issue's 2.0 once a head gets there.
    """
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine
    from adaptivespec.training.card import FIXED_PROMPTS

    engine = Engine(load_config(Path(__file__).resolve().parents[1] / "configs" / "eagle3.yaml", ["runtime.dtype=float32"]))
    taus = [engine.generate(text, max_new_tokens=96).stats["accept_length_mean"] for text in FIXED_PROMPTS]
    assert min(taus) > 1.5 and sum(taus) / len(taus) > 1.9, taus


def test_model_card_measures_eagle3_yaml_shape_first():
    """The card's first shape is the one users run: eagle3.yaml's (a shape change must move both)."""
    import yaml

    from adaptivespec.training.card import SHAPES

    policy = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "eagle3.yaml").read_text())["policy"]
    assert SHAPES[0] == (policy["nsteps"], policy["topk"], policy["ndt"])


def test_model_card_lists_every_validation_and_resume(tmp_path):
    from adaptivespec.training.card import card

    (tmp_path / "training").mkdir()
    settings = {"draft_vocab": 512, "val_frac": 0.025, "seed": 0, "ttt_steps": 2, "decay": 0.8, "lr": 1e-3,
                "warmup": 20, "min_lr_ratio": 0.1, "clip": 0.5, "batch_tokens": 4096, "budget": "10m", "distilled": None}
    (tmp_path / "training" / "run.json").write_text(json.dumps(settings))
    (tmp_path / "training" / "vocab.json").write_text(json.dumps({"draft_vocab": 512, "train_response_tokens": 1000, "coverage": [
        {"n": 512, "coverage": 0.9, "val_coverage": 0.8, "lm_head_mb": 0.6}]}))
    rows = [{"time": "t0", "kind": "start", "resume": False, "step": 0, "budget": "10m"},
            {"time": "t1", "kind": "val", "step": 5, "tokens": 100, "seconds": 60, "epoch": 0, "index": 5, "val_acc": [0.1, 0.05]},
            {"time": "t2", "kind": "start", "resume": True, "step": 5, "budget": "20m"},
            {"time": "t3", "kind": "val", "step": 5, "tokens": 100, "seconds": 61, "epoch": 0, "index": 5, "val_acc": [0.12, 0.06]},
            {"time": "t4", "kind": "val", "step": 9, "tokens": 180, "seconds": 120, "epoch": 1, "index": 1, "val_acc": [0.3, 0.2]}]
    (tmp_path / "training" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {"2 fixed": [{"shape": [5, 1, 6], "tau": 2.5, "tau_per_prompt": [2.0, 3.0], "new_tokens": 10, "tokens_per_second": 1.0}]}
    text = card(tmp_path, evals, 2, 96, "cmd")
    assert "Per kind of record" not in text  # logs from before validation per kind
    rows[3]["val_acc_by_kind"], rows[3]["val_rows_by_kind"] = {"math": [0.4, 0.15]}, {"math": 30}  # step 5, as kept
    rows[4]["val_acc_by_kind"], rows[4]["val_rows_by_kind"] = {"math": [0.5, 0.25], "rag": [0.2, 0.15]}, {"math": 30, "rag": 12}
    (tmp_path / "training" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = card(tmp_path, evals, 2, 96, "cmd")
    assert "| math | 30 | 0.400 | 0.500 | 0.250 |" in text and "| rag | 12 | - | 0.200 | 0.150 |" in text
    assert "| 5 | 100 | 0.120 | 0.060 |" in text and "| 9 | 180 | 0.300 | 0.200 |" in text
    assert "0.100" not in text  # the step validated twice keeps its last measurement
    assert "resumed at step 5 (budget `20m`)" in text and "steps 9, training tokens 180" in text
    assert "| 2 fixed | (5, 1, 6) | 2.500 |" in text

    # --bench: a per-category table from a bench run (tau of the reference, speedup over ar)
    cat = {"prompts": 3, "configs": [{"name": "ar", "accept_length_mean": 1.0, "tokens_per_second": 20.0},
                                     {"name": "eagle3", "accept_length_mean": 2.5, "tokens_per_second": 30.0}]}
    res = {"meta": {"dataset": "specbench", "max_new_tokens": 128, "machine": {"cpu": "X", "torch_threads": 2}},
           "ar": "ar", "reference": "eagle3", "categories": {"translation": cat}}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(json.dumps(res))
    text = card(tmp_path, evals, 2, 96, "cmd", [tmp_path / "bench"])
    assert "| translation | 3 | `eagle3` | 2.50 | 1.50x | 30.0 | 20.0 |" in text
    # --bench-head: the contender that ran this card's head is listed first, before the reference
    cat["configs"].append({"name": "new-head", "accept_length_mean": 3.0, "tokens_per_second": 36.0})
    (tmp_path / "bench" / "results.json").write_text(json.dumps(res))
    text = card(tmp_path, evals, 2, 96, "cmd", [tmp_path / "bench"], bench_head="new-head")
    new_row, ref_row = "| translation | 3 | `new-head` | 3.00 | 1.80x | 36.0 | 20.0 |", "| translation | 3 | `eagle3` | 2.50 |"
    assert new_row in text and ref_row in text and text.index(new_row) < text.index(ref_row)
    cat["configs"].pop()
    res.update(categories={}, configs=cat["configs"], meta={**res["meta"], "dataset": "gsm8k", "prompts": 3})
    (tmp_path / "bench" / "results.json").write_text(json.dumps(res))
    assert "| gsm8k | 3 | `eagle3` | 2.50 | 1.50x |" in card(tmp_path, evals, 2, 96, "cmd", [tmp_path / "bench"])


# -- warm start: --init-from ----------------------------------------------------------------------
def _tiny_target(hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    return LlamaForCausalLM._from_config(cfg, dtype=torch.float32).eval()


def test_warm_start_carries_weights_and_output_rows_by_token_id():
    from adaptivespec.drafter import Eagle3Drafter

    target = _tiny_target()
    source = Eagle3Drafter.random_init(target, 100, seed=1)
    source.set_vocab(torch.arange(0, 200, 2))  # even target ids
    fresh = Eagle3Drafter.random_init(target, 100, seed=2)
    new_ids = torch.arange(100, 200)  # 50 of them even (held by the source), 50 odd (new)
    fresh.set_vocab(new_ids)
    before = fresh.lm_head.weight.detach().clone()
    info = cli.warm_start(fresh, source)
    assert info == {"copied_rows": 50, "new_rows": 50}
    for name, p in fresh.named_parameters():
        if name != "lm_head.weight":
            assert torch.equal(p, dict(source.named_parameters())[name]), name
    for row, tid in enumerate(new_ids.tolist()):
        want = source.lm_head.weight[tid // 2] if tid % 2 == 0 else before[row]
        assert torch.equal(fresh.lm_head.weight[row], want), tid
    # the draft vocabulary itself is the new one
    assert torch.equal(fresh.d2t + torch.arange(100), new_ids)


def test_warm_start_refuses_a_head_of_another_geometry():
    from adaptivespec.drafter import Eagle3Drafter

    fresh = Eagle3Drafter.random_init(_tiny_target(64), 50, seed=0)
    other = Eagle3Drafter.random_init(_tiny_target(32), 50, seed=0)
    with pytest.raises(AdaptiveSpecError, match=r"--init-from: the head's .* has shape .*; expected"):
        cli.warm_start(fresh, other)


def test_init_from_a_missing_head_is_a_one_line_error(tmp_path, capsys):
    nohead = tmp_path / "nohead"
    assert run_cli(["--out", str(tmp_path / "o"), "--quiet", "--init-from", str(nohead)]) == AdaptiveSpecError.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--init-from" in err and str(nohead) in err and "expected" in err, err
