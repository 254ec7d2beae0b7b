"""One engine for one request or many: an observer plugin installed as an outside distribution sees
the same records through ``generate``, the one-at-a-time server and the batching server; a seed
gives the same text whatever runs beside it, whatever tree was verified, one request or a batch."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_torch_server import post, uvicorn_on_loopback

from adaptivespec.config import load_config
from adaptivespec.plugins import make_plugin_host
from adaptivespec.testing import install_plugin
from shared_prompts import PROMPTS

ROOT = Path(__file__).resolve().parents[1]

OBSERVER = '''
import adaptivespec

STEPS = []
DONE = []


@adaptivespec.hookimpl
def adaptivespec_step(record):
    STEPS.append(record)


@adaptivespec.hookimpl
def adaptivespec_generation_done(result):
    DONE.append(result)
'''


@pytest.fixture(scope="module")
def observer(tmp_path_factory):
    """The plugin as an installed distribution (module + dist-info + entry point) on ``sys.path``, and
    a plugin host that loaded it from its entry point; yields (host, module)."""
    site = install_plugin(tmp_path_factory.mktemp("site"), "adaptivespec-stepwatch", "stepwatch_plugin", OBSERVER)
    sys.path.insert(0, str(site))
    try:
        host = make_plugin_host()
        assert host.providers.get("stepwatch") == "adaptivespec-stepwatch" or "stepwatch_plugin" in sys.modules
        yield host, sys.modules["stepwatch_plugin"]
    finally:
        sys.path.remove(str(site))


def check_reported(module, answers: list[list[int]]) -> None:
    """Every generation reported once, its records adding up to its tokens, every step record seen
    by the step hook belonging to one reported generation."""
    done = list(module.DONE)
    assert sorted(len(r.token_ids) for r in done) == sorted(len(a) for a in answers)
    assert sorted(tuple(r.token_ids) for r in done) == sorted(tuple(a) for a in answers)
    for r in done:  # the prefill gives the first token; one record per target forward after it
        assert sum(rec.new_tokens for rec in r.records) == len(r.token_ids) - 1
        assert r.stats["target_forwards"] == len(r.records) + 1
    seen = {id(rec) for rec in module.STEPS}
    assert seen == {id(rec) for r in done for rec in r.records}
    assert len(module.STEPS) == len(seen)  # each step reported once


def reset(module) -> None:
    module.STEPS.clear()
    module.DONE.clear()


@pytest.mark.model
def test_an_outside_observer_sees_the_same_records_through_generate_and_both_servers(observer):
    from adaptivespec.batch import BatchEngine
    from adaptivespec.decode import Engine
    from adaptivespec.server.app import Service, build_app
    from adaptivespec.server.batch_worker import BatchWorker
    from adaptivespec.server.metrics import ServerMetrics
    from adaptivespec.server.worker import Worker

    host, module = observer
    config = load_config(ROOT / "configs" / "batched-hybrid.yaml", ["runtime.dtype=float32"])
    prompts, n = PROMPTS[:4], 10

    reset(module)
    one = Engine(config, host, structured=True)
    alone = [one.generate_ids(one.encode(p), max_new_tokens=n).token_ids for p in prompts]
    check_reported(module, alone)
    by_generate = [(r.token_ids, [rec.new_tokens for rec in r.records]) for r in module.DONE]

    def served(engine, worker_cls) -> list[list[int]]:
        reset(module)
        metrics = ServerMetrics(("retrieval", "head"))
        service = Service(engine=engine, worker=worker_cls(engine, 8, metrics), metrics=metrics, model="watched")
        with uvicorn_on_loopback(build_app(service)) as port:
            body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 0}  # noqa: E731
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda p: post(port, "/v1/chat/completions", body(p)), prompts))
        assert all(status == 200 for status, _, _ in answers), answers
        return [list(r.token_ids) for r in module.DONE]

    got = served(Engine(config, host, structured=True), Worker)  # --parallel 1
    check_reported(module, got)
    assert sorted(map(tuple, got)) == sorted(map(tuple, alone))
    assert sorted((tuple(t), tuple(s)) for t, s in by_generate) == sorted(
        (tuple(r.token_ids), tuple(rec.new_tokens for rec in r.records)) for r in module.DONE)

    got = served(BatchEngine(config, 8, host=host, log=lambda _: None), BatchWorker)  # --parallel 8
    check_reported(module, got)
    assert sorted(map(tuple, got)) == sorted(map(tuple, alone))  # float32: every request as if alone


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["hybrid", "batched-hybrid", "cost-aware-hybrid"])
def test_a_seed_gives_the_same_text_alone_among_others_and_by_plain_decoding(name, dtype):
    """Seeded sampled requests, each sent alone and again among others (a batch of 4 lanes, other
    seeds beside it) through ``name``: the same tokens each time, and the same as the ``ar`` config
    (plain decoding: no tree at all) gives for that seed. In float32 (transformers' forward) and in
    bfloat16 where the batch-invariant kernels build (AVX512-BF16: attention and the fixed-order linear)."""
    from adaptivespec.batch import BatchEngine
    from adaptivespec.decode import Engine
    from adaptivespec.fastpath import native

    if dtype == "bfloat16" and (native.attention_ops() is None or native.linear_ops() is None):
        pytest.skip(f"bf16 is batch-invariant only with the bf16 kernels: {native.attention_why_not()}")
    over = [f"runtime.dtype={dtype}", "generation.temperature=0.8", "generation.top_k=50"]
    config = load_config(ROOT / "configs" / f"{name}.yaml", over)
    plain = Engine(load_config(ROOT / "configs" / "ar.yaml", over))
    prompts = [plain.encode(p) for p in PROMPTS[:4]]
    seeds = [3, 101, 7, 2**40 + 5]
    want = [plain.generate_ids(p, max_new_tokens=16, seed=s).token_ids for p, s in zip(prompts, seeds)]
    assert len({tuple(w) for w in want}) == len(want)

    alone = Engine(config)
    assert [alone.generate_ids(p, max_new_tokens=16, seed=s).token_ids for p, s in zip(prompts, seeds)] == want
    batch = BatchEngine(config, 4, log=lambda _: None)
    solo = [batch.generate_many([p], seeds=[s], max_new_tokens=16)[0] for p, s in zip(prompts, seeds)]
    assert [r.token_ids for r in solo] == want  # each alone in the batch engine
    together = batch.generate_many(prompts, seeds=seeds, max_new_tokens=16)  # and among the others
    assert [r.token_ids for r in together] == want
    # trees were verified, not skipped (the row budget may turn a batch to plain rows once it has
    # learned that drafting does not pay for these prompts: the seeds hold through both)
    assert sum(rec.accepted for r in (*solo, *together) for rec in r.records) > 0


def test_keyed_choices_do_not_depend_on_the_rows_beside_them_and_are_exact():
    """The sampler's keyed choice of a row is the same alone, in a tree of other rows, at another
    depth's key only when the position is the same; over many seeds it is distributed as p."""
    import torch

    from adaptivespec.sampling import Sampler

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 300, generator=g) * 2, -1)
    s = Sampler(1.0, seed=5)
    s.at(40)
    tree = s.choose(probs, torch.tensor([0, 1, 1, 2, 2, 3]))
    s.at(41)
    assert s.choose(probs[1:2], torch.tensor([0]))[0] == tree[1]  # row 1: depth 1 past 40 = position 41
    s.at(43)
    assert s.choose(probs[5:6], torch.tensor([0]))[0] == tree[5]
    counts = torch.zeros(300)
    for seed in range(4000):
        s.reseed(seed)
        s.at(17)
        counts[s.choose(probs[:1], torch.tensor([0]))[0]] += 1
    top = probs[0].topk(5).indices
    expected, observed = probs[0, top] * 4000, counts[top]
    assert ((observed - expected).abs() < 4 * expected.sqrt() + 3).all(), (observed, expected)


