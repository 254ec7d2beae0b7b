"""Sampling at temperature > 0: the target's transformed distribution, seeded draws, and the
lossless tree test that speculative verifiers share.

**Distribution.** :func:`warp` applies transformers' ``generate(do_sample=True)`` logits warpers in
its order (``_get_logits_processor``, transformers 5.x): temperature, then top-k (ties with the
k-th logit kept), then top-p (ascending sort, drop while the cumulative mass is <= 1 - top_p,
always keep the most likely), then min-p (drop below ``min_p`` times the largest probability).
``generation.top_k: null`` means no top-k, where ``generate`` would default to 50.

**Draws.** One :class:`Sampler` per engine, on the runtime's device, reseeded before every
generation (record i of a run: ``generation.seed + i``). A categorical draw is the exponential
race ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d. (the Gumbel-max trick; vLLM and SGLang draw the
same way): no normalisation, no host sync, and zero-probability tokens are never drawn.

**Tree test.** The lossless tree test verifiers share (:func:`~adaptivespec.tree_sampling.sibling_accept`,
:func:`~adaptivespec.tree_sampling.residual_draw`) lives in :mod:`adaptivespec.tree_sampling`, part of
the plugin API; this module is the engine's side: the distribution and the draws.
"""

from __future__ import annotations

import torch

from adaptivespec.tree_sampling import greedy_ids

_TINY = 1e-30


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
        self.generator.manual_seed(int(seed))

    # -- the distribution ------------------------------------------------------------------------
    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] float32 sampling distribution of the target from its logits."""
        if self.greedy:  # the limit of temperature -> 0: all mass on the (first) argmax
            return torch.nn.functional.one_hot(greedy_ids(logits), logits.shape[-1]).float()
        return warp(logits, self.temperature, self.top_k, self.top_p, self.min_p).softmax(-1)

    # -- draws -------------------------------------------------------------------------------------
    def draw(self, weights: torch.Tensor) -> torch.Tensor:
        """One token per row of ``weights`` [..., V] (non-negative, need not sum to 1): [...]."""
        race = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=self.generator)
        return (weights.float() / race.clamp_min(_TINY)).argmax(-1)

    def uniform(self, n: int) -> torch.Tensor:
        """[n] float32 uniforms in [0, 1)."""
        return torch.rand(n, generator=self.generator, device=self.device)

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        """0-dim token from one row of logits [V]: the argmax when greedy, else a draw."""
        if self.greedy:
            return greedy_ids(logits)
        return self.draw(self.probs(logits))


def pick_next(sampler: Sampler | None, logits: torch.Tensor) -> torch.Tensor:
    """The runtime's next token from logits [V]: greedy without a sampler."""
    return greedy_ids(logits) if sampler is None else sampler.next_token(logits)


def root_stats(lp: torch.Tensor) -> list[float]:
    """Top-1 probability, entropy (nats) and top-4 probability of draft log-probabilities ``lp`` [Vd],
    read to the host in one sync (what a tree policy sees of the draft at the root)."""
    return torch.stack([lp.max().exp(), -(lp.exp() * lp).sum(), lp.topk(4).values.exp().sum()]).tolist()
