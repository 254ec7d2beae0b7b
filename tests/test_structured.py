"""Structured output: response formats, grammar masks over draft trees, the grammar source, and
constrained speculative decoding against constrained plain decoding (float32, real model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar")

from adaptivespec.config import load_config  # noqa: E402
from adaptivespec.response_format import ResponseFormat  # noqa: E402
from adaptivespec.constraints import GrammarBackend  # noqa: E402
from adaptivespec.errors import AdaptiveSpecError, ConfigError  # noqa: E402

ROOT = Path(__file__).parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "status": {"enum": ["student", "employed", "retired"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "status", "hobbies"],
}
PROMPT = ("Extract the person as JSON with keys name, age, status, hobbies: Maria Lopez is a 34 year old "
          "engineer from Valencia who enjoys climbing, chess and cooking. She is employed.")
FORMAT = "generation.response_format=" + json.dumps({"type": "json_schema", "schema": SCHEMA})


# -- validation (no model) ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, key, message", [
    ({"type": "xml"}, "generation.response_format.type", "expected one of json_schema, json_object, regex, ebnf, got 'xml'"),
    ({"type": "json_schema", "schema": {"type": "objectx"}}, "generation.response_format.schema", "cannot compile"),
    ({"type": "json_schema", "schema": "missing.json"}, "generation.response_format.schema", "no such file"),
    ({"type": "regex", "pattern": "[a-"}, "generation.response_format.pattern", "cannot compile"),
    ({"type": "regex"}, "generation.response_format", "pattern: expected a value for type regex"),
    ({"type": "regex", "pattern": "a", "schema": {}}, "generation.response_format.schema", "not used by type regex"),
    ({"type": "ebnf", "grammar": "root ::= foo"}, "generation.response_format.grammar", "cannot compile"),
])
def test_response_format_is_validated(value, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["generation.response_format=" + json.dumps(value)])
    text = str(err.value)
    assert f"{key}: " in text and message in text and "\n" not in text


def test_schema_file_and_inline_forms_agree(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    a = load_config(None, [f"generation.response_format={{type: json_schema, schema: {f}}}"]).generation.response_format
    b = load_config(None, [FORMAT]).generation.response_format
    assert a == b and a.schema == SCHEMA
    assert load_config(None, [FORMAT, "generation.grammar_draft=false"]).generation.grammar_draft is False


def test_cli_uncompilable_schema_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objectx"}')
    r = subprocess.run([sys.executable, "-m", "adaptivespec.cli", "generate", "--config", str(ROOT / "configs/ar.yaml"),
                        "--json-schema", str(bad), "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "generation.response_format.schema" in r.stderr and "objectx" in r.stderr
    rec = tmp_path / "p.jsonl"
    rec.write_text(json.dumps({"prompt": "x", "response_format": {"type": "regex", "pattern": "("}}) + "\n")
    r = subprocess.run([sys.executable, "-m", "adaptivespec.cli", "generate", "--config", str(ROOT / "configs/ar.yaml"),
                        "--prompts", str(rec)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "p.jsonl:1: response_format.pattern" in r.stderr, r.stderr


# -- masks over hand-built trees (the tokenizer only) ---------------------------------------------------
@pytest.fixture(scope="module")
def backend():
    from transformers import AutoTokenizer

    from adaptivespec.models import embedded_folder

    try:
        folder = embedded_folder(verbose=False)
    except AdaptiveSpecError as exc:
        pytest.skip(str(exc))
    return GrammarBackend(AutoTokenizer.from_pretrained(str(folder)), 49152)


def _allowed(rows: torch.Tensor, V: int) -> list[set[int]]:
    bits = ((rows.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(rows.shape[0], -1)[:, :V]
    return [set(torch.nonzero(r).flatten().tolist()) for r in bits]


def _legal_tree(backend):
    """root, then '{' (legal) and 'x' (illegal); '{"' below '{' is illegal ('{' then '{"'), '"' legal."""
    enc = lambda s: backend.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    brace, x, quote, brace_quote = enc("{")[0], enc("x")[0], enc('"')[0], enc('{"')[0]
    tokens = [0, brace, x, quote, brace_quote, enc("name")[0]]
    parents = [-1, 0, 0, 1, 1, 3]
    return tokens, parents


def test_tree_masks_equal_the_matcher_walked_along_each_path(backend):
    fmt = ResponseFormat(type="json_schema", schema=SCHEMA)
    c = backend.constraint(fmt)
    tokens, parents = _legal_tree(backend)
    allowed = _allowed(c.tree_masks(parents, tokens).clone(), backend.vocab_size)
    for i in range(len(tokens)):
        path, u = [], i
        while u > 0:
            path.append(tokens[u])
            u = parents[u]
        m = c.fork()
        legal = all(m.accept_token(t) for t in reversed(path))
        if not legal:  # unreachable (p = 0 at its parent): its row is left unmasked, so no NaN enters the tests
            assert allowed[i] == set(range(backend.vocab_size)), i
            continue
        ref = backend.xgr.allocate_token_bitmask(1, backend.vocab_size)
        m.fill_next_token_bitmask(ref, 0)
        assert allowed[i] == _allowed(ref, backend.vocab_size)[0], i
    assert tokens[2] not in allowed[0] and tokens[1] in allowed[0] and tokens[4] not in allowed[1]
    assert c.forced_string() == "{\"name\": \""  # the walk left the matcher where it was


def _verifiers():
    from adaptivespec.verifiers.margin import MarginParams, MarginVerifier
    from adaptivespec.verifiers.strict import StrictVerifier

    out = {"strict": StrictVerifier(), "margin": MarginVerifier(MarginParams(kappa=0.01, max_promotions=None)),
           "margin-additive": MarginVerifier(MarginParams(form="additive", delta=1.0, max_promotions=None))}
    try:
        from adaptivespec_fly.verifier import FlyParams, FlyVerifier

        out["fly"] = FlyVerifier(FlyParams(window=1, theta=0.0))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("name", list(_verifiers()))
def test_no_verifier_accepts_a_forbidden_token_and_the_bonus_is_legal(backend, name):
    """The target *prefers* the forbidden tokens (argmax at their parents); after the masks, lossy
    rules that promote near misses still never take them."""
    from adaptivespec.tree import make_tree
    from adaptivespec.types import TreeShape

    verifier = _verifiers()[name]
    c = backend.constraint(ResponseFormat(type="json_schema", schema=SCHEMA))
    tokens, parents = _legal_tree(backend)
    n, V = len(tokens), backend.vocab_size
    tree = make_tree(torch.tensor(tokens), torch.tensor(parents), shape=TreeShape(3, 2, n))
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(n, V, generator=gen)
        for i in range(1, n):  # every drafted token the favourite at its parent; illegal ones above all
            logits[parents[i], tokens[i]] = 30.0 if i in (2, 4) else 20.0 + trial % 3
        c.mask_tree(tree, logits)
        res = verifier.verify(tree, logits)
        m = c.fork()
        assert all(m.accept_token(t) for t in res.tokens), (name, res)
        assert 2 not in res.path and 4 not in res.path


def test_tree_sampling_is_not_poisoned_by_an_unreachable_node(backend):
    """Regression (the p = 0.0025 of the first port): an illegal node with a child used to get an
    all-masked row, whose softmax is NaN; ``sibling_accept``'s matrix product spread the NaN to
    every node, so every draft was rejected and the residual draw never gave a drafted token. Here
    the legal child '{' holds almost all the root's mass: it must be accepted (nearly) always."""
    from adaptivespec.sampling import Sampler
    from adaptivespec.tree import make_tree
    from adaptivespec.types import TreeShape
    from adaptivespec.verifiers.strict import StrictVerifier

    c = backend.constraint(ResponseFormat(type="json_schema", schema=SCHEMA))
    tokens, parents = _legal_tree(backend)  # node 2 ('x') is illegal; add a child below it
    enc = lambda s: backend.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    tokens, parents = tokens + [enc("y")[0]], parents + [2]
    n, V = len(tokens), backend.vocab_size
    tree = make_tree(torch.tensor(tokens), torch.tensor(parents), shape=TreeShape(3, 2, n))
    verifier = StrictVerifier()
    verifier.sampler = Sampler(1.0, seed=0)
    logits = torch.zeros(n, V)
    logits[0, tokens[1]] = 20.0  # '{' at the root: p ~ 1 once the grammar masks the rest
    c.mask_tree(tree, logits)
    assert torch.isfinite(verifier.sampler.probs(logits)).all()
    accepted = sum(1 in verifier.verify(tree, logits).path for _ in range(50))
    assert accepted >= 48, accepted