# -- logprobs and n ------------------------------------------------------------------------------------
def plain_logprobs(target, prompt: list[int], out: list[int]):
    """The target's log-softmax at each generated token's position, by one plain forward."""
    import torch

    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) + len(out) - 1].log_softmax(-1)


def assert_logprobs_match(entries, lsm, out: list[int], k: int) -> None:
    import torch

    assert [t for t, _, _ in entries] == out
    got = torch.tensor([lp for _, lp, _ in entries])
    want = lsm.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
    assert (got - want).abs().max() < 1e-3, (got, want)
    for (_, _, top), row in zip(entries, lsm):
        assert len(top) == k
        values = row.topk(k).values
        assert max(abs(q - float(v)) for (_, q), v in zip(top, values)) < 1e-3
        assert all(abs(q - float(row[i])) < 1e-3 for i, q in top)


@pytest.mark.model
@pytest.mark.parametrize("name", ["ar", "hybrid", "batched-hybrid"])
def test_logprobs_are_the_targets_own_at_each_emitted_token(name):
    """Through plain decoding, verify trees (one request) and the batch engine (two requests at once,
    one sampled): each token's log-probability and its top 5 within 1e-3 of a plain forward's."""
    from adaptivespec.batch import BatchEngine, Request
    from adaptivespec.batch.request import Sampling
    from adaptivespec.decode import Engine

    config = load_config(ROOT / "configs" / f"{name}.yaml", ["runtime.dtype=float32"])
    if name == "batched-hybrid":
        be = BatchEngine(config, 2, log=lambda _: None)
        prompts = [be.encode(p) for p in PROMPTS[:2]]
        reqs = [be.submit(Request(prompt=prompts[0], max_new_tokens=12, logprobs=5)),
                be.submit(Request(prompt=prompts[1], max_new_tokens=12, logprobs=5, seed=3,
                                  sampling=Sampling(temperature=0.9)))]
        while be.busy:
            be.step()
        runs = [(p, r.out, be.result(r).logprobs) for p, r in zip(prompts, reqs)]
        target = be.target
    else:
        engine = Engine(config)
        prompt = engine.encode(PROMPTS[0])
        streamed = []
        res = engine.generate_ids(prompt, max_new_tokens=12, logprobs=5, on_logprobs=streamed.extend)
        assert streamed == res.logprobs
        runs, target = [(prompt, res.token_ids, res.logprobs)], engine.target
    for prompt, out, entries in runs:
        assert_logprobs_match(entries, plain_logprobs(target, prompt, out), out, 5)


