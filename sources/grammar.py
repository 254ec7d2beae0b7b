"""Source ``grammar``: the response format's forced continuation, drafted for free.

With a response format set (``generation.response_format``), the grammar often allows exactly
one continuation: keys of a JSON schema in order, ``": "``, ``", "``, closing brackets, the rest
of an enum value once its prefix is unique. xgrammar finds that text (jump-forward decoding,
``find_jump_forward_string``); this source proposes it as one chain of tokens below the root,
each node with score ``score`` (default 1: certain unless the tokenization differs), fused into
the tree like any candidate source. With ``model.drafter: null`` it drafts alone.

A forced *string* has many tokenizations, and only the one the target would produce is
accepted. ``tokens`` picks the proposal:

* ``canonical`` (default): the tokenizer's own encoding of the forced string, cut before the
  first token the grammar rejects, and before a last token that is a strict prefix of a longer
  vocabulary token (the target would likely merge it with the free text after it);
* ``greedy``: xgrammar's ``find_jump_forward_tokens`` (longest vocabulary match first);
* ``single``: only tokens that are the grammar's one legal token, one after the other.

Without a response format (``self.constraint`` None) the source proposes nothing. The engine
adds it with default parameters to every speculative config when a response format is set
(``structured_default``); ``--set generation.grammar_draft=false`` turns that off.
"""

from __future__ import annotations

import attrs

import adaptivespec
from adaptivespec.api import CandidateSource, CandidateTrie, int_at_least, number_in, one_of, optional_positive_int


@attrs.frozen(kw_only=True)
class GrammarParams:
    max_depth: int = attrs.field(default=16, validator=int_at_least(1))
    """Longest forced chain proposed (tokens)."""
    tokens: str = attrs.field(default="canonical", validator=one_of("canonical", "greedy", "single"))
    """How the forced string becomes tokens (see the module docstring)."""
    score: float = attrs.field(default=1.0, validator=number_in(0, 1, lo_open=True))
    """Estimated acceptance of every proposed node (1: ranked before every other candidate)."""
    extra_slots: int = attrs.field(default=8, validator=int_at_least(0))
    """Verify slots granted beyond the policy's ndt when the chain is proposed."""
    skip_draft_min: int | None = attrs.field(default=1, validator=optional_positive_int)
    """Skip the head's draft passes when the chain is at least this long (null: never). Default 1:
    where the grammar forces the text, the head's drafts below the root are legal only where they
    repeat the chain, so its passes are mostly wasted (tuning slice of the ``structured`` set,
    ``hybrid``: 1.79x constrained ar with 1, 1.77x with 3, 1.67x never)."""


class GrammarSource(CandidateSource):
    """The grammar's jump-forward continuation as a chain, score ``score`` per node."""

    name = "grammar"
    Params = GrammarParams
    structured_default = True

    def propose(self) -> CandidateTrie | None:
        if self.constraint is None:
            return None
        p = self.params
        ids = self.constraint.forced_tokens(p.tokens, p.max_depth)
        if not ids:
            return None
        n = len(ids)
        return CandidateTrie(tokens=list(ids), parents=[-1, *range(n - 1)], counts=[1] * n,
                             match=[0] * n, scores=[p.score] * n, total=1)

    def extra_slots(self) -> int:
        return self.params.extra_slots

    def skip_draft(self, trie: CandidateTrie) -> bool:
        k = self.params.skip_draft_min
        return k is not None and len(trie) >= k


@adaptivespec.hookimpl
def adaptivespec_register_sources(registry):
    registry.register(GrammarSource)
