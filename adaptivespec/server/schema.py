"""The torch server's request bodies, read and checked: OpenAI's chat and text completions.

Every problem is a :class:`RequestError`: HTTP 400 with OpenAI's error body, its message one line
that names the field, the value and what was expected (``max_tokens: expected a positive integer,
got -5``). Unknown fields are refused the same way, so a misspelt ``max_token`` is not silently
ignored; the OpenAI fields this server has no form for are accepted only at their neutral value
(``n: 1``, ``presence_penalty: 0`` ...). Sampling fields a request leaves out take the config's
``generation`` values (``temperature``, ``top_p``, ``top_k``, ``min_p``; ``max_tokens``:
``generation.max_new_tokens``), so a greedy config serves greedily by default.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from adaptivespec.response_format import ResponseFormat, ResponseFormatError

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP = 4
NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False,),
           "echo": (False,), "best_of": (1,), "logit_bias": ({},), "parallel_tool_calls": (True, False)}
"""OpenAI fields with no form here, accepted at these values only (or null)."""
COMMON = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stream", "stream_options", "response_format", "regex", "ebnf", "user", *NEUTRAL)
CHAT_FIELDS = ("messages", *COMMON)
COMPLETION_FIELDS = ("prompt", *COMMON)


class RequestError(Exception):
    """A bad request: ``status`` (400 unless said), ``param`` (the field) and a one-line message."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.message, self.status = param, message, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@attrs.frozen(kw_only=True)
class Sampling:
    """A sampled request's settings (greedy requests have none)."""

    temperature: float
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    """None: the request gave none (the server draws one)."""


@attrs.frozen(kw_only=True)
class GenRequest:
    """One checked request, before tokenization."""

    messages: tuple[dict[str, str], ...] | None = None
    """Chat: the messages, their content as plain text."""
    prompt: str | tuple[int, ...] | None = None
    """Completions: raw text, or token ids."""
    max_tokens: int | None = None
    """None: ``generation.max_new_tokens`` (cut to what the context leaves)."""
    sampling: Sampling | None = None
    """None: greedy."""
    stop: tuple[str, ...] = ()
    stream: bool = False
    response_format: ResponseFormat | None = None
    model: str | None = None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(param: str, expected: str, value: Any) -> RequestError:
    return RequestError(param, f"{param}: expected {expected}, got {_show(value)}")


