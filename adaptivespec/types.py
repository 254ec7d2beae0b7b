"""Values exchanged between the decode loop and the strategies.

Conventions used throughout (vLLM-style shape comments):

* A *draft tree* has ``n`` nodes. Node 0 is the **root**: the last token already chosen (by the
  target) but not yet run through the target. Nodes 1..n-1 are drafted tokens. Nodes are stored in
  topological order: a parent always has a smaller index than its children.
* *Accepted* tokens are drafted nodes on the path the verifier keeps; *promoted* tokens are the
  accepted ones that did not match the target's greedy choice (lossy verifiers only); the *bonus*
  token is the target's own choice after the last accepted node. A step therefore emits
  ``accepted + 1`` tokens.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=False, order=True)
class TreeShape:
    """One EAGLE tree shape: ``(nsteps, topk, ndt)``.

    ``nsteps`` is the draft depth (levels below the root), ``topk`` the branching (children proposed
    per expanded node and beam width), ``ndt`` the number of tokens verified, root included, so
    ``ndt - 1`` drafted nodes are kept. ``(7, 1, 8)`` is a chain of 7 drafted tokens.
    """

    nsteps: int = attrs.field(validator=_positive)
    """Draft depth: levels of drafted tokens below the root."""
    topk: int = attrs.field(validator=_positive)
    """Branching: children proposed per expanded node, and the beam width of each level."""
    ndt: int = attrs.field(validator=_positive)
    """Tokens verified by the target per step, the root included."""

    def __attrs_post_init__(self) -> None:
        if self.ndt < 2:
            raise ValueError(f"ndt must be >= 2 (the root and one drafted token), got {self.ndt}")
        if self.ndt - 1 > self.max_nodes:
            raise ValueError(
                f"ndt - 1 = {self.ndt - 1} drafted nodes cannot be kept from a tree of "
                f"nsteps={self.nsteps}, topk={self.topk} (at most {self.max_nodes} candidates)"
            )

    @property
    def max_nodes(self) -> int:
        """Candidates drafted: topk at depth 1, topk*topk at every further depth."""
        return self.topk + (self.nsteps - 1) * self.topk * self.topk

    def __str__(self) -> str:
        return f"({self.nsteps},{self.topk},{self.ndt})"


@attrs.define(eq=False, kw_only=True)
class DraftTree:
    """A drafted token tree ready for one target forward.

    All tensors live on the runtime's device; ``n`` = number of nodes including the root.
    """

    tokens: torch.Tensor  # [n] int64, target-vocabulary ids; tokens[0] is the root
    parents: torch.Tensor  # [n] int64, parents[0] == -1
    depth: torch.Tensor  # [n] int64, depth[0] == 0
    ancestors: torch.Tensor  # [n, n] bool, ancestors[i, j]: j is i or an ancestor of i
    draft_logp: torch.Tensor  # [n] float32, cumulative draft log-probability (root 0)
    shape: TreeShape

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@attrs.frozen(kw_only=True)
class VerifyResult:
    """What a verifier keeps of a tree."""

    path: list[int]
    """Node indices of the accepted path, starting with the root (0); len = accepted + 1."""
    tokens: list[int]
    """Tokens emitted by this step: the accepted drafted tokens, then the bonus token."""
    promoted: int = 0
    """How many accepted tokens differ from the target's greedy choice (0 for lossless verifiers)."""

    @property
    def accepted(self) -> int:
        return len(self.path) - 1


@attrs.frozen(kw_only=True)
class StepSignals:
    """What a tree policy may read before it picks the shape of a step."""

    step: int
    """Index of this step in the current generation (0 = first speculative step)."""
    draft_top1_prob: float
    """Draft model's top-1 probability for the first token below the root at this step."""
    last_accepted: int
    """Drafted tokens accepted at the previous step (-1 before the first step)."""
    context: int = 0
    """Positions already in the target's cache (prompt + accepted tokens): what every verified row
    attends over, so what a row costs grows with it. 0 where the caller does not know."""
    draft_entropy: float = 0.0
    """Entropy (nats) of the draft's distribution of the first token below the root (read with
    ``draft_top1_prob`` in one host sync; 0 where the caller does not know)."""
    draft_top4_prob: float = 0.0
    """Draft probability of the four most likely first tokens together (same sync; 0: unknown)."""
    source_match: int = 0
    """Longest suffix match any candidate source's proposal came from (0: no proposal)."""
    source_nodes: int = 0
    """Nodes the candidate sources propose this step, all sources together (0: none)."""
    source_top: float = 0.0
    """Best score a source gave a child of the root (its estimated acceptance; 0: none)."""
    batch_size: int = 1
    """Requests decoding in this step, this one included (1: alone; ``serve --parallel`` batches
    several, and their tree rows share one target forward)."""
    row_budget: int = 0
    """Verify rows beyond its root this request got at the previous step under the batch's row
    budget (``batch.row_budget: goodput``), what it may expect now; 0: no budget (the policy's
    shape is verified as drafted)."""