def test_compiled_grammars_are_kept_up_to_the_cache_size_least_recently_used_first(backend, monkeypatch):
    monkeypatch.setattr(backend, "cache_size", 3)
    monkeypatch.setattr(backend, "_compiled", type(backend._compiled)())
    compiles = []
    real = backend.compiler.compile_grammar
    monkeypatch.setattr(backend.compiler, "compile_grammar", lambda g: compiles.append(g) or real(g), raising=False)

    def fmt(i):
        return ResponseFormat(type="json_schema", schema={"type": "object", "properties": {f"k{i}": {"type": "integer"}}})

    first = backend.compile(fmt(0))
    for i in (1, 2, 0, 3):  # 0 used again before 3 comes: 1 is the least recently used
        backend.compile(fmt(i))
    assert len(compiles) == 4 and len(backend._compiled) == 3
    assert backend.compile(fmt(0)) is first and len(compiles) == 4  # kept
    backend.compile(fmt(1))  # dropped: compiled again
    assert len(compiles) == 5 and len(backend._compiled) == 3
    assert backend.compiler.get_cache_size_bytes() == 0  # xgrammar's own (unbounded) cache is off


def test_forced_tokens_follow_the_grammar(backend):
    c = backend.constraint(ResponseFormat(type="json_schema", schema=SCHEMA))
    c.accept(backend.tokenizer.encode('{"name": "Ann", "age": 3', add_special_tokens=False))
    text = c.forced_string()
    assert text == "" or ", ".startswith(text[:2])  # after a number: ',' or more digits
    c.accept(backend.tokenizer.encode(", ", add_special_tokens=False))
    assert c.forced_string().startswith('"status": "')
    for mode in ("canonical", "greedy", "single"):
        ids = c.forced_tokens(mode, 16)
        assert ids and '"status": "'.startswith(backend.tokenizer.decode(ids)[:11]), mode
        m = c.fork()
        assert all(m.accept_token(t) for t in ids)


