"""The tree policy's say in fusion: the ranking it sees and the two rules it may override.

:func:`adaptivespec.fusion.fuse` merges the head's tree and the candidate sources' tries into one
verify tree; a policy ranks the head's nodes (:meth:`FusionRules.fusion_scores`) and sizes the
fused tree (:meth:`FusionRules.fusion_size`, given a :class:`FusionRanking`). Values and defaults
only, so that the strategy base classes depend on nothing of the fusion itself.
"""

from __future__ import annotations

from typing import Any

import attrs

from adaptivespec.types import DraftTree


@attrs.frozen(kw_only=True)
class FusionRanking:
    """The fused candidates, best first, as a policy's :meth:`fusion_size` sees them.

    The fused tree verifies the first ``k`` beside the root, in increasing ``index`` order (parents
    before children; the head's nodes first, in the head's order)."""

    scores: list[float]
    """Each candidate's score, capped by its parent's (non-increasing along the ranking)."""
    index: list[int]
    """Candidate ids, topological (a parent's id is smaller than its children's)."""
    first_level: list[bool]
    """Whether the candidate is a child of the root."""
    head_index: list[int]
    """The candidate's node in the head's tree, or -1 (proposed by candidate sources only)."""
    budget: int
    """Most nodes the fused tree may have, the root included."""


class FusionRules:
    """The tree policy's say in fusion (defaults: fusion's own ranking and budget).

    :class:`~adaptivespec.strategies.TreePolicy` inherits these defaults; a policy overrides them
    to rank the head's nodes on its own scale and to size the fused tree (``cost_aware`` does).
    :func:`~adaptivespec.fusion.fuse` also takes any object with some of these methods (a missing one: the default)."""

    def fusion_scores(self, head: DraftTree) -> Any:
        """Scores of the head tree's nodes when it is fused with candidate tries, on their scale
        (estimated acceptance of each node's path; one per node, the root's ignored); None: the
        head's own path probability ``exp(draft_logp)``."""
        return None

    def fusion_source_scores(self, source: str, trie: Any) -> Any:
        """Scores of candidate source ``source``'s trie (a :class:`~adaptivespec.types.CandidateTrie`)
        on the policy's scale (one per node, in the trie's order); None: the source's own scores."""
        return None

    def fusion_size(self, ranking: FusionRanking) -> int:
        """How many of the fused candidates (a :class:`FusionRanking`, best first) are verified
        beside the root; at most ``ranking.budget - 1`` (the default)."""
        return ranking.budget - 1
