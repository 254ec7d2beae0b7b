"""Sampling at temperature > 0: the target's transformed distribution, seeded draws, and the
lossless tree test that speculative verifiers share.

**Distribution.** :func:`warp` applies transformers' ``generate(do_sample=True)`` logits warpers in
its order (``_get_logits_processor``, transformers 5.x): temperature, then top-k (ties with the
k-th logit kept), then top-p (ascending sort, drop while the cumulative mass is <= 1 - top_p,
always keep the most likely), then min-p (drop below ``min_p`` times the largest probability).
``generation.top_k: null`` means no top-k, where ``generate`` would default to 50.

**Draws.** One :class:`Sampler` per engine (per lane of a batch), on the runtime's device,
reseeded before every generation (record i of a run: ``generation.seed + i``).

**A seed holds.** The token the target emits at sequence position ``q`` is the inverse CDF of its
sampling distribution there at one uniform ``u(seed, q)``, a hash of the seed and the position
(:func:`keyed_uniforms`), never a draw in step order: :meth:`Sampler.choose`. The engine tells the
sampler where the tokens it picks sit (:meth:`Sampler.at`) before every pick and verify. So a
request's tokens are a function of its seed and the target's distributions along its own text:
plain decoding, any verify tree (whatever the policy or a batch's row budget chose), one request or
a batch give the same text for a seed, wherever the target's logits are the same (float32, the
int8 target; in bfloat16 a row's rounding can move a token by a hair). Each token is still an exact
draw from ``p`` (``u`` is uniform and independent across positions), and the tree test built on it
accepts a drafted child exactly when its token is the target's keyed choice at the parent:
accepted with probability ``p(child)``, what the sequential residual test gives deterministic
drafts (``strict``'s docstring), so acceptance costs nothing in expectation.

Without a position (a verifier driven outside the engine, the distribution tests) the uniforms come
from the sampler's generator in order, fresh at every call. Categorical draws of other weights
(:meth:`Sampler.draw`, the plugin API's residual test) are the exponential race ``argmax(p / E)``,
``E ~ Exp(1)`` (the Gumbel-max trick; vLLM and SGLang draw the same way).

**Tree test.** The lossless tree test verifiers share (:func:`~adaptivespec.tree_sampling.sibling_accept`,
:func:`~adaptivespec.tree_sampling.residual_draw`) lives in :mod:`adaptivespec.tree_sampling`, part of
the plugin API; this module is the engine's side: the distribution and the draws.
"""

from __future__ import annotations

import torch

from adaptivespec.tree_sampling import greedy_ids

_TINY = 1e-30
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose outputs look independent."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keyed_uniforms(seed: int, start: int, count: int) -> list[float]:
    """``u(seed, q)`` for positions ``q = start .. start + count - 1``: uniforms in (0, 1) from a hash
    of the seed and the position alone (53 bits each; host integers, no tensor work)."""
    key = _mix64(int(seed) & _MASK64)
    return [((_mix64(key ^ q) >> 11) + 0.5) * 2.0**-53 for q in range(start, start + count)]


def warp(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0,
         min_p: float | None = None) -> torch.Tensor:
    """[..., V] float32 logits after temperature, top-k, top-p and min-p (removed tokens: -inf)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1:] = False  # the most likely token always stays
        z = z.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    if min_p is not None:
        probs = z.softmax(-1)
        drop = probs < min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(-1, keepdim=True), False)
        z = z.masked_fill(drop, -torch.inf)
    return z


_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[n] for each row of non-negative ``probs`` [n, V] (need not sum to 1) the first token whose
    cumulative weight exceeds ``u`` [n] (in [0, 1)) times the row's total: an exact draw at a uniform
    ``u``, a token of weight 0 never. In two levels (sums of blocks of 256 tokens, then one block's
    cumulative sum): a whole row's cumulative sum of 60 tree rows x 49k took 2 ms on a 2-vCPU EPYC,
    this 0.25."""
    n, V = probs.shape
    p = probs.float()
    if V % _BLOCK:
        p = torch.nn.functional.pad(p, (0, -V % _BLOCK))
    blocks = p.view(n, -1, _BLOCK)
    cb = blocks.sum(-1).cumsum(-1)  # [n, V / 256]
    x = (u * cb[:, -1]).unsqueeze(-1)  # [n, 1]
    b = torch.searchsorted(cb, x, right=True).clamp_(max=cb.shape[1] - 1)
    before = torch.where(b > 0, cb.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(x))
    inner = blocks[torch.arange(n, device=p.device), b.squeeze(-1)]  # [n, 256] the chosen block
    j = torch.searchsorted(inner.cumsum(-1), x - before, right=True)
    # rounding between the block's sum and its cumulative sum never picks a weight-0 token past its end
    last = torch.where(inner > 0, torch.arange(_BLOCK, device=p.device), -1).amax(-1, keepdim=True)
    return (b * _BLOCK + torch.minimum(j, last)).squeeze(-1)


