"""The retrieval source's index against brute force; its tries, learning, cache and config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from adaptivespec.config import load_config
from adaptivespec.errors import ConfigError
from adaptivespec.sources.ngram import NGramIndex, OutputCache, build_trie
from adaptivespec.plugins import get_plugin_host
from adaptivespec.sources.retrieval import RetrievalParams, RetrievalSource

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def streams():
    rng = random.Random(0)
    yield "random", [rng.randrange(50) for _ in range(400)]
    yield "small-alphabet", [rng.randrange(3) for _ in range(300)]
    phrase = [rng.randrange(1000) for _ in range(23)]
    rep = []
    while len(rep) < 400:  # a phrase repeated with mutations: long matches, diverging continuations
        rep += [t if rng.random() > 0.05 else rng.randrange(1000) for t in phrase]
    yield "repetitive", rep


def brute_match(seq, max_n, min_n):
    """Longest m in [min_n, max_n] with an earlier occurrence of seq's last m tokens; all positions."""
    L = len(seq)
    best, pos = 0, []
    for m in range(1, min(max_n, L) + 1):
        hits = [j for j in range(m, L) if seq[j - m : j] == seq[L - m :]]
        if not hits:
            break
        best, pos = m, hits
    return (best, pos) if best >= min_n else (0, [])


@pytest.mark.parametrize("name,seq", list(streams()), ids=[n for n, _ in streams()])
def test_index_matches_brute_force_at_every_length(name, seq):
    index = NGramIndex(max_n=6)
    rng = random.Random(1)
    i = 0
    while i < len(seq):  # extended in chunks of 1-4 tokens, as the decode loop does
        k = rng.randint(1, 4)
        index.extend(seq[i : i + k])
        i += k
        prefix = seq[:i]
        m, pos = index.occurrences(prefix[-6:], min_n=2, limit=5)
        bm, bpos = brute_match(prefix, 6, 2)
        assert (m, pos) == (bm, bpos[-5:]), i
        for j in pos:  # every proposal is a real continuation of the matched suffix
            assert prefix[j - m : j] == prefix[-m:]
            assert index.continuation(j, 4) == prefix[j : j + 4]


@pytest.mark.parametrize("name,seq", list(streams()), ids=[n for n, _ in streams()])
def test_incremental_index_equals_a_rebuild(name, seq):
    inc = NGramIndex(max_n=5)
    for t in seq:
        inc.extend([t])
    full = NGramIndex(max_n=5)
    full.extend(seq)
    assert inc.tokens == full.tokens and inc.table == full.table
    # and the table holds exactly the n-grams of the stream, each with every following position
    want: dict = {}
    for end in range(1, len(seq) + 1):
        for n in range(1, min(5, end) + 1):
            want.setdefault(tuple(seq[end - n : end]), []).append(end)
    assert inc.table == want


def test_trie_counts_and_pruning_against_brute_force():
    rng = random.Random(2)
    conts = [([rng.randrange(3) for _ in range(rng.randint(1, 5))], rng.randint(1, 4)) for _ in range(40)]
    trie = build_trie(conts, max_nodes=10_000)
    assert trie.total == 40
    paths = trie.paths()
    assert len(set(paths)) == len(paths)  # shared prefixes merged once
    for path, count, match in zip(paths, trie.counts, trie.match):
        through = [(c, m) for c, m in conts if tuple(c[: len(path)]) == path]
        assert count == len(through)
        assert match == max(m for _, m in through)
    assert set(paths) == {tuple(c[:d]) for c, _ in conts for d in range(1, len(c) + 1)}
    small = build_trie(conts, max_nodes=6)
    assert len(small) == 6
    kept = small.paths()
    assert all(p[:-1] in kept or len(p) == 1 for p in kept)  # ancestors kept
    full_counts = dict(zip(paths, trie.counts))
    dropped = [full_counts[p] for p in paths if p not in kept]
    assert min(small.counts) >= max(dropped)  # the most frequent nodes are the ones kept
    assert all(p < i for i, p in enumerate(small.parents))


