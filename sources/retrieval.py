"""Source ``retrieval``: continuations copied from the prompt, the text so far and earlier outputs.

The sequence (prompt + generated tokens) is kept in an :class:`~adaptivespec.sources.ngram.NGramIndex`
extended with each step's tokens. Before a step, the longest tail of the sequence that occurred
before (``min_match <= m <= max_ngram`` tokens) gives up to ``max_occurrences`` earlier positions;
what followed them (``max_depth`` tokens) is merged into a trie of at most ``max_nodes`` nodes.

Scores (estimated acceptance of a node's path) are learned online: for every match length
``m`` the source counts, over the steps it proposed, how often the target's next token was one of
the trie's children at that level (a node ``d`` levels down came from an effective match of
``m + d - 1`` tokens). A node's score is the product along its path of that rate and the share of
the parent's occurrences that continue with the node's token.

With ``cache_tokens > 0`` earlier outputs of the same engine (up to that many tokens) are indexed
too; a prompt never retrieves from its own earlier outputs.
"""

from __future__ import annotations

import attrs

import adaptivespec
from adaptivespec.api import (
    CandidateSource, CandidateTrie, int_at_least, number_in, optional_positive_int, positive_int,
)
from adaptivespec.sources.ngram import NGramIndex, OutputCache, build_trie

BUCKETS = 32
"""Effective match lengths tracked separately (longer ones share the last bucket)."""


@attrs.frozen(kw_only=True)
class RetrievalParams:
    max_ngram: int = attrs.field(default=8, validator=positive_int)
    """Longest suffix of the sequence matched (longer matches count as this long)."""
    min_match: int = attrs.field(default=1, validator=positive_int)
    """Shortest suffix match that proposes anything."""
    max_depth: int = attrs.field(default=8, validator=positive_int)
    """Tokens proposed after each occurrence (the trie's depth)."""
    max_nodes: int = attrs.field(default=16, validator=positive_int)
    """Nodes in the proposed trie (the most frequent kept)."""
    max_occurrences: int = attrs.field(default=8, validator=positive_int)
    """Most recent earlier occurrences of the matched suffix merged into the trie."""
    extra_slots: int = attrs.field(default=0, validator=int_at_least(0))
    """Verify slots granted beyond the policy's ndt when there are proposals (the shape bank's
    mask buffers are sized for them)."""
    skip_draft_match: int | None = attrs.field(default=None, validator=optional_positive_int)
    """Skip the head's draft passes when the match is at least this long (null: never)."""
    cache_tokens: int = attrs.field(default=0, validator=int_at_least(0))
    """Tokens of earlier outputs kept for later prompts of the same engine (0: off)."""
    min_score: float = attrs.field(default=0.0, validator=number_in(0, 1, hi_open=True))
    """Proposed nodes whose estimated acceptance is below this are dropped (0: keep all; a node's
    verify slot costs about ``per_verified_token / (step time / tokens per step)`` of a token)."""
    prior: float = attrs.field(default=0.5, validator=number_in(0, 1, lo_open=True, hi_open=True))
    """Acceptance rate assumed for a match length before any step measured it."""

    def __attrs_post_init__(self) -> None:
        if self.min_match > self.max_ngram:
            raise ValueError(f"min_match: expected at most max_ngram = {self.max_ngram}, got {self.min_match}")


class RetrievalSource(CandidateSource):
    """Suffix-matched continuations from the prompt, the output so far and (opt-in) earlier outputs."""

    name = "retrieval"
    Params = RetrievalParams

    def __init__(self, params: RetrievalParams | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.index = NGramIndex(p.max_ngram)
        self.cache = OutputCache(p.cache_tokens, p.max_ngram) if p.cache_tokens else None
        self.hits = [0] * (BUCKETS + 1)  # per effective match length
        self.trials = [0] * (BUCKETS + 1)
        self._prompt_key = 0

    # -- sequence ---------------------------------------------------------------------------
    def reset(self, prompt_ids: list[int]) -> None:
        self.index = NGramIndex(self.params.max_ngram)
        self.index.extend(prompt_ids)
        self._prompt_key = hash(tuple(prompt_ids))

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def finish(self, output_ids: list[int]) -> None:
        if self.cache is not None:
            self.cache.add(self._prompt_key, output_ids)

    def forget(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    # -- proposals --------------------------------------------------------------------------
    def rate(self, m: int) -> float:
        """Learned probability that the target continues a match of ``m`` tokens like the trie."""
        b = min(m, BUCKETS)
        return (self.hits[b] + 2 * self.params.prior) / (self.trials[b] + 2)

    def propose(self) -> CandidateTrie | None:
        p, seq = self.params, self.index.tokens
        suffix = seq[-p.max_ngram :]
        m, pos = self.index.occurrences(suffix, p.min_match, p.max_occurrences)
        conts = [(self.index.continuation(j, p.max_depth), m) for j in pos]
        if self.cache is not None:
            cm, cpos = self.cache.occurrences(suffix, self._prompt_key, p.min_match, p.max_occurrences)
            if cm >= m:
                conts += [(self.cache.index.continuation(j, p.max_depth), cm) for j in cpos]
        if not conts:
            return None
        trie = build_trie(conts, p.max_nodes)
        if not len(trie):
            return None
        score, depth = trie.scores, trie.depths()
        for i, (par, c) in enumerate(zip(trie.parents, trie.counts)):
            share = c / (trie.total if par < 0 else trie.counts[par])
            score[i] = (1.0 if par < 0 else score[par]) * share * self.rate(trie.match[i] + depth[i] - 1)
        if p.min_score > 0:
            trie = trie.pruned(p.min_score)
        return trie if len(trie) else None

    def observe(self, trie: CandidateTrie, tokens: list[int]) -> None:
        """Walk the target's tokens down the trie: one trial per level that had children."""
        node, d = -1, 1
        for t in tokens:
            kids = [i for i, par in enumerate(trie.parents) if par == node]
            if not kids:
                return
            hit = next((i for i in kids if trie.tokens[i] == t), -1)
            ref = hit if hit >= 0 else max(kids, key=lambda i: trie.counts[i])
            b = min(trie.match[ref] + d - 1, BUCKETS)
            self.trials[b] += 1
            if hit < 0:
                return
            self.hits[b] += 1
            node, d = hit, d + 1

    # -- fusion settings ----------------------------------------------------------------------
    def extra_slots(self) -> int:
        return self.params.extra_slots

    def skip_draft(self, trie: CandidateTrie) -> bool:
        k = self.params.skip_draft_match
        return k is not None and trie.match_length >= k


@adaptivespec.hookimpl
def adaptivespec_register_sources(registry):
    registry.register(RetrievalSource)