def _int(body: dict, key: str, lo: int, expected: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(key, expected, value)
    return value


def _number(body: dict, key: str, lo: float, hi: float | None, expected: str, *, lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _bad(key, expected, value)
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise _bad(key, expected, value)
    return float(value)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" ({exc.msg} at line {exc.lineno} column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(None, f"request body: expected a JSON object, got invalid JSON{where}") from None
    if not isinstance(body, dict):
        raise _bad("request body", "a JSON object", body)
    return body


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    for key in body:
        if key not in allowed:
            raise RequestError(key, f"{key}: unknown field; expected one of: {', '.join(sorted(allowed))}")
    for key, values in NEUTRAL.items():
        if body.get(key) is not None and body[key] not in values:
            raise RequestError(key, f"{key}: this server supports only {' or '.join(map(repr, values))}, "
                                    f"got {_show(body[key])}")


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "a non-empty list of {role, content} objects", raw)
    out = []
    for i, m in enumerate(raw):
        key = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(key, "an object with role and content", m)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise RequestError(key, f"{key}.{sorted(extra)[0]}: unknown field; expected role, content, name")
        if m.get("role") not in ROLES:
            raise _bad(f"{key}.role", f"one of {', '.join(ROLES)}", m.get("role"))
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"{key}.content", 'a string or a list of {"type": "text", "text": ...} parts', content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{key}.content", "a string", content)
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _prompt(raw: Any, vocab_size: int) -> str | tuple[int, ...]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        bad = next((t for t in raw if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _bad("prompt", f"token ids in [0, {vocab_size})", bad)
        return tuple(raw)
    raise _bad("prompt", "a non-empty string or list of token ids (one prompt per request)", raw)


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or len(items) > MAX_STOP or not all(isinstance(s, str) and s for s in items):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP}", raw)
    return tuple(items)


def _response_format(body: dict) -> ResponseFormat | None:
    raw, given = body.get("response_format"), [k for k in ("regex", "ebnf") if body.get(k) is not None]
    if raw is not None and not (isinstance(raw, dict) and raw.get("type") == "text"):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise RequestError(given[1], f"{given[1]}: expected one output format per request, got {' and '.join(given)}")
    if not given:
        if raw is not None and set(raw) != {"type"}:
            raise RequestError("response_format", "response_format: type text takes no other key")
        return None
    key = given[0]
    if key in ("regex", "ebnf"):
        if not isinstance(body[key], str):
            raise _bad(key, "a string", body[key])
        return _build(key, {"type": key, {"regex": "pattern", "ebnf": "grammar"}[key]: body[key]})
    if not isinstance(raw, dict) or raw.get("type") not in ("json_object", "json_schema"):
        raise _bad("response_format.type", "one of text, json_object, json_schema",
                   raw.get("type") if isinstance(raw, dict) else raw)
    if raw["type"] == "json_object":
        if set(raw) != {"type"}:
            raise RequestError("response_format", "response_format: type json_object takes no other key")
        return _build("response_format", {"type": "json_object"})
    spec = raw.get("json_schema")
    if set(raw) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "an object {name, schema, strict?, description?}", spec)
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise RequestError("response_format", f"response_format.json_schema.{sorted(extra)[0]}: unknown field; "
                                              "expected name, schema, strict, description")
    schema = spec.get("schema")
    if not isinstance(schema, dict):  # never a string: the server reads no files named by a client
        raise _bad("response_format.json_schema.schema", "a JSON schema object", schema)
    return _build("response_format.json_schema", {"type": "json_schema", "schema": schema})


def _build(where: str, fields: dict) -> ResponseFormat:
    try:
        return ResponseFormat(**fields)
    except ResponseFormatError as exc:
        raise RequestError(where, f"{where}: {exc}", status=501) from None
    except (ValueError, TypeError) as exc:
        raise RequestError(where, f"{where}.{exc}" if where == "response_format.json_schema" else f"{where}: {exc}") from None


def _sampling(body: dict, defaults) -> Sampling | None:
    """The request's sampling settings over the config's ``generation`` defaults (None: greedy)."""
    t = _number(body, "temperature", 0.0, None, "a number >= 0")
    top_p = _number(body, "top_p", 0.0, 1.0, "a number in (0, 1]", lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise _bad("top_k", "a positive integer (-1 or 0: off)", top_k)
    min_p = _number(body, "min_p", 0.0, 1.0, "a number in [0, 1]")
    seed = _int(body, "seed", 0, "a non-negative integer")
    if seed is not None and seed >= 2**63:
        raise _bad("seed", "an integer below 2**63", seed)
    temperature = defaults.temperature if t is None else t
    if temperature == 0:
        return None
    return Sampling(temperature=temperature, top_p=defaults.top_p if top_p is None else top_p,
                    top_k=defaults.top_k if top_k is None else (top_k if top_k > 0 else None),
                    min_p=defaults.min_p if min_p is None else (min_p or None), seed=seed)


def parse_request(body: dict[str, Any], *, chat: bool, defaults, vocab_size: int) -> GenRequest:
    """A checked chat (``chat=True``) or text-completions request; ``defaults``: the config's
    ``generation`` section."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    if chat and "messages" not in body:
        raise _bad("messages", "a non-empty list of {role, content} objects", None)
    if not chat and "prompt" not in body:
        raise _bad("prompt", "a non-empty string or list of token ids", None)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "a string", body["model"])
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "a string", body["user"])
    max_tokens = _int(body, "max_tokens", 1, "a positive integer")
    max_completion = _int(body, "max_completion_tokens", 1, "a positive integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "true or false", stream)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", "an object {include_usage: bool}", options)
    return GenRequest(
        messages=_messages(body["messages"]) if chat else None,
        prompt=None if chat else _prompt(body["prompt"], vocab_size),
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        sampling=_sampling(body, defaults), stop=_stop(body.get("stop")), stream=stream,
        response_format=_response_format(body), model=body.get("model"))