# -- the real model, float32: constrained speculation == constrained plain decoding ---------------------
def test_allowed_keeps_the_nodes_whose_whole_path_the_grammar_allows(backend):
    """'x' below the root and '{"' below '{' are forbidden: cut; '"' below '{' and 'name' below it are
    allowed: kept; the kept nodes' rows are their own tree_masks rows."""
    from adaptivespec.tree import make_tree

    fmt = ResponseFormat(type="json_schema", schema=SCHEMA)
    c = backend.constraint(fmt)
    tokens, parents = _legal_tree(backend)
    tree = make_tree(torch.tensor(tokens), torch.tensor(parents))
    full = c.tree_masks(parents, tokens).clone()
    keep, rows = c.allowed(tree)
    assert keep.tolist() == [0, 1, 3, 5]  # 'x' (2) and '{"' (4) cut; '"' (3) and 'name' below it (5) kept
    assert torch.equal(rows, full[keep])
    below_x = make_tree(torch.tensor(tokens + [tokens[3]]), torch.tensor(parents + [2]))  # a child of the cut 'x'
    keep2, _ = c.allowed(below_x)
    assert 6 not in keep2.tolist()  # a node below a forbidden one goes with it
    legal = make_tree(torch.tensor([0, tokens[1], tokens[3]]), torch.tensor([-1, 0, 1]))
    none, rows3 = c.allowed(legal)
    assert none is None and rows3.shape[0] == 3  # nothing forbidden: nothing cut, every row returned
    assert c.forced_string() == "{\"name\": \""  # the matcher stayed where it was


def _engine(config: str, *overrides):
    from adaptivespec.decode import Engine

    return Engine(load_config(ROOT / "configs" / config, ["runtime.dtype=float32", *overrides]))


@pytest.fixture(scope="module")
def constrained_ar():
    from adaptivespec.models import encode_prompt

    engine = _engine("ar.yaml", FORMAT)
    ids = encode_prompt(engine.tokenizer, PROMPT)
    return ids, engine.generate_ids(ids, max_new_tokens=64)


def _valid_or_prefix(res, limit: int, backend) -> None:
    """The output validates against the schema, or it stopped at ``limit`` inside a prefix the
    grammar accepts (checked token by token by a fresh matcher)."""
    import jsonschema

    if len(res.token_ids) < limit:
        jsonschema.validate(json.loads(res.text), SCHEMA)
    else:
        m = backend.constraint(ResponseFormat(type="json_schema", schema=SCHEMA)).matcher
        assert all(m.accept_token(t) for t in res.token_ids), res.text


