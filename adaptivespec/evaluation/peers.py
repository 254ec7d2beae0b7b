"""Peers: transformers' own decoding, measured beside adaptivespec in the same ``bench`` run.

A peer is a pseudo-config of ``adaptivespec bench --peers``; it runs on the very target object the
configs use (same weights, dtype and device, loaded once) and reports the same stats fields:

* ``hf-generate``: ``model.generate`` with greedy decoding (``do_sample=False``): the reference
  implementation of plain autoregressive decoding. At ``generation.temperature > 0`` both peers
  sample with the same settings (``do_sample=True``), seeded per prompt like the configs.
* ``hf-prompt-lookup``: transformers' assisted generation with ``prompt_lookup_num_tokens=10``
  (n-gram drafts copied from the prompt, verified greedily: lossless, no draft model).

``target_forwards`` counts calls of the target's ``forward`` (a forward hook), so it is known for
both; ``accept_length_mean`` is ``new_tokens / target_forwards`` as for adaptivespec's engine.
Peers emit no per-step records (transformers does not expose them).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Iterable

import torch
from transformers import GenerationConfig

from adaptivespec.config import Config
from adaptivespec.decode import GenerationResult
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.contenders import generate_untimed, warmup_problems
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.sglang_contenders import SGLANG_PEERS, describe_sglang_peer
from adaptivespec.evaluation.spec import sampling_seed
from adaptivespec.models import encode_prompt, load_target

PEERS: dict[str, dict[str, Any]] = {
    "hf-generate": {},
    "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
}
"""Peer name -> extra ``generate`` keyword arguments (beside greedy decoding and the limits)."""


def parse_peers(text: str | None) -> tuple[str, ...]:
    """``"hf-generate,hf-prompt-lookup"`` -> the names, checked against :data:`PEERS` and the
    SGLang peers (``sglang``, ``sglang-eagle3``, ``sglang-ngram``: each its own local server)."""
    if not text:
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = [*PEERS, *SGLANG_PEERS]
    for name in names:
        if name not in known:
            raise AdaptiveSpecError(f"--peers: unknown peer {name!r}; expected a comma-separated list of: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise AdaptiveSpecError(f"--peers: a peer is named twice in {text!r}")
    return names


def describe_peer(name: str, config: Config) -> dict[str, Any]:
    """What stands in for ``config.to_dict()`` in the results: the peer and the target it runs on."""
    if name in SGLANG_PEERS:
        return describe_sglang_peer(name, config)
    return {
        "peer": name,
        "model": {"target": config.model.target},
        "runtime": {"device": config.runtime.device, "dtype": config.runtime.dtype},
        "generate": {**sampling_kwargs(config), **PEERS[name]},
    }


def sampling_kwargs(config: Config) -> dict[str, Any]:
    """``generate`` keyword arguments for the config's sampling settings (greedy at temperature 0).

    ``top_k=0`` switches off ``generate``'s own top-k default, as ``generation.top_k: null`` does."""
    g = config.generation
    if g.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": g.temperature, "top_k": g.top_k or 0, "top_p": g.top_p, "min_p": g.min_p}


class HfPeer:
    """One transformers decoding mode on the target of ``config`` (the bench's first config); a
    :class:`~adaptivespec.evaluation.contenders.Contender`."""

    kind = "peer"
    lossless = True  # greedy; prompt lookup verifies its drafts greedily
    autoregressive = False

    def __init__(self, name: str, config: Config, host=None) -> None:
        """``host`` is accepted for the contenders' common signature; a peer loads no plugin."""
        if name not in PEERS:
            raise AdaptiveSpecError(f"--peers: unknown peer {name!r}; expected one of: {', '.join(PEERS)}")
        self.name, self.config = name, config
        # its own copy of the target, as transformers loads it (our runtime re-lays out the shared one)
        self.target, self.tokenizer = load_target(config.model.target, config.runtime.dtype, config.runtime.device)
        self.kwargs = dict(PEERS[name])
        # stop_at_eos: false -> an id no token has (None would fall back to the model's own EOS)
        self.eos = self.tokenizer.eos_token_id if config.generation.stop_at_eos else self.target.config.vocab_size

    def encode(self, text: str) -> list[int]:
        """``text`` encoded as the configs encode it (the chat template as the config says)."""
        return encode_prompt(self.tokenizer, text, chat=self.config.generation.chat_template)

    def seed_for(self, index: int) -> int | None:
        """Sampling seed of prompt ``index`` (``generation.seed + index``); None when greedy."""
        return sampling_seed(self.config, index)

    def warm_up(self, problems: list[Problem], max_new_tokens: int, formats: Iterable[Any] = ()) -> None:
        """Warm up on the first and the longest prompt (a peer remembers nothing and compiles no grammar)."""
        generate_untimed(self, warmup_problems(problems), max_new_tokens)

    def close(self) -> None:
        """Nothing to stop."""

    def generate_ids(self, prompt_ids: list[int], *, max_new_tokens: int, on_step: Callable | None = None,
                     seed: int | None = None, response_format=None) -> GenerationResult:
        """``model.generate`` (greedy, or sampled with the config's settings and torch's global RNG
        seeded with ``seed`` inside ``fork_rng``); returns an :class:`adaptivespec.decode.GenerationResult`.
        A peer cannot constrain its output: a ``response_format`` is refused."""
        if response_format is not None:
            raise AdaptiveSpecError(f"--peers: {self.name} cannot follow a response_format (got {response_format.type!r}); "
                                    "expected a dataset without response formats, or an SGLang peer")
        device = next(self.target.parameters()).device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, n]
        gen = GenerationConfig(
            **sampling_kwargs(self.config),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id,
            **self.kwargs,
        )
        calls = [0]
        handle = self.target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            with warnings.catch_warnings(), torch.inference_mode(), rng:
                warnings.simplefilter("ignore")
                if gen.do_sample:
                    torch.manual_seed(self.config.generation.seed if seed is None else seed)
                t0 = time.perf_counter()
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
                wall = time.perf_counter() - t0
        finally:
            handle.remove()
        new = out[0, ids.shape[1]:].tolist()
        forwards = calls[0] or None
        stats = {
            "new_tokens": len(new),
            "target_forwards": forwards,
            "accept_length_mean": len(new) / forwards if forwards else None,
            "wall_seconds": wall,
            "tokens_per_second": len(new) / wall if wall > 0 else 0.0,
            "promoted_tokens": 0,
        }
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return GenerationResult(token_ids=new, text=text, stats=stats, records=[])
