"""Structured output: generation constrained by a grammar (JSON schema, any JSON, regex, EBNF).

The grammar engine is xgrammar (SGLang's default backend): it compiles the response format
against the target's tokenizer once, keeps a matcher that follows the committed tokens, and
fills token bitmasks (32 tokens per int32 word) that are applied to the logits in one call.

Per generation the engine builds a :class:`Constraint` and then, every step:

* **plain decoding** (prefill and ``ar_step``): the last position's logits are masked by the
  matcher's state before the next token is picked (:meth:`Constraint.mask_next`);
* **speculative steps**: after the target's forward over the draft tree, the logits at every
  node are masked by the grammar state along that node's path (:meth:`Constraint.mask_tree`:
  xgrammar walks the tree once, ``traverse_draft_tree``, filling one bitmask row per node, and
  one ``apply_token_bitmask_inplace`` masks all rows). A node whose drafted token the grammar
  forbids at its parent gets a zero probability there, so no verifier rule that accepts only
  tokens of nonzero target probability (strict, margin, fly, sampling) can accept it, and the
  bonus token, picked from masked logits, is always legal;
* the emitted tokens advance the matcher (:meth:`Constraint.accept`).

Masking happens before the verifier's rule and before the sampling transforms (temperature,
top-k, top-p, min-p), as in SGLang: constrained speculative output therefore equals constrained
plain decoding (token for token with ``strict`` at temperature 0, in distribution above it).

``xgrammar`` is imported only when a response format is set (the ``structured`` extra).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any

import torch

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.response_format import ResponseFormat, ResponseFormatError, grammar_of, import_xgrammar

__all__ = ["Constraint", "GrammarBackend", "ResponseFormat", "ResponseFormatError"]


class GrammarBackend:
    """xgrammar's tokenizer info and compiler for one tokenizer; the last :attr:`cache_size`
    compiled grammars kept (a server meets schemas without end: its memory must not follow them)."""

    cache_size = 64
    """Compiled grammars kept, least recently used dropped first."""

    _shared: dict[tuple[int, int | None], "GrammarBackend"] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "GrammarBackend":
        """The process's backend for ``tokenizer`` (built once: engines sharing a tokenizer share
        its vocabulary tables and compiled grammars)."""
        key = (id(tokenizer), vocab_size)
        if key not in cls._shared:
            cls._shared[key] = cls(tokenizer, vocab_size)
        return cls._shared[key]

    def __init__(self, tokenizer, vocab_size: int | None = None) -> None:
        xgr = import_xgrammar()
        self.xgr = xgr
        self.tokenizer = tokenizer
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = self.info.vocab_size
        self.decoded = self.info.decoded_vocab  # [V] bytes (a copy: built once)
        # xgrammar's own cache has no bound by default: the one here (by response format) replaces it
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max(1, min(4, torch.get_num_threads())),
                                            cache_enabled=False)
        self._compiled: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._prefixes: set[bytes] | None = None

    @property
    def prefixes(self) -> set[bytes]:
        """Every strict prefix of every decoded vocabulary token (built on first use)."""
        if self._prefixes is None:
            self._prefixes = {s[:k] for s in self.decoded if isinstance(s, bytes) for k in range(1, len(s))}
        return self._prefixes

    def compile(self, fmt: ResponseFormat):
        k = fmt.key()
        with self._lock:  # the server compiles in its request threads and in the generation thread
            compiled = self._compiled.get(k)
            if compiled is not None:
                self._compiled.move_to_end(k)
                return compiled
        compiled = self.compiler.compile_grammar(grammar_of(fmt))
        with self._lock:
            self._compiled[k] = compiled
            self._compiled.move_to_end(k)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def constraint(self, fmt: ResponseFormat, rows: int = 64) -> "Constraint":
        return Constraint(self, self.compile(fmt), rows)


class Constraint:
    """One generation's grammar state: masks logits and follows the emitted tokens.

    ``mask_seconds`` / ``mask_calls`` accumulate the host time spent computing and applying
    masks (the per-step overhead reported by ``generate --json`` as ``stats.mask_ms_per_step``).
    """

    def __init__(self, backend: GrammarBackend, compiled, rows: int = 64) -> None:
        xgr = backend.xgr
        self.xgr, self.backend = xgr, backend
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = backend.vocab_size
        self.bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)] int32, CPU
        self.mask_seconds = 0.0
        self.mask_calls = 0

    @classmethod
    def following(cls, backend: GrammarBackend, matcher, rows: int = 1) -> "Constraint":
        """A view of a grammar state kept elsewhere: ``matcher`` is an ``xgrammar.GrammarMatcher``
        that its owner advances (a served request's, in SGLang). The view reads it (forced
        continuations, masks through forks) and is never advanced itself."""
        view = cls.__new__(cls)
        view.xgr, view.backend, view.matcher = backend.xgr, backend, matcher
        view.vocab_size = backend.vocab_size
        view.bitmask = backend.xgr.allocate_token_bitmask(rows, view.vocab_size)
        view.mask_seconds, view.mask_calls = 0.0, 0
        return view

    # -- state ----------------------------------------------------------------------------------
    @property
    def terminated(self) -> bool:
        """The stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()

    def accept(self, tokens: list[int]) -> int:
        """Advance the matcher over emitted ``tokens`` (legal: the masks saw to it); returns how
        many it took: all of them, or up to the grammar's stop token (nothing may follow it)."""
        for k, t in enumerate(tokens):
            if self.matcher.is_terminated():
                return k
            if not self.matcher.accept_token(int(t)):
                raise AdaptiveSpecError(f"internal error: emitted token {t} is not allowed by the response format")
        return len(tokens)

    def fork(self):
        """An independent copy of the matcher (for look-ahead without touching the state)."""
        return self.matcher.fork()

    # -- masks ------------------------------------------------------------------------------------
    def _rows(self, n: int) -> torch.Tensor:
        if self.bitmask.shape[0] < n:
            self.bitmask = self.xgr.allocate_token_bitmask(max(n, 2 * self.bitmask.shape[0]), self.vocab_size)
        return self.bitmask[:n]

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if logits.device != bitmask.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(self.vocab_size, logits.shape[-1]))
        if logits.shape[-1] > self.vocab_size:  # padded model vocabulary: never legal
            logits[..., self.vocab_size:] = -torch.inf

    def mask_next(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` ([V], the next token's) in place by the current state; returns it."""
        t0 = time.perf_counter()
        row = self._rows(1)
        self.matcher.fill_next_token_bitmask(row, 0)
        self._apply(logits.view(1, -1), row)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_calls += 1
        return logits

    def tree_masks(self, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """[n, ceil(V / 32)] bitmask of each node's children, following each node's path.

        Node ``i``'s row is the grammar's mask after the tokens of its path (the root's row: the
        current state). One xgrammar call walks the tree (first-child / next-sibling links built
        here; the matcher is left where it was).

        A node the walk cannot reach (its token, or an ancestor's, is illegal: probability 0 at
        its parent) or that ends the grammar gets an all-ones row: its logits stay finite. Its
        row is never read by a rule that follows accepted nodes, but the batched tests read
        every row at once (``sibling_accept`` sums each sibling group with one matrix product),
        and an all-masked row's softmax is NaN, which that product spreads to every node."""
        n = len(parents)
        first, sibling, last = [-1] * n, [-1] * n, [-1] * n
        for i in range(1, n):
            p = parents[i]
            if first[p] < 0:
                first[p] = i
            else:
                sibling[last[p]] = i
            last[p] = i
        rows = self._rows(n)
        rows.zero_()
        toks = torch.tensor(tokens, dtype=torch.long)
        toks[0] = 0  # the root's token is already accepted by the matcher: not read
        self.matcher.traverse_draft_tree(torch.tensor(first, dtype=torch.long), torch.tensor(sibling, dtype=torch.long), toks, rows)
        rows[~rows.any(-1)] = -1  # unreachable or final nodes: nothing masked (see above)
        return rows

    def mask_tree(self, tree, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Mask the target's ``logits`` [n, V] over ``tree`` in place (one bitmask for all nodes;
        ``rows``: the tree's bitmask when already computed, :meth:`allowed`)."""
        t0 = time.perf_counter()
        if rows is None:
            parents, tokens = torch.stack([tree.parents, tree.tokens]).tolist()
            rows = self.tree_masks(parents, tokens)
        self._apply(logits, rows)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_calls += 1
        return logits

    def allowed(self, tree) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The nodes of ``tree`` the grammar allows, and their bitmask rows (for :meth:`mask_tree`).

        A node whose token, or an ancestor's, the grammar forbids can never be accepted (p = 0 at its
        parent under any verifier): verifying it costs a row and gains nothing. Returns (``keep``, the
        sorted indices of the other nodes, the root among them and closed under ancestors, or None
        when every node is allowed; the bitmask rows [len(keep) or n, ceil(V / 32)] of the kept nodes,
        each its node's own mask, as :meth:`tree_masks` computes them). One walk of the tree."""
        t0 = time.perf_counter()
        parents, tokens = torch.stack([tree.parents, tree.tokens]).tolist()
        rows = self.tree_masks(parents, tokens).clone()
        keep = None
        if len(parents) > 1:
            tok, par = tree.tokens[1:].cpu(), tree.parents[1:].cpu()
            legal = torch.ones(len(parents), dtype=torch.bool)
            legal[1:] = ((rows[par, tok // 32] >> (tok % 32)) & 1).bool()  # the token's bit in its parent's mask
            ok = ~(tree.ancestors.cpu() & ~legal).any(-1)  # the whole root path allowed
            if not bool(ok.all()):
                keep = ok.nonzero().squeeze(1)
                rows = rows[keep]
        self.mask_seconds += time.perf_counter() - t0
        return (keep.to(tree.tokens.device) if keep is not None else None), rows

    # -- forced continuation (the ``grammar`` candidate source) ---------------------------------
    def forced_string(self) -> str:
        """The text the grammar allows as the only continuation here (jump-forward), or ''."""
        if self.matcher.is_terminated():
            return ""
        return self.matcher.find_jump_forward_string()

    def forced_tokens(self, mode: str = "canonical", limit: int = 16) -> list[int]:
        """Tokens drafting the forced continuation, each checked by a forked matcher.

        ``canonical``: the tokenizer's own encoding of the jump-forward string, cut before the
        first token the grammar rejects and before a last token that is a strict prefix of a
        longer vocabulary token (the target would likely merge it with what follows);
        ``greedy``: xgrammar's ``find_jump_forward_tokens`` (longest vocabulary match first);
        ``single``: only tokens that are the one legal token at their position (checked with
        the bitmask), following them as long as that holds."""
        if self.matcher.is_terminated() or limit < 1:
            return []
        if mode == "single":
            return self._single_tokens(limit)
        if mode == "greedy":
            ids = list(self.matcher.find_jump_forward_tokens())
        else:
            text = self.matcher.find_jump_forward_string()
            if not text:
                return []
            ids = list(self.backend.tokenizer.encode(text, add_special_tokens=False))
            if ids and _strict_prefix_of_longer(self.backend, ids[-1]):
                ids = ids[:-1]
        if not ids:
            return []
        m = self.matcher.fork()
        out = []
        for t in ids[:limit]:
            if not m.accept_token(int(t)):
                break
            out.append(int(t))
        return out

    def _single_tokens(self, limit: int) -> list[int]:
        m = self.matcher.fork()
        row = self._rows(1)
        out: list[int] = []
        while len(out) < limit and not m.is_terminated():
            m.fill_next_token_bitmask(row, 0)
            bits = row[0]
            nz = torch.nonzero(bits).flatten()
            if nz.numel() != 1:
                break
            word = int(nz[0])
            value = int(bits[word]) & 0xFFFFFFFF
            if value & (value - 1):  # more than one bit set
                break
            tok = word * 32 + value.bit_length() - 1
            if tok in m.stop_token_ids or not m.accept_token(tok):
                break
            out.append(tok)
        return out


def _strict_prefix_of_longer(backend: GrammarBackend, token: int) -> bool:
    """Whether the decoded ``token`` is a strict prefix of some longer vocabulary token."""
    decoded = backend.decoded[token]
    return isinstance(decoded, bytes) and decoded in backend.prefixes


# -- the same format for an OpenAI-compatible server (SGLang) ----------------------------------------
def openai_response_format(fmt: ResponseFormat) -> dict[str, Any]:
    """The OpenAI chat-completions ``response_format`` body for ``fmt`` (what a client of
    ``adaptivespec serve``'s SGLang server sends); regex and EBNF have no OpenAI form: SGLang reads
    them as the extra request fields of :func:`sglang_sampling_params`."""
    if fmt.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt.schema}}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    raise ResponseFormatError(f"generation.response_format: type {fmt.type} has no OpenAI response_format; "
                              "send it as SGLang's sampling parameter (sglang_sampling_params)")


def sglang_sampling_params(fmt: ResponseFormat) -> dict[str, str]:
    """SGLang's constrained-decoding sampling parameters for ``fmt`` (one of ``json_schema``,
    ``regex``, ``ebnf``), for ``--preferred-sampling-params`` or a request's ``sampling_params``."""
    if fmt.type == "json_schema":
        return {"json_schema": json.dumps(fmt.schema)}
    if fmt.type == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if fmt.type == "regex":
        return {"regex": fmt.pattern}
    return {"ebnf": fmt.grammar}


def served_format(fmt: ResponseFormat | None) -> dict[str, Any]:
    """The request fields of ``fmt`` for ``adaptivespec serve``'s OpenAI endpoints: ``response_format``
    (JSON schema, any JSON object) or the ``regex`` / ``ebnf`` extra fields; none for None."""
    if fmt is None:
        return {}
    if fmt.type in ("json_schema", "json_object"):
        return {"response_format": openai_response_format(fmt)}
    return sglang_sampling_params(fmt)


def llama_server_format(fmt: ResponseFormat | None) -> dict[str, Any]:
    """The request field of ``fmt`` for llama.cpp's ``llama-server`` (``/completion``'s ``json_schema``;
    JSON schemas and any JSON object only: its GBNF grammars are not EBNF, and it has no regex)."""
    if fmt is None:
        return {}
    if fmt.type not in ("json_schema", "json_object"):
        raise ResponseFormatError(f"llama-server: a {fmt.type} response format has no llama-server form here "
                                  "(JSON schemas only)")
    return {"json_schema": fmt.schema if fmt.type == "json_schema" else {}}