@pytest.mark.model
def test_constrained_ar_output_validates(constrained_ar, backend):
    ids, res = constrained_ar
    _valid_or_prefix(res, 64, backend)
    assert len(res.token_ids) < 64  # the record is complete: the schema check above ran
    assert res.stats["mask_ms_per_step"] > 0


@pytest.mark.model
def test_output_cut_at_max_new_tokens_is_a_valid_prefix(constrained_ar, backend):
    ids, ref = constrained_ar
    res = _engine("hybrid.yaml", FORMAT).generate_ids(ids, max_new_tokens=9)
    assert res.token_ids == ref.token_ids[:9]
    _valid_or_prefix(res, 9, backend)


@pytest.mark.model
@pytest.mark.parametrize("config", ["eagle3.yaml", "hybrid.yaml", "retrieval.yaml", "cost-aware.yaml",
                                    "cost-aware-hybrid.yaml", "adaptivespec-dynamic.yaml", "grammar.yaml"])
def test_constrained_speculation_equals_constrained_ar(config, constrained_ar):
    ids, ref = constrained_ar
    engine = _engine(config, FORMAT)
    res = engine.generate_ids(ids, max_new_tokens=64)
    assert res.token_ids == ref.token_ids
    by = res.stats["accepted_by_source"]
    assert by["grammar"] > 5, by  # the forced keys and punctuation were drafted by the grammar


@pytest.mark.model
@pytest.mark.model
def test_forbidden_drafted_nodes_are_not_verified(constrained_ar, monkeypatch):
    """hybrid drafts without the grammar (its head and retrieval do not know it): the nodes the
    grammar forbids are cut before the verify forward, so no verified row carries a forbidden
    token, some steps verify fewer rows than were drafted, and the output is constrained ar's."""
    from adaptivespec.decode import Engine

    ids, ref = constrained_ar
    engine = _engine("hybrid.yaml", FORMAT, "generation.grammar_draft=false")
    cuts, real = [], Engine.grammar_cut

    def spy(self, tree):
        out, keep = real(self, tree)
        cuts.append((tree.size, out.size))
        return out, keep

    monkeypatch.setattr(Engine, "grammar_cut", spy)
    res = engine.generate_ids(ids, max_new_tokens=64)
    assert res.token_ids == ref.token_ids
    assert any(after < before for before, after in cuts), cuts  # this prompt's drafts do break the schema
    assert [r.tree_size for r in res.records if r.undrafted is None] == [after for _, after in cuts][: len(
        [r for r in res.records if r.undrafted is None])]


@pytest.mark.model
def test_grammar_draft_false_and_free_text_leave_the_grammar_out(constrained_ar):
    ids, ref = constrained_ar
    engine = _engine("hybrid.yaml", FORMAT, "generation.grammar_draft=false")
    res = engine.generate_ids(ids, max_new_tokens=64)
    assert res.token_ids == ref.token_ids and "grammar" not in res.stats["accepted_by_source"]


SAMPLED = ["generation.temperature=1.0", "generation.top_k=5", "generation.response_format=" + json.dumps(
    {"type": "regex", "pattern": "(The|A|One|My|Blue|Red|Green) [a-z ]{1,40}\\."})]


def _first_tokens(config: str, k: int, n: int = 48) -> list[tuple[int, ...]]:
    from adaptivespec.analysis import sampling_check as check

    engine = _engine(config, *SAMPLED)
    ids = engine.encode(check.PROMPT)
    seeds = range(k * check.SEED_STRIDE, k * check.SEED_STRIDE + n)  # disjoint seeds per config
    return [tuple(engine.generate_ids(ids, max_new_tokens=2, seed=s).token_ids) for s in seeds]


@pytest.fixture(scope="module")
def sampled_ar():
    return _first_tokens("ar.yaml", 0)


@pytest.mark.model
@pytest.mark.parametrize("k, config", [(1, "eagle3.yaml"), (2, "hybrid.yaml")])
def test_constrained_sampling_first_tokens_match_constrained_ar(sampled_ar, k, config):
    """The permutation test of adaptivespec.analysis.sampling_check on the first two tokens under a
    regex with a free start: speculative sampling with masks (the grammar source drafting too) is
    distributed as masked plain sampling."""
    from adaptivespec.analysis import sampling_check as check

    spec = _first_tokens(config, k)
    assert len(set(sampled_ar)) > 3 and len(set(spec)) > 3
    result = check.compare(sampled_ar, spec, permutations=400)
    assert min(r["p"] for r in result.values()) > 0.01, result


