"""Verifier ``margin``: AdaptiveSpec's per-step margin rule (lossy).

Urbán, Kwon, Venieris, Mascolo, *Margins, Not Windows: Training-Free Per-Step Lossy Speculative
Decoding* (AdaptiveSpec), section 3, "Margin-based Lossy Verification".
"""

from __future__ import annotations

import math

import attrs
import torch

import adaptivespec
from adaptivespec.api import (
    DraftTree, Verifier, VerifyResult, accepted_path, emit, greedy_ids, greedy_matches, number_in, one_of,
    optional_positive_int,
)

DEFAULT_KAPPA = 0.9
"""Default threshold, chosen by measurement on held-out GSM8K *train* prompts (30 problems, 256
tokens, bf16, EAGLE-3's static shape, ``adaptivespec sweep`` over kappa 0.1-0.95 against the same
config with ``strict``): 0.9 is the knee of the speed / answer-agreement curve (1.07x the strict
config at 67% equal final answers; 0.8 gave 1.06x at 43%, 0.7 1.10x at 27%, 0.1 1.43x at 3%).
No kappa < 1 keeps 95% of the embedded SmolLM2-135M's answers: its GSM8K answers flip under
almost any substitution. The paper tunes kappa per (model, task) cell (its Table 8): re-run the
sweep for your target (README, "Choosing kappa")."""

THRESHOLD_TOL = 1e-6
"""Slack on the threshold comparisons (log-ratio for ``ratio``, probability gap for ``additive``)
so that a ratio equal to kappa up to float32 rounding is promoted whatever the logits' offset."""


@attrs.frozen(kw_only=True)
class MarginParams:
    kappa: float = attrs.field(default=DEFAULT_KAPPA, validator=number_in(0, 1, lo_open=True))
    """Threshold on p_target(drafted) / p_target(top-1) for the ``ratio`` form; lower = more lossy.
    kappa = 1 promotes only exact ties with the top-1."""
    max_promotions: int | None = attrs.field(default=1, validator=optional_positive_int)
    """Promotions allowed per step; 1 is the paper's single-position rule, null = unlimited.
    Below the last allowed promotion the walk is strict."""
    top_k: int | None = attrs.field(default=None, validator=optional_positive_int)
    """If set, a drafted token is promotable only within the target's top-k at its parent
    (ties with the k-th logit count as inside)."""
    form: str = attrs.field(default="ratio", validator=one_of("ratio", "additive"))
    """``ratio``: promote when p(drafted) / p(top-1) >= kappa. ``additive``: promote when
    p(top-1) - p(drafted) <= delta (needs the target's softmax normaliser)."""
    delta: float = attrs.field(default=0.1, validator=number_in(0, 1))
    """Largest probability gap to the top-1 the ``additive`` form promotes (ignored by ``ratio``)."""


