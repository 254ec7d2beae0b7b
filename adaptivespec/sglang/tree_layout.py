"""Any token tree laid out as SGLang's verify reads it. No sglang import.

SGLang's EAGLE worker builds its verify input from the head's beam (``build_tree_kernel_efficient``);
its NGRAM worker shows that the same verify forward and ``verify_tree_greedy`` kernel take any tree
given as a tree mask, positions and ``retrieve_*`` arrays. This module computes those arrays for
trees given by parent indices, so a tree merged from the head and candidate sources
(:mod:`adaptivespec.sglang.draft_stage`) verifies in one target forward. For a tree SGLang built
itself it reproduces SGLang's own arrays (``tests/test_sglang_tree_layout.py``).

Per request ``b`` of ``width`` nodes (node 0 the root, the last committed token; a node's parent
precedes it; a node with parent -1 other than the root is padding, never reachable, never
accepted)::

    mask[b, i, j]                # node i attends to node j (j is i or an ancestor of i)
    positions[b, i]              # seq_lens[b] + depth of node i (padding: depth 0)
    retrieve_index[b, i]         # b * width + i
    retrieve_next_token[b, i]    # first child of node i (-1: none)
    retrieve_next_sibling[b, i]  # next sibling of node i in node order (-1: none)
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from adaptivespec.sglang.verification import retrieve_from_parents


@attrs.frozen(kw_only=True)
class VerifyLayout:
    """The verify arrays of ``bs`` trees of ``width`` nodes each (see the module docstring)."""

    custom_mask: torch.Tensor
    """QLEN layout: ``[bs * width * width]`` bool; FULL layout: per request ``[width, seq_len + width]``
    (the committed prefix visible), flattened and concatenated."""
    positions: torch.Tensor  # [bs * width] int64
    retrieve_index: torch.Tensor  # [bs, width] int64
    retrieve_next_token: torch.Tensor  # [bs, width] int64
    retrieve_next_sibling: torch.Tensor  # [bs, width] int64
    depth: int
    """Deepest reachable node below the root (the verify's ``spec_steps``)."""

    def to(self, device) -> "VerifyLayout":
        """The arrays on ``device`` (a layout is built on the host, where the trees are, and moved once)."""
        return attrs.evolve(self, **{f: getattr(self, f).to(device) for f in
                                     ("custom_mask", "positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")})


def ancestor_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, depth)`` of trees given by ``parents`` [bs, width]: ``mask[b, i, j]`` when j is i or
    an ancestor of i, ``depth[b, i]`` the number of i's ancestors. One gather per tree level."""
    bs, width = parents.shape
    device = parents.device
    mask = torch.eye(width, dtype=torch.bool, device=device).expand(bs, width, width).clone()
    depth = torch.zeros(bs, width, dtype=torch.long, device=device)
    ptr = parents.clone()
    rows = torch.arange(width, device=device).expand(bs, width)
    batch = torch.arange(bs, device=device)[:, None].expand(bs, width)
    for _ in range(width):
        valid = ptr >= 0
        if not bool(valid.any()):
            break
        mask[batch[valid], rows[valid], ptr[valid]] = True
        depth += valid.long()
        ptr = torch.where(valid, parents.gather(1, ptr.clamp(min=0)), ptr)
    return mask, depth


def verify_layout(parents: torch.Tensor, seq_lens: torch.Tensor, *, full_mask: bool = False,
                  seq_lens_host: Sequence[int] | None = None) -> VerifyLayout:
    """The verify arrays of the trees ``parents`` [bs, width] (int64, ``parents[:, 0] == -1``, each
    node after its parent) on top of sequences of ``seq_lens`` [bs] committed tokens, on their
    device (build on the host, then :meth:`VerifyLayout.to`: the checks and the per-level loop read
    values).

    ``full_mask``: SGLang's FULL_MASK layout (GPU attention backends), which needs the sequence
    lengths on the host (``seq_lens_host``, else read from ``seq_lens``); otherwise QLEN_ONLY (the
    CPU backend's)."""
    bs, width = parents.shape
    if bs and bool((parents[:, 0] != -1).any()):
        raise ValueError("parents: node 0 of every tree is the root (parent -1)")
    later = parents >= torch.arange(width, device=parents.device)
    if bool(later.any()):
        raise ValueError("parents: every node must come after its parent")
    mask, depth = ancestor_mask(parents)
    positions = (seq_lens.to(torch.long)[:, None] + depth).reshape(-1)
    index, next_token, next_sibling = retrieve_from_parents(parents)
    if full_mask:
        lens = list(seq_lens_host) if seq_lens_host is not None else seq_lens.tolist()
        blocks = [torch.cat([torch.ones(width, int(n), dtype=torch.bool, device=mask.device), mask[b]], dim=1).reshape(-1)
                  for b, n in enumerate(lens)]
        custom_mask = torch.cat(blocks) if blocks else mask.reshape(-1)
    else:
        custom_mask = mask.reshape(-1)
    return VerifyLayout(custom_mask=custom_mask, positions=positions, retrieve_index=index,
                        retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
                        depth=int(depth.max()) if depth.numel() else 0)