def test_server_forms_of_a_response_format():
    from adaptivespec.constraints import openai_response_format, sglang_sampling_params
    from adaptivespec.response_format import ResponseFormatError

    fmt = ResponseFormat(type="json_schema", schema=SCHEMA)
    assert openai_response_format(fmt)["json_schema"]["schema"] == SCHEMA
    assert json.loads(sglang_sampling_params(fmt)["json_schema"]) == SCHEMA
    assert sglang_sampling_params(ResponseFormat(type="regex", pattern="[0-9]+")) == {"regex": "[0-9]+"}
    with pytest.raises(ResponseFormatError, match="regex has no OpenAI response_format"):
        openai_response_format(ResponseFormat(type="regex", pattern="a"))


def test_bench_constrains_each_structured_prompt_with_its_own_format():
    """run_one hands a structured prompt's own response format to the contender and grades the
    output against its schema (a fake contender: no model)."""
    from types import SimpleNamespace

    from adaptivespec.evaluation import bench
    from adaptivespec.evaluation.datasets import load_dataset

    problems = load_dataset("structured")
    assert len(problems) == 30 and {p.category for p in problems} == {"extract-bio", "extract-plot", "function-call"}
    seen = []

    class Fake:
        name = "fake"

        def encode(self, text):
            return [1]

        def seed_for(self, index):
            return None

        def generate_ids(self, ids, *, max_new_tokens, on_step=None, seed=None, response_format=None):
            seen.append(response_format)
            text = '{"name": "calculate", "arguments": {"expression": "2+2"}}'
            return SimpleNamespace(text=text, stats={"new_tokens": 5, "wall_seconds": 0.1})

    call = next(p for p in problems if p.category == "function-call")
    rec = bench.run_one(Fake(), call, 0, 16)
    assert isinstance(seen[0], ResponseFormat) and seen[0].schema == call.meta["response_format"]["schema"]
    assert rec.correct is True and rec.config == "fake" and rec.id == call.id
    bio = next(p for p in problems if p.category == "extract-bio")
    assert bench.run_one(Fake(), bio, 1, 16).correct is False  # a tool call is not a person record


# -- serving: SGLang's own constrained decoding gets the format ------------------------------------------
def test_chat_request_passes_the_response_format_through():
    from adaptivespec.sglang.server import chat_request

    msgs = [{"role": "user", "content": "hi"}]
    body = chat_request(msgs, 32, response_format=ResponseFormat(type="json_schema", schema=SCHEMA))
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "response", "schema": SCHEMA}}
    assert body["messages"] == msgs and body["max_tokens"] == 32 and "regex" not in body
    assert chat_request(msgs, 8, response_format=ResponseFormat(type="json_object"))["response_format"] == {"type": "json_object"}
    body = chat_request(msgs, 8, response_format=ResponseFormat(type="regex", pattern="[0-9]+"))
    assert body["regex"] == "[0-9]+" and "response_format" not in body  # SGLang's extra field: OpenAI has no regex
    assert "response_format" not in chat_request(msgs, 8)


def test_serve_makes_the_config_format_sglangs_default(tmp_path):
    from adaptivespec.sglang import serve

    path = tmp_path / "fmt.yaml"
    path.write_text("policy: {name: static, nsteps: 5, topk: 4, ndt: 8}\nverifier: strict\n"
                    "generation: {response_format: {type: regex, pattern: '[0-9]+'}}\n")
    assert serve.sampling_args(path) == ["--preferred-sampling-params", json.dumps({"regex": "[0-9]+"})]
    path.write_text("policy: {name: static, nsteps: 5, topk: 4, ndt: 8}\nverifier: strict\ngeneration:\n"
                    f"  temperature: 0.5\n  response_format: {{type: json_schema, schema: {json.dumps(SCHEMA)}}}\n")
    params = json.loads(serve.sampling_args(path)[1])
    assert params["temperature"] == 0.5 and json.loads(params["json_schema"]) == SCHEMA
    assert serve.sampling_args(path, ["--preferred-sampling-params", "{}"]) == []  # the user's own flag wins