class MarginVerifier(Verifier):
    """AdaptiveSpec's margin rule: promote a near-miss drafted token at a mismatch (lossy).

    Walking the draft tree from the root, at every accepted node ``u`` with target top-1 ``t(u)``:

    * **accepted** token: a child whose token equals ``t(u)`` is accepted exactly as in ``strict``;
    * **promoted** token: when no child matches, the child ``c`` with the highest target
      probability is accepted anyway if ``p(c | u) / p(t(u) | u) = exp(z_u[c] - z_u[t(u)]) >= kappa``
      (``form="additive"``: ``p(t(u) | u) - p(c | u) <= delta``; optionally only if ``c`` is in
      the target's top-k at ``u``). At most ``max_promotions`` per step (the paper: one); the
      walk then continues below ``c``;
    * **bonus** token: the target's top-1 at the deepest accepted node, emitted after the path.

    Urbán et al., *Margins, Not Windows* (AdaptiveSpec), sec. 3: a single-position measurement
    of the target distribution, with no lookahead window (unlike FLy) and no trained verifier.
    ``VerifyResult.promoted`` counts promoted tokens on the accepted path.
    """

    name = "margin"
    lossless = False
    Params = MarginParams
    supports_sampling = True

    def __init__(self, params: MarginParams | None = None) -> None:
        super().__init__(params)
        self._log_kappa = math.log(self.params.kappa) - THRESHOLD_TOL

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        if self.sampler is not None and not self.sampler.greedy:
            return self.verify_sampled(tree, logits)
        p = self.params
        n, device = tree.tokens.shape[0], logits.device
        parent = tree.parents.clamp(min=0)  # [n]; the root points at itself and is masked below
        child, par = torch.arange(1, n, device=device), parent[1:]  # drafted nodes, their parents

        # 1. target scores: top-1 per node, and each drafted token's logit at its parent
        top1 = greedy_ids(logits)  # [n]
        z_top = logits.gather(1, top1.unsqueeze(1)).squeeze(1).float()  # [n] z_u[t(u)]
        z_tok = logits[parent, tree.tokens].float()  # [n] z_parent(i)[token(i)]
        match = greedy_matches(tree, top1)  # [n] strict rule; match[0] = True

        # 2. per parent: does a child match, and which child scores best (ties: lowest index)
        has_match = torch.zeros(n, dtype=torch.long, device=device)
        has_match = has_match.scatter_reduce(0, par, match[1:].long(), "amax") > 0  # [n]
        best_z = torch.full((n,), -math.inf, device=device).scatter_reduce(0, par, z_tok[1:], "amax")
        is_top = torch.where(z_tok[1:] == best_z[par], child, n)
        first = torch.full((n,), n, dtype=torch.long, device=device).scatter_reduce(0, par, is_top, "amin")
        best = torch.zeros(n, dtype=torch.bool, device=device)
        best[1:] = first[par] == child  # [n] the one best-scoring child of its parent

        # 3. the margin test for that child
        if p.form == "ratio":  # log p(c)/p(t) = z_c - z_t: no softmax needed
            passes = z_tok - z_top[parent] >= self._log_kappa
        else:  # p(t) - p(c), with p = exp(z - logsumexp(z))
            log_norm = torch.logsumexp(logits.float(), -1)[parent]  # [n]
            gap = torch.exp(z_top[parent] - log_norm) - torch.exp(z_tok - log_norm)
            passes = gap <= p.delta + THRESHOLD_TOL
        if p.top_k is not None:  # inside the target's top-k at the parent
            kth = logits.topk(min(p.top_k, logits.shape[-1]), -1).values[:, -1].float()  # [n]
            passes = passes & (z_tok >= kth[parent])
        passes = passes & (z_tok > -math.inf)  # a token the target rules out (p = 0: masked) is never promoted
        promoted = best & ~match & ~has_match[parent] & passes  # [n]; False at the root

        # 4. eligible nodes form one path; count promotions along it, cap, take the deepest
        n_promoted = tree.ancestors.float() @ promoted.float()  # [n] promotions on root..i
        ok = match | promoted
        if p.max_promotions is not None:
            ok = ok & (n_promoted <= p.max_promotions)
        last = accepted_path(tree, ok)
        return emit(tree, last, top1[last], n_promoted[last].long())

    def verify_sampled(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        """The sampling form (temperature > 0, lossy): margin acceptance, else the lossless test.

        ``p(. | u)`` is the target's sampling distribution (temperature, top-k, top-p, min-p
        applied). Walking from the root, at an accepted node ``u`` while promotions remain
        (``max_promotions``): the child ``c`` with the largest ``p(c | u)`` (ties: lowest index) is
        **accepted outright** (promoted) when ``p(c | u) >= kappa * max_y p(y | u)``
        (``additive``: ``max p - p(c | u) <= delta``; ``top_k``: ``c`` among the k most likely).
        Otherwise, or once the promotions are spent, the children go through the lossless tree
        test of ``strict`` (a child is accepted when it is the target's keyed choice at ``u``);
        when none is, the step ends with that choice (a draw from the residual), and at a leaf
        likewise (a draw from ``p(. | u)``).
        Only tokens with ``p > 0`` are ever accepted, so top-k / top-p / min-p are never violated.
        ``VerifyResult.promoted`` counts the outright acceptances on the path. At temperature 0
        :meth:`verify` keeps the greedy rule exactly.
        """
        p, sampler = self.params, self.sampler
        n, device = tree.tokens.shape[0], logits.device
        parent = tree.parents.clamp(min=0)
        child, par = torch.arange(1, n, device=device), parent[1:]
        probs = sampler.probs(logits)  # [n, V]
        p_max = probs.amax(-1)  # [n]
        p_tok = probs[parent, tree.tokens]  # [n] p(token(i) | parent(i))

        # 1. the outright candidate of each parent: its most likely child, if it passes the margin
        best_p = torch.full((n,), -1.0, device=device).scatter_reduce(0, par, p_tok[1:], "amax")
        is_top = torch.where(p_tok[1:] == best_p[par], child, n)
        first = torch.full((n,), n, dtype=torch.long, device=device).scatter_reduce(0, par, is_top, "amin")
        best = torch.zeros(n, dtype=torch.bool, device=device)
        best[1:] = first[par] == child
        if p.form == "ratio":
            passes = torch.log(p_tok) - torch.log(p_max[parent]) >= self._log_kappa
        else:
            passes = p_max[parent] - p_tok <= p.delta + THRESHOLD_TOL
        if p.top_k is not None:
            kth = probs.topk(min(p.top_k, probs.shape[-1]), -1).values[:, -1]  # [n]
            passes = passes & (p_tok >= kth[parent])
        outright = best & passes & (p_tok > 0)
        outright[0] = False
        has_outright = torch.zeros(n, dtype=torch.long, device=device).scatter_reduce(0, par, outright[1:].long(), "amax") > 0

        # 2. the lossless test everywhere (used where no promotion applies): strict's keyed choices
        choice = sampler.choose(probs, tree.depth)  # [n]
        lossless = greedy_matches(tree, choice)

        # 3. promotions left at each node depend on its path: settle them level by level
        cap = math.inf if p.max_promotions is None else p.max_promotions
        count = torch.zeros(n, device=device)  # promotions on root..i
        for _ in range(tree.shape.nsteps):  # a tree is at most nsteps deep; tensor ops only
            use = has_outright & (count < cap)  # [n] node u promotes one of its children
            promoted = use[parent] & outright
            promoted[0] = False
            count = tree.ancestors.float() @ promoted.float()
        use = has_outright & (count < cap)
        ok = torch.where(use[parent], outright, lossless)
        ok[0] = True
        last = accepted_path(tree, ok)
        n_promoted = (tree.ancestors[last].float() @ (use[parent] & outright).float()).long()
        return emit(tree, last, choice[last], n_promoted)


@adaptivespec.hookimpl
def adaptivespec_register_verifiers(registry):
    registry.register(MarginVerifier)
