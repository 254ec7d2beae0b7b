"""The torch server's request bodies, read and checked: OpenAI's chat and text completions.

Every problem is a :class:`RequestError`: HTTP 400 with OpenAI's error body, its message one line
that names the field, the value and what was expected (``max_tokens: expected a positive integer,
got -5``). A field is one of four kinds:

* **read** (:data:`CHAT_FIELDS`, :data:`COMPLETION_FIELDS`): checked and used;
* **neutral only** (:data:`NEUTRAL`): OpenAI and vLLM fields that would change the output and have
  no form here, accepted only at their neutral value or null (``echo: false``, ``best_of: 1``,
  ``tools: []`` ...); any other value is a 400 naming the field, never silently ignored;
* **ignored** (:data:`IGNORED`): fields that change nothing here (``store``, ``metadata``,
  ``service_tier`` ...), accepted and logged once per name per process;
* **unknown**: accepted and logged once per name (with the nearest known field, so a misspelt
  ``max_token`` shows in the log), as vLLM does; ``serve --strict-fields`` (``strict=True``) refuses
  ignored and unknown fields with a 400 instead.

Sampling fields a request leaves out take the config's ``generation`` values (``temperature``,
``top_p``, ``top_k``, ``min_p``; ``max_tokens``: ``generation.max_new_tokens``), so a greedy config
serves greedily by default. Numbers must be finite (JSON's ``NaN``, ``Infinity`` and ``1e999``
parse as non-finite floats and are refused).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import threading
from typing import Any

import attrs

from adaptivespec.response_format import ResponseFormat, ResponseFormatError

log = logging.getLogger("adaptivespec.server")

ROLES = ("system", "user", "assistant", "tool", "developer")
"""Message roles; ``developer`` (OpenAI's name for system instructions) reaches the template as ``system``."""
MAX_STOP = 4
MAX_DEPTH = 64
"""The deepest nesting of objects and lists a request body may have (a JSON schema needs far less)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
"""Temperature is 0 (greedy) or in this range: below it logits / temperature overflow float32, far
above it every distribution is flat (OpenAI's own limit is 2)."""
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "echo": (False,), "best_of": (1,), "logit_bias": ({},),
           "parallel_tool_calls": (True, False), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
           "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (), "suffix": ("",),
           "reasoning_effort": (), "verbosity": (), "web_search_options": ()}
"""OpenAI (and vLLM) fields with no form here, accepted at these values only (or null): any other
value would change the output."""
IGNORED = ("store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "prediction")
"""OpenAI fields that change nothing here (``prediction``: predicted outputs change the latency, never
the text), accepted and logged once per name (refused with ``strict``)."""
COMMON = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "stream", "stream_options", "response_format", "regex", "ebnf", "user", "n", "logprobs",
          "top_logprobs", *NEUTRAL)
MAX_LOGPROBS = 20
"""The most top log-probabilities per token a request may ask for (OpenAI's chat limit; vLLM's default)."""
MAX_N = 16
"""The most choices one request may ask for (``n``)."""
CHAT_FIELDS = ("messages", "chat_template_kwargs", *COMMON)
COMPLETION_FIELDS = ("prompt", *COMMON)
MESSAGE_NULLS = {"tool_calls": ([],), "function_call": (), "refusal": (), "audio": (), "annotations": ([],),
                 "reasoning_content": ()}
"""Keys an assistant message sent back by a client may carry, accepted empty or null only."""
TEMPLATE_OWN = ("conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
                "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                "return_assistant_tokens_mask", "tokenizer_kwargs")
"""``apply_chat_template``'s own parameters: not template variables, refused in ``chat_template_kwargs``."""

_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(name: str, message: str) -> bool:
    """Log ``message`` as a warning the first time ``name`` is seen in this process; True if it was."""
    with _said_lock:
        if name in _said:
            return False
        _said.add(name)
    log.warning(message)
    return True


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
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation besides the model's EOS ids (vLLM's name), kept in the output."""
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: the stream ends with a chunk of no choices and the usage."""
    response_format: ResponseFormat | None = None
    model: str | None = None
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict, hash=False)
    """Chat: extra variables for the chat template (Qwen3's ``enable_thinking`` ...)."""
    logprobs: int | None = None
    """Return each token's log-probability and this many top ones (chat: ``top_logprobs`` with
    ``logprobs: true``; completions: ``logprobs``); None: none."""
    n: int = 1
    """Choices to generate for the prompt."""


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, expected, value)
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise _bad(key, expected, value)
    return float(value)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(None, f"request body: expected JSON nested at most {MAX_DEPTH} levels deep, got deeper") from None
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" ({exc.msg} at line {exc.lineno} column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(None, f"request body: expected a JSON object, got invalid JSON{where}") from None
    if not isinstance(body, dict):
        raise _bad("request body", "a JSON object", body)
    if _depth(body) > MAX_DEPTH:
        raise RequestError(None, f"request body: expected JSON nested at most {MAX_DEPTH} levels deep, got deeper")
    return body