@pytest.fixture(scope="module")
def served_batch():
    """``batched-hybrid.yaml`` (float32) behind the batching worker, 4 lanes: yields the port."""
    from adaptivespec.batch import BatchEngine
    from adaptivespec.server.app import Service, build_app
    from adaptivespec.server.batch_worker import BatchWorker
    from adaptivespec.server.metrics import ServerMetrics

    config = load_config(ROOT / "configs" / "batched-hybrid.yaml", ["runtime.dtype=float32"])
    engine = BatchEngine(config, 4, log=lambda _: None)
    metrics = ServerMetrics(("retrieval", "head"))
    service = Service(engine=engine, worker=BatchWorker(engine, 8, metrics), metrics=metrics, model="m")
    with uvicorn_on_loopback(build_app(service)) as port:
        yield port, engine


@pytest.mark.model
def test_served_logprobs_and_n_choices_whole_and_streamed(served_batch):
    import http.client

    port, engine = served_batch
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8, "temperature": 0.8, "seed": 5,
            "logprobs": True, "top_logprobs": 3, "n": 4}
    status, _, answer = post(port, "/v1/chat/completions", body)
    assert status == 200, answer
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({c["message"]["content"] for c in choices}) > 1  # seeds 5, 6, 7, 8
    tokens = 0
    for c in choices:
        content = c["logprobs"]["content"]
        assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)
        tokens += len(content)
    assert answer["usage"]["completion_tokens"] == tokens
    one = post(port, "/v1/chat/completions", {**body, "n": 1})[2]["choices"][0]  # choice 0 is seed 5's alone
    assert one["message"]["content"] == choices[0]["message"]["content"]
    alone, among = one["logprobs"]["content"], choices[0]["logprobs"]["content"]  # float32: rounding by the batch's layout
    assert [e["token"] for e in alone] == [e["token"] for e in among]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(alone, among)) < 1e-4

    # completions, streamed: the chunks' log-probabilities add up to the whole answer's
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = post(port, "/v1/completions", body)[2]["choices"][0]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    got = [t for c in chunks for t in ((c["choices"][0].get("logprobs") or {}).get("tokens") or [])]
    assert got == whole["logprobs"]["tokens"] and len(got) == post(port, "/v1/completions", body)[2]["usage"]["completion_tokens"]
    assert whole["logprobs"]["text_offset"][1] == len(whole["logprobs"]["tokens"][0])