@attrs.frozen(kw_only=True)
class StepRecord:
    """The record of one decode step, handed to ``adaptivespec_step`` observers and traces."""

    step: int
    """Index of the step in this generation (prefill not counted)."""
    shape: TreeShape | None
    """Tree shape used (None for autoregressive steps)."""
    tree_size: int
    """Nodes verified by the target, root included (1 for autoregressive steps)."""
    accepted: int
    """Drafted tokens accepted (promoted ones included)."""
    promoted: int
    """Accepted tokens that differ from the target's greedy choice."""
    new_tokens: int
    """Tokens this step added to the output (accepted + 1, less when EOS or the limit cut it)."""
    draft_ms: float
    """Wall time spent drafting the tree."""
    verify_ms: float
    """Wall time of the target forward over the tree."""
    other_ms: float
    """Verification rule (with structured output, the grammar masks before it), cache compaction,
    drafter extension and bookkeeping."""
    signals: StepSignals | None = None
    """Signals the policy read before choosing ``shape``."""
    policy_state: dict[str, Any] = attrs.field(factory=dict)
    """What the policy reports about its decision (e.g. DCS and its inputs)."""
    accepted_by_source: dict[str, int] = attrs.field(factory=dict)
    """Accepted tokens per proposer: ``head`` (the drafter) and each candidate source by name; a
    node proposed by two counts for both. Empty for plain decoding steps."""
    undrafted: str | None = None
    """Why the step drafted nothing: ``"autoregressive"`` (the config never drafts), ``"load"`` (a
    batch's row budget ran a plain step), ``"policy"`` (the policy asked for a plain step:
    ``TreePolicy.plain_next``); None for a drafted step (a tree the policy cut to its
    root included). Every target forward after the prefill has a record, so a generation's
    records' ``new_tokens`` add up to its tokens less the prefill's first one."""

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        d["shape"] = None if self.shape is None else [self.shape.nsteps, self.shape.topk, self.shape.ndt]
        d["signals"] = None if self.signals is None else attrs.asdict(self.signals)
        return d


@attrs.define(eq=False, kw_only=True)
class CandidateTrie:
    """Continuations a candidate source proposes below the root (the last token of the sequence),
    as a small trie: what every source returns and :func:`~adaptivespec.fusion.fuse` merges with
    the head's tree.

    Nodes are in topological order (``parents[i] < i``; ``-1``: a child of the root). ``scores[i]``:
    estimated probability that the target accepts the path to node i (the source fills it; fusion
    ranks by it, and a score should not exceed its parent's). ``counts[i]``: occurrences (or any
    evidence count) whose continuation passes through node i; ``match[i]``: the longest suffix match
    those occurrences came from (0 for a source that does not match suffixes).
    """

    tokens: list[int] = attrs.field(factory=list)
    parents: list[int] = attrs.field(factory=list)
    counts: list[int] = attrs.field(factory=list)
    match: list[int] = attrs.field(factory=list)
    scores: list[float] = attrs.field(factory=list)
    total: int = 0
    """Occurrences the trie was built from (the root's count)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, *, count: int = 1, match: int = 0) -> int:
        """Append a node holding ``token`` below ``parent`` (-1: the root); returns its index."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent: expected -1 or an existing node (< {len(self.tokens)}), got {parent}")
        self.tokens.append(token), self.parents.append(parent), self.scores.append(score)
        self.counts.append(count), self.match.append(match)
        return len(self.tokens) - 1

    @property
    def match_length(self) -> int:
        """Longest suffix match any proposal came from (0: the trie is empty)."""
        return max(self.match, default=0)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def paths(self) -> list[tuple[int, ...]]:
        """The token path from the root to every node."""
        out: list[tuple[int, ...]] = []
        for t, p in zip(self.tokens, self.parents):
            out.append((t,) if p < 0 else out[p] + (t,))
        return out

    def pruned(self, min_score: float) -> "CandidateTrie":
        """The nodes scoring at least ``min_score`` (scores never grow down a path, so the kept
        nodes are closed under ancestors; a node whose parent is dropped is dropped too)."""
        remap: dict[int, int] = {-1: -1}
        out = CandidateTrie(total=self.total)
        for i, (t, p, c, m, s) in enumerate(zip(self.tokens, self.parents, self.counts, self.match, self.scores)):
            if s >= min_score and p in remap:
                remap[i] = len(out.tokens)
                out.tokens.append(t)
                out.parents.append(remap[p])
                out.counts.append(c)
                out.match.append(m)
                out.scores.append(s)
        return out

    def child(self, parent: int, token: int) -> int:
        """Index of ``parent``'s child holding ``token`` (``parent=-1``: the root), or -1."""
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if p == parent and t == token:
                return i
        return -1