def _depth(value: Any) -> int:
    """How deeply ``value``'s objects and lists nest (without recursion: stops counting past MAX_DEPTH)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _near(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _neutral(key: str, value: Any, values: tuple) -> None:
    if value is not None and value not in values:
        allowed = " or ".join([*map(repr, values), "null"])
        raise RequestError(key, f"{key}: this server supports only {allowed}, got {_show(value)}")


def _check_fields(body: dict, allowed: tuple[str, ...], strict: bool) -> None:
    known = allowed + IGNORED
    for key in body:
        if key in allowed:
            continue
        if strict:
            what = "a field this server does not read" if key in IGNORED else "unknown field"
            raise RequestError(key, f"{key}: {what} (--strict-fields); expected one of: {', '.join(sorted(allowed))}")
        if key in IGNORED:
            say_once(key, f"adaptivespec serve: request field {key!r} accepted and ignored: it changes nothing on this server "
                          "(said once per field; serve --strict-fields refuses it)")
        else:
            say_once(key, f"adaptivespec serve: request field {key!r} is unknown here and ignored{_near(key, known)} "
                          "(said once per field; serve --strict-fields refuses it)")
    for key, values in NEUTRAL.items():
        if key in allowed:
            _neutral(key, body.get(key), values)


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "a non-empty list of {role, content} objects", raw)
    out = []
    for i, m in enumerate(raw):
        key = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(key, "an object with role and content", m)
        extra = set(m) - {"role", "content", "name", *MESSAGE_NULLS}
        if extra:
            raise RequestError(key, f"{key}.{sorted(extra)[0]}: unknown field; expected role, content, name")
        for field, values in MESSAGE_NULLS.items():
            _neutral(f"{key}.{field}", m.get(field), values)
        if m.get("role") not in ROLES:
            raise _bad(f"{key}.role", f"one of {', '.join(ROLES)}", m.get("role"))
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"{key}.content", 'a string or a list of {"type": "text", "text": ...} parts', content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{key}.content", "a string", content)
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return tuple(out)


def template_kwargs(raw: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's extra chat-template variables, checked (null: none)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise _bad(field, "an object of template variables", raw)
    own = next((k for k in raw if k in TEMPLATE_OWN), None)
    if own is not None:
        raise RequestError(field, f"{field}.{own}: expected a template variable, got one of apply_chat_template's own "
                                  f"parameters ({', '.join(TEMPLATE_OWN)})")
    return dict(raw)


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


def _stop_token_ids(raw: Any, vocab_size: int) -> tuple[int, ...]:
    if raw is None:
        return ()
    expected = f"a list of token ids in [0, {vocab_size})"
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise _bad("stop_token_ids", expected, raw)
    bad = next((t for t in raw if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _bad("stop_token_ids", expected, bad)
    return tuple(raw)


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
    t = _number(body, "temperature", 0.0, MAX_TEMPERATURE, f"0 or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    if t is not None and 0 < t < MIN_TEMPERATURE:
        raise _bad("temperature", f"0 or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]", body["temperature"])
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


def parse_request(body: dict[str, Any], *, chat: bool, defaults, vocab_size: int, strict: bool = False) -> GenRequest:
    """A checked chat (``chat=True``) or text-completions request; ``defaults``: the config's
    ``generation`` section; ``strict``: ignored and unknown fields are a 400 (``serve --strict-fields``)."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, strict)
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
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "true or false", stream)
    return GenRequest(
        messages=_messages(body["messages"]) if chat else None,
        prompt=None if chat else _prompt(body["prompt"], vocab_size),
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        sampling=_sampling(body, defaults), stop=_stop(body.get("stop")),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids"), vocab_size), stream=stream,
        include_usage=_include_usage(body.get("stream_options")), response_format=_response_format(body),
        model=body.get("model"), chat_template_kwargs=template_kwargs(body.get("chat_template_kwargs")) if chat else {},
        logprobs=_logprobs(body, chat), n=_n(body))


