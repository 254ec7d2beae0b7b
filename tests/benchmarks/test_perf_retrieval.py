"""Per-step cost of the retrieval source at 4k tokens of context (target: < 1 ms on this CPU).

One step = extend the index with the step's emitted tokens, propose a trie (with scores), learn
from the target's tokens. The context is token ids drawn like text (Zipf-distributed, with copied
spans) so that frequent n-grams have many occurrences, the expensive case for a lookup.
"""

from __future__ import annotations

import random

import pytest

from adaptivespec.sources.retrieval import RetrievalParams, RetrievalSource


def text_like(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(5000)]
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.3:  # copy an earlier span
            j = rng.randrange(len(out))
            out += out[j : j + rng.randint(3, 20)]
        else:
            out += rng.choices(range(5000), weights, k=rng.randint(3, 20))
    return out[:n]


@pytest.mark.parametrize("context", [512, 4096])
def test_retrieval_step(benchmark, context):
    benchmark.group = "retrieval source step (extend 3 tokens + propose + observe)"
    stream = text_like(context + 30_000)
    src = RetrievalSource(RetrievalParams())
    src.reset(stream[:context])
    pos = [context]

    def step():
        i = pos[0]
        trie = src.propose()
        if trie is not None:
            src.observe(trie, stream[i : i + 3])
        src.extend(stream[i : i + 3])
        pos[0] = i + 3

    benchmark.pedantic(step, rounds=2000, iterations=1, warmup_rounds=50)


def test_fuse_head_and_trie(benchmark):
    """Fusion of an 8-node head tree (EAGLE-3's (4,4,8)) with a 16-node trie into 16 verify slots."""
    import torch

    from adaptivespec.fusion import fuse
    from adaptivespec.sources.ngram import build_trie
    from adaptivespec.tree import make_tree
    from adaptivespec.types import TreeShape

    benchmark.group = "fusion (head tree + retrieval trie -> one verify tree)"
    shape = TreeShape(4, 4, 8)
    head = make_tree([0, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 1, 1, 3, 5, 6], shape,
                     torch.log(torch.tensor([1.0, 0.6, 0.2, 0.4, 0.1, 0.3, 0.2, 0.1])))
    rng = random.Random(0)
    trie = build_trie([([1, 3] + [rng.randrange(6) for _ in range(6)], 3) for _ in range(8)], 16)
    trie.scores = [0.5 ** (d + 1) for d in trie.depths()]
    benchmark(lambda: fuse(9, 16, shape, head, candidates=[trie]))
