"""What the torch server sends back: text assembled from a generation's token ids (stop strings
applied, streamed deltas that never split a character or show part of a stop string), and the
OpenAI response, chunk, usage and speculation objects."""

from __future__ import annotations

import time
import uuid
from typing import Any

from adaptivespec.server.worker import Finished


class TextAssembler:
    """Token ids in, text out: :meth:`add` returns the text that may be sent now.

    Held back: a trailing incomplete UTF-8 character (``\\ufffd``) and any tail that could be the
    start of a stop string. When a stop string appears the text ends before it, :attr:`stopped` is
    set and :attr:`stop_tokens` counts the tokens up to the step that completed it."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, incremental: bool = True) -> None:
        self.tok, self.stop = tokenizer, stop
        self.incremental = incremental or bool(stop)  # without streaming or stop strings: decode once at the end
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False
        self.stop_tokens: int | None = None

    def _decode(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        if not self.incremental:
            return ""
        text = self._decode()
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (not self.stopped or i < len(self.text)):
                self.stopped, self.text = True, text[:i]
        if self.stopped:
            self.stop_tokens = len(self.ids)
            return self._take(len(self.text))
        self.text = text
        if text.endswith("\ufffd"):
            return ""
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._take(len(text) - hold)

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

    def finish(self, token_ids: list[int]) -> str:
        """The rest of the text once the generation ended (``token_ids``: all of them)."""
        if self.stopped:
            return self._take(len(self.text))
        self.ids = list(token_ids)
        self.text = self._decode()
        return self._take(len(self.text))


def finish_reason(done: Finished, text: TextAssembler, max_tokens: int, eos: int | None) -> str:
    if text.stopped or done.grammar_ended or (eos is not None and done.token_ids and done.token_ids[-1] == eos):
        return "stop"
    return "length" if len(done.token_ids) >= max_tokens else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens`` (prompt tokens taken from the prefix cache, not read: the
    batch engine's) as OpenAI's ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def speculation(stats: dict[str, Any], *, lossless: bool, policy: str, verifier: str) -> dict[str, Any]:
    """The per-request speculation stats (the SGLang path's accept length and verify count, and
    what the engine reports beyond them)."""
    out = {"accept_length": stats.get("accept_length_mean"), "target_forwards": stats.get("target_forwards"),
           "promoted_tokens": stats.get("promoted_tokens", 0), "lossless": lossless, "policy": policy,
           "verifier": verifier, "queue_seconds": stats.get("queue_seconds"),
           "generation_seconds": stats.get("wall_seconds")}
    for key in ("prefill_seconds", "tokens_per_second", "accepted_by_source", "mask_ms_per_step"):
        if key in stats:
            out[key] = stats[key]
    return out


def logprobs_object(entries: list, tokenizer, chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice (or of a stream chunk) from the engine's per-token entries
    ``(id, log-probability, [(id, log-probability)] top ones)``. Chat: ``{content: [{token, logprob,
    bytes, top_logprobs: [...]}], refusal}``; completions: ``{tokens, token_logprobs, top_logprobs,
    text_offset}`` (``offset``: the text's length before the first of them). A token's text is its
    own decoding (a part of a multi-byte character shows as U+FFFD; ``bytes`` are the text's UTF-8)."""
    def text(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)

    if chat:
        def one(i: int, lp: float) -> dict[str, Any]:
            t = text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**one(i, lp), "top_logprobs": [one(j, q) for j, q in top]} for i, lp, top in entries],
                "refusal": None}
    tokens = [text(i) for i, _, _ in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(j): q for j, q in top} for _, _, top in entries], "text_offset": offsets}


class Envelope:
    """The fields every object of one response shares (id, created, model) and their builders."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.first = True
        self._started: set[int] = set()  # choices whose first chunk went out (it carries the role)

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, reason: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice of a whole response."""
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    def response(self, text: str, reason: str, extra: dict[str, Any], choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The whole response: one choice (``text``, ``reason``) or ``choices`` (:meth:`choice`)."""
        choices = choices if choices is not None else [self.choice(text, reason)]
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": choices, **extra}

    def chunk(self, text: str, reason: str | None = None, extra: dict[str, Any] | None = None, *, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or reason is None else {}
            if index not in self._started:
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
            obj = "text_completion"
        self._started.add(index)
        self.first = False
        return {**self._base(obj), "choices": [choice], **(extra or {})}

    def usage_chunk(self, extra: dict[str, Any]) -> dict[str, Any]:
        """A stream's last chunk under ``stream_options.include_usage``: no choices, ``extra`` (usage, speculation)."""
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], **extra}