@pytest.mark.parametrize("extra, words", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs: expected an integer in [0, 20], got 21"),
    ({"top_logprobs": 2}, "top_logprobs: expected logprobs: true beside it"),
    ({"logprobs": 3}, "logprobs: expected true or false, got 3"),
    ({"n": 0}, "n: expected an integer in [1, 16], got 0"),
    ({"n": 17}, "n: expected an integer in [1, 16], got 17"),
])
def test_bad_logprobs_and_n_are_one_line_400s(extra, words):
    from adaptivespec.config import GenerationConfig
    from adaptivespec.server.schema import RequestError, parse_request

    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(RequestError) as err:
        parse_request(body, chat=True, defaults=GenerationConfig(), vocab_size=100)
    assert words in err.value.message and "\n" not in err.value.message


@pytest.mark.model
def test_speculation_metrics_count_forwards_and_the_load_chosen_plain_steps(served_batch):
    """Four requests at once, the row budget made to alternate plain and drafting steps: every plain
    step counts once as ``undrafted{reason="load"}``, every forward with decoders once in
    ``verify_rows_per_step`` (not once per request), every request's drafted step in
    ``accepted_tokens_per_step``."""
    import urllib.request

    from adaptivespec.metrics import parse_metrics

    port, engine = served_batch
    budget = engine.budget
    calls = []

    def speculate(*args, **kwargs):
        budget.mode = len(calls) % 2 == 1
        calls.append(budget.mode)
        return budget.mode

    def read() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            return parse_metrics(r.read().decode())

    before = read()
    budget.speculate = speculate
    try:
        body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0}  # noqa: E731
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: post(port, "/v1/chat/completions", body(p)), PROMPTS[:4]))
    finally:
        del budget.speculate
    assert all(a[0] == 200 for a in answers)
    after = read()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta['adaptivespec_undrafted_steps_total{reason="load"}'] == calls.count(False) > 0
    assert delta["adaptivespec_verify_rows_per_step_count"] == len(calls)
    drafted_steps = sum(v for k, v in delta.items() if k.startswith("adaptivespec_steps_total{"))
    policy = delta['adaptivespec_undrafted_steps_total{reason="policy"}']
    assert drafted_steps + policy >= calls.count(True)  # each drafting step: one per request that drafted
    assert delta["adaptivespec_accepted_tokens_per_step_count"] == drafted_steps


@pytest.mark.model
def test_n_choices_read_their_prompt_once():
    """The same prompt three times at once (``n`` choices): the first reads it, the others wait that
    step out and take all of it but its last token from the prefix cache; the answers are the same."""
    from adaptivespec.batch import BatchEngine, Request

    config = load_config(ROOT / "configs" / "batched-hybrid.yaml", ["runtime.dtype=float32"])
    be = BatchEngine(config, 4, log=lambda _: None)
    prompt = be.encode(PROMPTS[3])
    reqs = [be.submit(Request(prompt=prompt, max_new_tokens=8)) for _ in range(3)]
    other = be.submit(Request(prompt=be.encode(PROMPTS[1]), max_new_tokens=8))
    while be.busy:
        be.step()
    assert [r.cached for r in reqs] == [0, len(prompt) - 1, len(prompt) - 1] and other.cached == 0
    assert reqs[0].out == reqs[1].out == reqs[2].out
