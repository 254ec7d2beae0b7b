"""Verifier ``fly``: FLy's entropy-gated deferred-window acceptance (lossy).

Li, Xu, Li, Yang, Xu, Yin, Li, Ngai, Barsoum, *Training-Free Loosely Speculative Decoding:
Accepting Semantically Correct Drafts Beyond Exact Match* (FLy), ICLR 2026, arXiv:2511.22972.
Read against the authors' code (AMD-AGI/FLy, ``fly/models/FLy.py``: ``calculate_topk_entropy``,
``rej_by_entropy``, the window test in ``generate_chunks`` and ``verify_tree_paths``) and vLLM's
``rejection_sample_method="fly"`` (``vllm/v1/spec_decode/fly.py``).
"""

from __future__ import annotations

import attrs
import torch

from adaptivespec.api import (
    DraftTree, Verifier, VerifyResult, accepted_path, emit, greedy_matches, number_in, positive_int,
)


@attrs.frozen(kw_only=True)
class FlyParams:
    window: int = attrs.field(default=6, validator=positive_int)
    """W: a mismatch is kept only if the W - 1 drafted tokens below it match the target exactly
    and the tree reaches at least W levels below it (the paper and its code: 6)."""
    theta: float = attrs.field(default=0.3, validator=number_in(0, None))
    """Entropy gate: keep a mismatch only where the target's top-k entropy (nats) is >= theta
    (the paper: 0.3); 0 turns the gate off."""
    entropy_topk: int = attrs.field(default=3, validator=positive_int)
    """How many of the target's largest probabilities enter the entropy (the paper: 3)."""


def topk_entropy(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[n] ``-sum p_i ln p_i`` over the k largest *full-softmax* probabilities of each row.

    Not renormalised over the top k, as in FLy's ``calculate_topk_entropy`` and vLLM's
    ``compute_fly_entropy``; zero-probability terms count 0. ``logits``: [n, V].
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1).values  # [n, k]
    terms = torch.where(top > -torch.inf, top.exp() * top, torch.zeros_like(top))
    return -terms.sum(-1)


def strict_run_below(tree: DraftTree, match: torch.Tensor) -> torch.Tensor:
    """[n] Length of the longest chain of exact matches hanging below each node.

    ``run[c] = max depth(x) - depth(c)`` over descendants ``x`` of ``c`` (``c`` itself included)
    such that every node strictly below ``c`` down to ``x`` matches: the best strictly-matching
    path below ``c``. From the ancestor matrix, no loop: with ``m[x]`` the number of mismatches
    on root..x, such an ``x`` is a descendant with ``m[x] == m[c]``.
    """
    anc = tree.ancestors  # [n, n] anc[x, c]: c is x or an ancestor of x
    m = anc.float() @ (~match).float()  # [n] mismatches on the root path, inclusive
    below = anc.T & (m.unsqueeze(0) == m.unsqueeze(1))  # [c, x]
    return torch.where(below, tree.depth.unsqueeze(0), -1).amax(-1) - tree.depth


class FlyVerifier(Verifier):
    """FLy: keep a mismatched draft token when the target re-synchronises right after it (lossy).

    Definitions (per drafted node ``c`` with parent ``u``; ``t(u)`` is the target's top-1 at ``u``):

    * **accepted** (exact) token: ``token(c) == t(u)`` and ``u`` accepted, as in ``strict``;
    * **promoted** token: ``token(c) != t(u)``, kept anyway when all of these hold:

      1. *mismatch point*: no child of ``u`` matches ``t(u)`` (where strict verification stops);
      2. *entropy gate*: ``H_k(u) >= theta``, ``H_k`` the entropy of the target's k largest
         probabilities at ``u`` (full softmax, not renormalised; natural log; k = 3);
      3. *deferred window*: the W - 1 nodes below ``c`` on the best strictly-matching path are
         exact matches (``strict_run_below(c) >= W - 1``): the window of W positions starting at
         the mismatch reads ``[mismatch, match x (W-1)]``;
      4. *end of the draft*: ``depth(c) + W <= D``, D the deepest node of the tree: the last W
         levels keep the strict decision, as the authors' code resets the last W positions of a
         draft to strict (so a tree at most W levels deep is verified strictly);
      5. the target gives ``token(c)`` a nonzero probability (vLLM's check);

    * **bonus** token: the target's top-1 at the deepest accepted node, after the path.

    The accepted path is the deepest node whose root path is all accepted or promoted; among
    promoted siblings the deepest branch wins (ties: lowest index), as the authors' tree mode
    keeps the longest accepted path. Several promotions per step are allowed (each at least W
    levels apart, since the W - 1 nodes below one must match): the authors' code and vLLM's
    promote every position whose window passes. ``VerifyResult.promoted`` counts them.

    Choices, with the sources they follow or leave:

    * Window counting follows the authors' code (W - 1 exact matches below, W levels of draft
      below). vLLM's kernel requires W exact matches below; with W = 6 both need the draft to
      reach six levels below the mismatch, so on shallow EAGLE-3 trees FLy rarely acts.
    * On a tree the authors apply the window per root-to-leaf path and take the longest path,
      so a mismatched child can win over a matching sibling; here a mismatch is only considered
      where no sibling matches (condition 1), as FLy defers a *rejection*. Their tree mode also
      omits the entropy gate; here it applies everywhere, as in the chain mode the paper uses.
    * theta = 0 disables the gate (the authors' code disables it for theta <= 0.01).
    """

    name = "fly"
    lossless = False
    Params = FlyParams

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        p = self.params
        n, device = tree.tokens.shape[0], logits.device
        parent = tree.parents.clamp(min=0)  # [n]; the root points at itself and is masked below

        # 1. exact matches, and where strict verification stops (no child matches)
        top1 = logits.argmax(-1)  # [n]
        match = greedy_matches(tree, top1)  # [n]; match[0] = True
        has_match = torch.zeros(n, dtype=torch.long, device=device)
        has_match = has_match.scatter_reduce(0, parent[1:], match[1:].long(), "amax") > 0  # [n]

        # 2. the three FLy tests: entropy at the parent, the window below, room below
        entropy = topk_entropy(logits, p.entropy_topk)  # [n] at each node, over its children
        run = strict_run_below(tree, match)  # [n]
        room = tree.depth + p.window <= tree.depth.max()  # [n] not in the last W levels
        nonzero = logits[parent, tree.tokens] > -torch.inf  # [n] p_target(token(c) | u) > 0
        promoted = (
            ~match & ~has_match[parent] & (entropy[parent] >= p.theta)
            & (run >= p.window - 1) & room & nonzero
        )
        promoted[0] = False

        # 3. the deepest node reachable through accepted or promoted nodes
        last = accepted_path(tree, match | promoted)
        n_promoted = (tree.ancestors[last].float() @ promoted.float()).long()
        return emit(tree, last, top1[last], n_promoted)
