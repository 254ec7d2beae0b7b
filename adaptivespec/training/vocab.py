"""Draft vocabulary: the ``N`` most frequent target tokens of the (self-distilled) responses.

Coverage of a size-N vocabulary is ``sum of the N largest counts / total response tokens``:
the fraction of response positions whose next token the head can propose at all. Its cost is
the lm_head, ``N * H`` weights (``2 N H`` bytes in bf16) and ``N * H`` MACs per draft node.
"""

from __future__ import annotations

import torch

from adaptivespec.training.data import Record


def token_counts(records: list[Record], vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of response tokens."""
    flat = torch.cat([torch.tensor(r.response_ids, dtype=torch.long) for r in records] or [torch.zeros(0, dtype=torch.long)])
    return torch.bincount(flat, minlength=vocab_size)


def top_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` most frequent ids (ties by smaller id), sorted ascending (as ``set_vocab`` wants)."""
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep id order
    return torch.sort(order[:n]).values


def coverage_table(counts: torch.Tensor, sizes: list[int], hidden: int) -> list[dict]:
    """Rows {n, coverage, lm_head_mb (bf16)} for each vocabulary size."""
    total = int(counts.sum())
    ranked = torch.sort(counts, descending=True).values.cumsum(0)
    rows = []
    for n in sizes:
        n = min(n, counts.numel())
        rows.append({"n": n, "coverage": float(ranked[n - 1]) / max(total, 1), "lm_head_mb": 2 * n * hidden / 1e6})
    rows.append({"n": "distinct", "coverage": 1.0, "count": int((counts > 0).sum())})
    return rows


def coverage_by_kind(records: list[Record], ids: torch.Tensor, kind_of) -> dict[str, dict]:
    """Per kind of record (``kind_of(record.id)``): response tokens and the fraction inside ``ids``."""
    out: dict[str, list[int]] = {}
    for r in records:
        t = torch.tensor(r.response_ids, dtype=torch.long)
        c = out.setdefault(kind_of(r.id), [0, 0])
        c[0], c[1] = c[0] + t.numel(), c[1] + int(torch.isin(t, ids).sum())
    return {k: {"tokens": n, "coverage": hit / max(n, 1)} for k, (n, hit) in sorted(out.items())}
