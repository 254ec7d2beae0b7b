"""An incremental n-gram index over token sequences, and the continuation tries built from it
(the algorithm of the ``retrieval`` source; the trie is :class:`~adaptivespec.types.CandidateTrie`).

Why an n-gram table and not a suffix automaton: both extend in O(1) per token, but a lookup here
needs every recent occurrence of the matched suffix (for counts), which an automaton only gives
through an end-position walk, while a dict from each n-gram (``1 <= n <= max_n``) to the positions
that follow it gives them directly; matches longer than ``max_n`` (which only an automaton finds)
add little once the continuation is verified anyway. Appending a token costs ``max_n`` dict
inserts; a lookup ``<= max_n`` dict probes plus a walk over at most ``max_occurrences``
continuations, independent of the context length: a whole retrieval step (extend, propose, learn)
measured ~40 us median at 4k tokens of context (tests/benchmarks/test_perf_retrieval.py, a
contended 2-core machine), against a 1 ms target. An automaton was not built to compare.

Terms: an *occurrence* of a suffix ``s`` (its last ``m`` tokens) is a position ``j`` with
``tokens[j - m:j] == s`` and ``j < len(tokens)``: ``tokens[j:]`` is a real continuation.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

from adaptivespec.api import CandidateTrie


def build_trie(continuations: Iterable[tuple[Sequence[int], int]], max_nodes: int) -> CandidateTrie:
    """Merge ``(continuation, match_length)`` pairs into a trie of at most ``max_nodes`` nodes.

    Every node counts the continuations through it. When more nodes exist than ``max_nodes``, the
    kept ones are the most frequent, ties broken by shallower then earlier (ancestors always kept:
    a parent counts at least as many continuations as any child).
    """
    key: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    match: list[int] = []
    depth: list[int] = []
    total = 0
    for cont, m in continuations:
        total += 1
        parent = -1
        for t in cont:
            i = key.get((parent, t))
            if i is None:
                i = key[(parent, t)] = len(tokens)
                tokens.append(t), parents.append(parent), counts.append(0), match.append(m)
                depth.append(1 if parent < 0 else depth[parent] + 1)
            counts[i] += 1
            if m > match[i]:
                match[i] = m
            parent = i
    n = len(tokens)
    if n > max_nodes:
        keep = sorted(sorted(range(n), key=lambda i: (-counts[i], depth[i], i))[:max_nodes])
        remap = {-1: -1, **{old: new for new, old in enumerate(keep)}}
        tokens = [tokens[i] for i in keep]
        parents = [remap[parents[i]] for i in keep]
        counts = [counts[i] for i in keep]
        match = [match[i] for i in keep]
    return CandidateTrie(tokens=tokens, parents=parents, counts=counts, match=match,
                         scores=[0.0] * len(tokens), total=total)


class NGramIndex:
    """Positions following every n-gram (``n <= max_n``) of a growing token sequence.

    ``separator`` tokens (e.g. between concatenated documents) end continuations and are never
    part of a matched n-gram.
    """

    def __init__(self, max_n: int = 8, separator: int | None = None) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be a positive integer, got {max_n!r}")
        self.max_n = max_n
        self.separator = separator
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self._run = 0  # tokens since the last separator

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens``; each new n-gram records the position right after it."""
        seq, table, sep = self.tokens, self.table, self.separator
        for t in tokens:
            seq.append(t)
            if t == sep:
                self._run = 0
                continue
            self._run += 1
            end = len(seq)
            for n in range(1, min(self.max_n, self._run) + 1):
                key = tuple(seq[end - n : end])
                hit = table.get(key)
                if hit is None:
                    table[key] = [end]
                else:
                    hit.append(end)

    def occurrences(self, suffix: Sequence[int], min_n: int = 1, limit: int = 8) -> tuple[int, list[int]]:
        """Longest match ``m`` of ``suffix``'s tail (``min_n <= m <= max_n``) that occurs here.

        Returns ``(m, positions)``: the most recent ``limit`` positions ``j < len(self)`` with
        ``tokens[j - m:j] == suffix[-m:]``, oldest first; ``(0, [])`` when not even ``min_n`` matches.
        """
        end = len(self.tokens)
        best, best_pos = 0, []
        top = min(self.max_n, len(suffix))
        for n in range(1, top + 1):
            key = tuple(suffix[len(suffix) - n :])
            if self.separator is not None and self.separator in key:
                break
            hit = self.table.get(key)
            if hit is None:
                break
            # the last entry may be the suffix itself (no continuation yet): skip j == end
            pos = [j for j in hit[-(limit + 1) :] if j < end][-limit:]
            if self.separator is not None:  # an n-gram that ended a document has no continuation
                pos = []
                for j in reversed(hit):
                    if j < end and self.tokens[j] != self.separator:
                        pos.append(j)
                        if len(pos) == limit:
                            break
                pos.reverse()
            if not pos:
                break
            best, best_pos = n, pos
        if best < min_n:
            return 0, []
        return best, best_pos

    def continuation(self, j: int, depth: int) -> list[int]:
        """``tokens[j:j + depth]``, cut before a separator."""
        cont = self.tokens[j : j + depth]
        if self.separator is not None and self.separator in cont:
            cont = cont[: cont.index(self.separator)]
        return cont


class OutputCache:
    """A bounded index of earlier outputs, each tagged with the prompt it answered.

    Lookups for a prompt skip that prompt's own earlier outputs (a repeat must not be drafted from
    its own answer). When the tokens held exceed ``max_tokens`` the oldest outputs are dropped and
    the index rebuilt (once per finished generation, never per step).
    """

    SEP = -1

    def __init__(self, max_tokens: int, max_n: int = 8) -> None:
        self.max_tokens, self.max_n = max_tokens, max_n
        self.entries: list[tuple[int, list[int]]] = []  # (prompt key, output ids)
        self._rebuild()

    def _rebuild(self) -> None:
        self.index = NGramIndex(self.max_n, separator=self.SEP)
        self.starts: list[int] = []
        self.keys: list[int] = []
        for key, ids in self.entries:
            self.starts.append(len(self.index))
            self.keys.append(key)
            self.index.extend(ids)
            self.index.extend([self.SEP])

    def add(self, prompt_key: int, output: Sequence[int]) -> None:
        if not output or self.max_tokens <= 0:
            return
        self.entries.append((prompt_key, list(output)[-self.max_tokens :]))
        held = sum(len(ids) for _, ids in self.entries)
        dropped = False
        while held > self.max_tokens and len(self.entries) > 1:
            held -= len(self.entries.pop(0)[1])
            dropped = True
        if dropped:
            self._rebuild()
        else:
            key, ids = self.entries[-1]
            self.starts.append(len(self.index))
            self.keys.append(key)
            self.index.extend(ids)
            self.index.extend([self.SEP])

    def clear(self) -> None:
        self.entries = []
        self._rebuild()

    def owner(self, j: int) -> int:
        return self.keys[bisect.bisect_right(self.starts, j) - 1]

    def occurrences(self, suffix: Sequence[int], prompt_key: int, min_n: int, limit: int) -> tuple[int, list[int]]:
        m, pos = self.index.occurrences(suffix, min_n, limit)
        pos = [j for j in pos if self.owner(j) != prompt_key]
        return (m, pos) if pos else (0, [])