def test_source_proposes_real_continuations_with_count_probabilities():
    src = RetrievalSource(RetrievalParams(max_ngram=4, min_match=1, max_depth=3, max_nodes=50))
    src.reset([5, 1, 2, 7, 1, 2, 8, 1, 2, 7])
    src.extend([1, 2])  # sequence ends "2 7 1 2": that 4-gram occurred once before, followed by 8 1 2
    trie = src.propose()
    assert trie.paths() == [(8,), (8, 1), (8, 1, 2)] and trie.match == [4, 4, 4]
    src.extend([9])  # "... 2 9": no earlier 9, nothing proposed
    assert src.propose() is None
    src.reset([3, 4, 3, 5, 3, 4, 3])  # "3" is followed by 4, 5, 4 but the longest match wins
    trie = src.propose()
    assert trie.match_length == 3  # (3, 4, 3) occurred once before, followed by 5 3 4
    assert trie.paths()[0] == (5,)
    src.reset([1, 9, 1, 9, 1, 8, 1])
    trie = src.propose()  # "1" -> 9, 9, 8: counts 2 / 1 below the root
    first = {p: s for p, s, par in zip(trie.tokens, trie.scores, trie.parents) if par < 0}
    assert first[9] == pytest.approx(2 / 3 * src.rate(1)) and first[8] == pytest.approx(1 / 3 * src.rate(1))


def test_min_score_drops_unlikely_nodes_and_keeps_ancestors():
    seq = [1, 9, 4, 4, 1, 9, 4, 5, 1, 8, 6, 1]  # "1" -> 9 4 4 / 9 4 5 / 8 6
    full = RetrievalSource(RetrievalParams(max_ngram=4, max_depth=3, max_nodes=50))
    full.reset(seq)
    every = full.propose()
    cut = RetrievalSource(RetrievalParams(max_ngram=4, max_depth=3, max_nodes=50, min_score=0.1))
    cut.reset(seq)
    kept = cut.propose()
    want = {path: s for path, s in zip(every.paths(), every.scores) if s >= 0.1}
    assert dict(zip(kept.paths(), kept.scores)) == pytest.approx(want)
    assert 0 < len(kept) < len(every)
    assert all(p < i for i, p in enumerate(kept.parents))  # topological, every parent kept
    assert set(kept.paths()) == {path[:d] for path in kept.paths() for d in range(1, len(path) + 1)}
    # nothing left: no proposal at all (a plain step)
    none = RetrievalSource(RetrievalParams(max_ngram=4, max_depth=3, min_score=0.9))
    none.reset(seq)
    assert none.propose() is None


def test_acceptance_rates_are_learned_per_match_length():
    src = RetrievalSource(RetrievalParams(max_ngram=4, prior=0.5))
    src.reset([1, 2, 3, 4, 1, 2])
    trie = src.propose()  # match (1, 2) of length 2, proposes 3 4 1 2
    assert src.rate(2) == 0.5
    src.observe(trie, [3, 4, 7])  # two levels accepted (effective lengths 2, 3), a miss at length 4
    assert (src.hits[2], src.trials[2], src.hits[3], src.trials[3], src.hits[4], src.trials[4]) == (1, 1, 1, 1, 0, 1)
    assert src.rate(2) == pytest.approx(2 / 3) and src.rate(4) == pytest.approx(1 / 3)
    again = src.propose()
    assert again.scores[0] == pytest.approx(src.rate(2))
    assert again.scores[1] == pytest.approx(src.rate(2) * src.rate(3))


def test_output_cache_is_bounded_and_skips_the_prompts_own_outputs():
    cache = OutputCache(max_tokens=10, max_n=3)
    cache.add(prompt_key=1, output=[1, 2, 3, 4])
    cache.add(prompt_key=2, output=[1, 2, 5, 6])
    m, pos = cache.occurrences([9, 1, 2], prompt_key=3, min_n=1, limit=8)
    assert m == 2 and sorted(cache.index.continuation(j, 2) for j in pos) == [[3, 4], [5, 6]]
    m, pos = cache.occurrences([9, 1, 2], prompt_key=1, min_n=1, limit=8)
    assert [cache.index.continuation(j, 2) for j in pos] == [[5, 6]]  # prompt 1's own answer skipped
    m, pos = cache.occurrences([4], prompt_key=3, min_n=1, limit=8)
    assert pos == []  # 4 ended an output: continuations never cross into the next one
    cache.add(prompt_key=3, output=[7, 8, 9])
    assert sum(len(ids) for _, ids in cache.entries) <= 10 and [k for k, _ in cache.entries] == [2, 3]
    assert cache.occurrences([1, 2], prompt_key=9, min_n=1, limit=8)[0] == 2
    assert cache.occurrences([3], prompt_key=9, min_n=1, limit=8) == (0, [])  # prompt 1's output evicted


