"""What the bench runs: the :class:`Contender` protocol, and :class:`ConfigContender`, a config on
adaptivespec's own engine.

The other contenders implement the same protocol: transformers' decoding
(:class:`adaptivespec.evaluation.peers.HfPeer`) and SGLang servers
(:class:`adaptivespec.evaluation.sglang_contenders.SGLangContender`). The helpers every contender
shares (which prompts warm it up, a prompt's own response format) live here too.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Protocol

from adaptivespec.response_format import ResponseFormat, parse_response_format
from adaptivespec.decode import Engine, GenerationResult
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.spec import Entry, sampling_seed


class Contender(Protocol):
    """One column of a bench run: something that turns prompts into generations with stats.

    The bench calls :meth:`warm_up` once before any timed run, then, per prompt, :meth:`encode`,
    :meth:`seed_for` and :meth:`generate_ids` (timed inside), and :meth:`close` when the run ends
    or fails."""

    name: str
    """Shown in tables and plots (a config's file stem, a peer's name)."""
    kind: str
    """``config`` or ``peer``."""
    lossless: bool
    """Whether it decodes exactly like greedy decoding of the target."""

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids (the chat template applied as the config says)."""

    def seed_for(self, index: int) -> int | None:
        """The sampling seed of prompt ``index`` (``generation.seed + index``); None when greedy."""

    def generate_ids(self, prompt_ids: list[int], *, max_new_tokens: int, on_step: Callable | None = None,
                     seed: int | None = None, response_format: ResponseFormat | None = None) -> GenerationResult:
        """One generation: its text and ``stats``; ``on_step`` receives each speculative step's record."""

    def warm_up(self, problems: list[Problem], max_new_tokens: int, formats: Iterable[ResponseFormat]) -> None:
        """Untimed generations of ``max_new_tokens`` on (some of) the run's ``problems``, then ready
        for the timed runs: nothing remembered from the warm-up, the grammars of ``formats`` compiled."""

    def close(self) -> None:
        """Stop what the contender started (a server); the run is over."""


_FORMATS: dict[str, ResponseFormat] = {}


def response_format_of(problem: Problem) -> ResponseFormat | None:
    """The problem's own ``response_format`` (``meta``) as a validated
    :class:`~adaptivespec.config.ResponseFormat` (parsed once per distinct format), or None."""
    raw = problem.meta.get("response_format")
    if raw is None:
        return None
    key = json.dumps(raw, sort_keys=True)
    if key not in _FORMATS:
        _FORMATS[key] = parse_response_format(raw, problem.id)
    return _FORMATS[key]


def warmup_problems(problems: list[Problem]) -> list[Problem]:
    """The prompts a contender warms up on: the first, and the longest where that is another one (a
    long prompt's first prefill allocates its caches and meets new kernel sizes: at ~4k tokens it
    took up to twice as long as the next, which fell on whichever contender ran it first)."""
    if not problems:
        return []
    longest = max(problems, key=lambda p: len(p.prompt))
    return [problems[0]] + ([longest] if longest is not problems[0] else [])


def generate_untimed(contender: Contender, problems: list[Problem], max_new_tokens: int) -> None:
    """One generation per problem, each with the problem's own response format, results dropped."""
    for problem in problems:
        fmt = response_format_of(problem)
        contender.generate_ids(contender.encode(problem.prompt), max_new_tokens=max_new_tokens,
                               **({"response_format": fmt} if fmt is not None else {}))


class ConfigContender:
    """A config on adaptivespec's engine (``--backend torch``)."""

    kind = "config"

    def __init__(self, entry: Entry, structured: bool = False) -> None:
        """``structured``: prompts carry their own response formats (a structured-output dataset)."""
        self.name = entry.name
        self.engine = Engine(entry.config, structured=structured)
        self.lossless = self.engine.lossless

    def encode(self, text: str) -> list[int]:
        """The engine's encoding of ``text``."""
        return self.engine.encode(text)

    def generate_ids(self, ids: list[int], *, max_new_tokens: int, on_step=None, seed: int | None = None,
                     response_format=None) -> GenerationResult:
        """The engine's generation."""
        return self.engine.generate_ids(ids, max_new_tokens=max_new_tokens, on_step=on_step, seed=seed,
                                        response_format=response_format)

    def seed_for(self, index: int) -> int | None:
        """Sampling seed of prompt ``index`` (``generation.seed + index``); None when greedy."""
        return sampling_seed(self.engine.config, index)

    def warm_up(self, problems: list[Problem], max_new_tokens: int, formats: Iterable[Any]) -> None:
        """Warm up on the first and the longest prompt, drop what candidate sources remembered (the
        warm-up's output never drafts a prompt), compile the grammars of ``formats`` (once per process)."""
        generate_untimed(self, warmup_problems(problems), max_new_tokens)
        self.engine.forget()
        for fmt in formats:
            self.engine.make_constraint(fmt)

    def close(self) -> None:
        """Nothing to stop."""