class Sampler:
    """The generation's sampling settings and its random generator (one per engine).

    ``temperature == 0`` is greedy: :meth:`next_token` is the argmax and verifiers keep their
    greedy rule (the engine then hands them no sampler at all).
    """

    def __init__(self, temperature: float, top_k: int | None = None, top_p: float = 1.0,
                 min_p: float | None = None, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.reseed(seed)

    @classmethod
    def from_config(cls, generation, device) -> "Sampler | None":
        """A sampler for ``generation`` (a :class:`~adaptivespec.config.GenerationConfig`); None when greedy."""
        if generation.temperature == 0:
            return None
        return cls(generation.temperature, generation.top_k, generation.top_p, generation.min_p, device, generation.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def settings(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def reseed(self, seed: int) -> None:
        """Start a generation with ``seed``: its keyed uniforms and its generator."""
        self.seed = int(seed)
        self.position: int | None = None
        self._keyed = torch.zeros(0, dtype=torch.float64, device=self.device)  # u(seed, q) for q < len, grown by doubling
        self.generator.manual_seed(self.seed)

    def at(self, position: int | None) -> None:
        """The sequence position of the token the next pick's first row (a verify tree's root row, a
        plain step's one row) gives; a row at tree depth ``d`` gives position ``position + d``.
        None: uniforms from the generator, in order."""
        self.position = position

    # -- the distribution ------------------------------------------------------------------------
    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] float32 sampling distribution of the target from its logits."""
        if self.greedy:  # the limit of temperature -> 0: all mass on the (first) argmax, as greedy_ids picks it
            return torch.nn.functional.one_hot(logits.max(-1).indices, logits.shape[-1]).float()
        return warp(logits, self.temperature, self.top_k, self.top_p, self.min_p).softmax(-1)

    # -- draws -------------------------------------------------------------------------------------
    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One token per row of ``weights`` [..., V] (non-negative, need not sum to 1): [...]."""
        race = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=self.generator)
        return (weights.float() / race.clamp_min(_TINY)).argmax(-1)

    def uniform(self, n: int) -> torch.Tensor:
        """[n] float32 uniforms in [0, 1)."""
        return torch.rand(n, generator=self.generator, device=self.device)

    def choose(self, probs: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """[n] the target's token at each row of ``probs`` [n, V] (its sampling distribution), row
        ``i`` sitting ``depth[i]`` positions past :meth:`at`'s: the inverse CDF at the position's
        uniform. Rows at the same depth share it (a tree's siblings' parents: one position, one
        token whatever the node)."""
        n = depth.shape[0]  # a bound on the levels (depth < rows) known without reading the tensor
        if self.position is None:
            u = self.uniform(n).double()
        else:
            end = self.position + n
            if end > self._keyed.shape[0]:
                have = self._keyed.shape[0]
                more = keyed_uniforms(self.seed, have, max(end, 2 * have, 256) - have)
                self._keyed = torch.cat([self._keyed, torch.tensor(more, dtype=torch.float64, device=self.device)])
            u = self._keyed[self.position:end]
        return inverse_cdf(probs, u[depth].float())

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """0-dim token from one row of logits [V]: the argmax when greedy, else the keyed choice
        (:meth:`choose`) at :meth:`at`'s position."""
        return pick_next(self, logits, self.position)


def pick_next(sampler: Sampler | None, logits: torch.Tensor, position: int | None = None) -> torch.Tensor:
    """The runtime's next token from logits [V], the token of sequence position ``position``:
    the argmax without a sampler (or a greedy one), else the sampler's keyed choice there."""
    if sampler is not None and not sampler.greedy:
        sampler.at(position)
        return sampler.choose(sampler.probs(logits.unsqueeze(0)), torch.zeros(1, dtype=torch.long, device=logits.device))[0]
    return greedy_ids(logits)


def root_stats(lp: torch.Tensor) -> list[float]:
    """Top-1 probability, entropy (nats) and top-4 probability of draft log-probabilities ``lp`` [Vd],
    read to the host in one sync (what a tree policy sees of the draft at the root)."""
    return torch.stack([lp.max().exp(), -(lp.exp() * lp).sum(), lp.topk(4).values.exp().sum()]).tolist()
