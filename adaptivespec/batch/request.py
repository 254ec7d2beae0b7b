"""One request's state in the batch, and the lane (caches + strategies) it decodes in.

A request is a small state machine: ``WAITING`` (queued, FIFO) -> ``PREFILL`` (it holds a lane;
its prompt goes through in chunks) -> ``DECODE`` (a speculative or plain step each engine step)
-> ``DONE`` (its lane is free again). It is the one place its truth is kept: the scheduler reads
it to decide, the engine's commit is the only writer.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any, Callable

import attrs

from adaptivespec.fastpath.batched import DraftKV
from adaptivespec.types import StepRecord

_IDS = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@attrs.define(eq=False, kw_only=True)
class Sampling:
    """A request's own sampling settings (None on a request: the config's ``generation`` ones)."""

    temperature: float
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None


@attrs.define(eq=False, kw_only=True)
class Request:
    """One generation in the batch."""

    prompt: list[int]
    max_new_tokens: int
    seed: int | None = None
    """Sampling seed (None: the config's ``generation.seed``)."""
    sampling: Sampling | None = None
    response_format: Any = None
    stop_ids: frozenset[int] = frozenset()
    """Ids that end this request besides the model's EOS ids (kept in the output, as an EOS is)."""
    on_tokens: Callable[[list[int]], None] | None = None
    """Called with each step's new ids (in the engine's thread)."""
    on_step: Callable[[StepRecord], None] | None = None
    logprobs: int | None = None
    """Keep each token's log-probability and this many top ones (None: none kept)."""
    on_logprobs: Callable[[list], None] | None = None
    """Called with each step's token log-probabilities before ``on_tokens`` (in the engine's thread)."""
    rid: int = attrs.field(factory=lambda: next(_IDS))

    status: Status = Status.WAITING
    lane: "Lane | None" = None
    cached: int = 0
    """Prompt tokens that came from the prefix cache (:mod:`adaptivespec.batch.prefix`), not read."""
    out: list[int] = attrs.Factory(list)
    records: list[StepRecord] = attrs.Factory(list)
    forwards: int = 0
    """Target forwards that produced this request's tokens (its prefill counts one)."""
    promoted: int = 0
    last_accepted: int = -1
    cancelled: bool = False
    """Set from any thread (:meth:`cancel`); the request leaves at the next step."""
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop id, grammar end), ``"length"``, ``"cancelled"``, ``"error"``."""
    error: str | None = None
    grammar_ended: bool = False
    """Its response format's grammar reached its end."""
    accepted_by_source: dict[str, int] = attrs.Factory(dict)
    """Accepted tokens per proposer (speculative configs), as ``GenerationResult.stats``."""
    result: Any = None
    """Its :class:`~adaptivespec.decode.GenerationResult` once finished (not on an error)."""
    submitted: float = attrs.Factory(time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def prefilled(self) -> int:
        """Positions in the target's cache: its lane's runtime counter ``P``, the one count of a request's
        computed positions (a prompt chunk read or a prefix taken advances it; == len(prompt) once
        decoding starts, then the decoded tokens' too); 0 without a lane."""
        return self.lane.engine.runtime.P if self.lane is not None else 0

    @prefilled.setter
    def prefilled(self, n: int) -> None:
        self.lane.engine.runtime.P = n

    @property
    def done(self) -> bool:
        return self.status is Status.DONE

    def stats(self) -> dict[str, Any]:
        """:attr:`GenerationResult.stats <adaptivespec.decode.GenerationResult.stats>`'s fields for this request."""
        end = self.finished or time.perf_counter()
        start = self.started or self.submitted
        wall = end - start
        n = len(self.out)
        return {
            "new_tokens": n,
            "target_forwards": self.forwards,
            "accept_length_mean": n / self.forwards if self.forwards else 0.0,
            "wall_seconds": wall,
            "tokens_per_second": n / wall if wall > 0 else 0.0,
            "prefill_seconds": (self.first_token - start) if self.first_token else wall,
            "promoted_tokens": self.promoted,
            "queue_seconds": start - self.submitted,
            "cached_tokens": self.cached,
            "finish_reason": self.finish_reason,
            **({"accepted_by_source": dict(self.accepted_by_source)} if self.accepted_by_source else {}),
        }


@attrs.define(eq=False)
class Lane:
    """One slot of the batch: an :class:`~adaptivespec.decode.Engine` (its runtime's KV cache, its
    policy, verifier, sources and sampler) and the draft head's cache, reused by the requests that
    hold the slot one after another."""

    engine: Any
    index: int
    kv: DraftKV = attrs.Factory(DraftKV)
    step: int = 0
    """Speculative steps of the request holding the lane."""
    depth_cap: int = 0
    """Draft levels worth running next step (0: the policy's shape; see RowBudget)."""
    rows: int = 0
    """Verify rows beyond the root the row budget gave it at the last step."""
    pending: list = attrs.Factory(list)
    """Rows the draft head has yet to run: ``(tokens, states, positions)`` of steps that drafted
    nothing; run in one pass before the lane drafts again (:meth:`BatchEngine._catch_up`)."""
    kept_rows: Any = None
    """The head's rows ``(tokens, states, positions)`` of a prompt prefix taken from the prefix
    cache, run (or left pending) with the prompt's first chunk read (:meth:`BatchEngine._reuse`)."""
    states: Any = None
    """[capacity, H] the draft head's input state at each position of the lane's sequence, kept for
    the prefix cache (None: no cache or no head)."""