def _n(body: dict) -> int:
    expected = f"an integer in [1, {MAX_N}]"
    n = _int(body, "n", 1, expected)
    if n is not None and n > MAX_N:
        raise _bad("n", expected, n)
    return n or 1


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top log-probabilities per token asked for, or None. Chat: ``logprobs`` (bool) and
    ``top_logprobs`` (0-20, with ``logprobs: true`` only); completions: ``logprobs`` (0-20)."""
    expected = f"an integer in [0, {MAX_LOGPROBS}]"
    top = _int(body, "top_logprobs", 0, expected)
    if top is not None and top > MAX_LOGPROBS:
        raise _bad("top_logprobs", expected, top)
    if not chat:
        _neutral("top_logprobs", top, (0,))  # the chat field; completions name the count logprobs
        k = _int(body, "logprobs", 0, expected)
        if k is not None and k > MAX_LOGPROBS:
            raise _bad("logprobs", expected, k)
        return k
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad("logprobs", "true or false", on)
    if top and not on:
        raise RequestError("top_logprobs", f"top_logprobs: expected logprobs: true beside it, got logprobs: {_show(on)}")
    return (top or 0) if on else None


def _include_usage(options: Any) -> bool:
    """``stream_options``: ``include_usage`` read, ``include_obfuscation`` ignored, vLLM's
    ``continuous_usage_stats`` false only."""
    expected = "an object {include_usage: bool, include_obfuscation: bool}"
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation", "continuous_usage_stats"}:
        raise _bad("stream_options", expected, options)
    for key, value in options.items():
        if value is not None and not isinstance(value, bool):
            raise _bad(f"stream_options.{key}", "true or false", value)
    _neutral("stream_options.continuous_usage_stats", options.get("continuous_usage_stats"), (False,))
    return bool(options.get("include_usage"))


# -- vLLM's /tokenize and /detokenize -----------------------------------------------------------------
TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
TOKENIZE_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                        "return_token_strs", "chat_template_kwargs")
DETOKENIZE_FIELDS = ("model", "tokens")


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """A checked ``/tokenize`` body: vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    add_special_tokens: bool = True
    """Text: the tokenizer's special tokens (default true); chat: a BOS the template did not put (default false)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict, hash=False)


def _other_fields(body: dict, allowed: tuple[str, ...], strict: bool) -> None:
    for key in body:
        if key in allowed:
            continue
        if strict:
            raise RequestError(key, f"{key}: unknown field (--strict-fields); expected one of: {', '.join(allowed)}")
        say_once(key, f"adaptivespec serve: request field {key!r} is unknown here and ignored{_near(key, allowed)} "
                      "(said once per field; serve --strict-fields refuses it)")


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, "true or false", value)
    return value


def parse_tokenize(body: dict[str, Any], *, strict: bool = False) -> TokenizeRequest:
    """``/tokenize``: ``{prompt, add_special_tokens?}`` or ``{messages, add_generation_prompt?,
    continue_final_message?, add_special_tokens?, chat_template_kwargs?}``, each with ``model?`` and
    ``return_token_strs?`` (vLLM's field names and defaults)."""
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "a string", body["model"])
    strs = _flag(body, "return_token_strs", False)
    if "messages" not in body:
        _other_fields(body, TOKENIZE_FIELDS, strict)
        if not isinstance(body.get("prompt"), str):
            raise _bad("prompt", "a string (or messages instead)", body.get("prompt"))
        return TokenizeRequest(prompt=body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True),
                               return_token_strs=strs)
    _other_fields(body, TOKENIZE_CHAT_FIELDS, strict)
    generation, final = _flag(body, "add_generation_prompt", True), _flag(body, "continue_final_message", False)
    if generation and final:
        raise RequestError("continue_final_message", "continue_final_message: expected false while "
                                                     "add_generation_prompt is true (set one of them), got true")
    return TokenizeRequest(messages=_messages(body["messages"]), add_special_tokens=_flag(body, "add_special_tokens", False),
                           add_generation_prompt=generation, continue_final_message=final, return_token_strs=strs,
                           chat_template_kwargs=template_kwargs(body.get("chat_template_kwargs")))


def parse_detokenize(body: dict[str, Any], *, vocab_size: int, strict: bool = False) -> list[int]:
    """``/detokenize``'s ``tokens`` (``{tokens, model?}``), checked against the vocabulary."""
    _other_fields(body, DETOKENIZE_FIELDS, strict)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _bad("tokens", "a list of token ids", ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _bad("tokens", f"token ids in [0, {vocab_size})", bad)
    return ids