def test_source_with_cache_proposes_from_earlier_outputs_of_other_prompts_only():
    src = RetrievalSource(RetrievalParams(cache_tokens=100))
    src.reset([40, 41])
    src.extend([10, 11, 12, 13])
    src.finish([10, 11, 12, 13])
    src.reset([50, 51])
    src.extend([10, 11])
    assert src.propose().paths()[:2] == [(12,), (12, 13)]
    src.reset([40, 41])  # the same prompt again: its own earlier answer is not a source
    src.extend([10, 11])
    assert src.propose() is None
    src.forget()
    src.reset([50, 51])
    src.extend([10, 11])
    assert src.propose() is None
    off = RetrievalSource()  # off by default
    off.reset([40, 41]), off.extend([10, 11, 12]), off.finish([10, 11, 12])
    off.reset([50]), off.extend([10, 11])
    assert off.propose() is None


def test_sources_config_is_validated_strictly(tmp_path):
    ok = load_config(None, ["sources=[{name: retrieval, max_depth: 4}]"])
    assert [s.name for s in ok.sources] == ["retrieval"] and ok.sources[0].params.max_depth == 4
    assert ok.to_dict()["sources"] == [{"name": "retrieval", **{k: getattr(ok.sources[0].params, k) for k in ok.to_dict()["sources"][0] if k != "name"}}]
    assert "sources" not in load_config(None).to_dict()  # absent when none: old run folders still resume
    assert not load_config(None, ["model.drafter=null", "sources=[retrieval]"]).autoregressive
    bad = {
        "sources=[{name: nope}]": "sources[0].name: unknown source 'nope'",
        "sources=[{name: retrieval, max_depth: 0}]": "sources[0].max_depth: expected a positive integer, got 0",
        "sources=[{name: retrieval, depth: 3}]": "sources[0].depth: unknown key",
        "sources=[{name: retrieval, prior: 1.5}]": "sources[0].prior: expected a number in (0, 1), got 1.5",
        "sources=[retrieval, retrieval]": "sources[1].name: source 'retrieval' is listed twice",
        "sources=3": "sources: expected a list of candidate sources, got 3",
        "sources=[{name: retrieval, min_match: 9}]": "sources[0]",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError) as exc:
            load_config(None, [override])
        assert message in str(exc.value), (override, str(exc.value))


def test_set_reaches_into_the_sources_list():
    c = load_config(CONFIGS / "hybrid.yaml", ["sources.0.extra_slots=3", "sources.0.skip_draft_match=4"])
    assert (c.sources[0].params.extra_slots, c.sources[0].params.skip_draft_match) == (3, 4)
    with pytest.raises(ConfigError, match=r"--set: sources.1.max_depth: sources has no mapping at index 1 \(1 items\)"):
        load_config(CONFIGS / "hybrid.yaml", ["sources.1.max_depth=3"])


def test_retrieval_is_a_registered_source():
    entry = get_plugin_host().sources.get("retrieval")
    assert entry.cls is RetrievalSource and entry.provider == "adaptivespec"


def test_a_third_party_source_registers_through_the_hook_and_configures_from_yaml():
    import attrs

    import adaptivespec
    from adaptivespec.config import build_config
    from adaptivespec.plugins import make_plugin_host
    from adaptivespec.strategies import CandidateSource

    @attrs.frozen(kw_only=True)
    class CorpusParams:
        documents: int = 1

    class Corpus(CandidateSource):
        """Continuations from a document corpus (test plugin)."""

        name = "corpus"
        Params = CorpusParams

    class Plugin:
        @staticmethod
        @adaptivespec.hookimpl
        def adaptivespec_register_sources(registry):
            registry.register(Corpus)

    host = make_plugin_host([Plugin])
    assert host.registry("source").get("corpus").cls is Corpus
    assert {("source", "corpus"), ("source", "retrieval")} <= {(e.kind, e.name) for e in host.entries()}
    config = build_config({"sources": [{"name": "corpus", "documents": 3}, "retrieval"]}, "x.yaml", host)
    assert [s.name for s in config.sources] == ["corpus", "retrieval"] and config.sources[0].params.documents == 3
    with pytest.raises(ConfigError, match=r"x.yaml: sources\[0\].documents: expected an integer, got 'many'"):
        build_config({"sources": [{"name": "corpus", "documents": "many"}]}, "x.yaml", host)
