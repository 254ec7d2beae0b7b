"""An adaptivespec verifier on SGLang's verify inputs. No sglang import.

SGLang's tree layout (``build_tree_kernel_efficient`` in ``sglang/srt/speculative/eagle_utils.py``,
kernel ``sglang/kernels/ops/speculative/spec_tree.py``), per request ``b`` of a verify batch of
``ndt`` tokens each::

    candidates[b, i]             # token of node i; node 0 is the root (the last committed token)
    retrieve_index[b, i]         # b * ndt + i: the node's row in predict / logits
    retrieve_next_token[b, i]    # first child of node i (-1: a leaf)
    retrieve_next_sibling[b, i]  # next sibling of node i (-1: the last one)

Children are chained in increasing node order and a parent precedes its children. The greedy
verifier (``verify_tree_greedy_func``) walks this tree and writes::

    predict[bs * ndt]            # int32; at each accepted node's row, the token emitted after it
    accept_index[bs, nsteps + 1] # int32; rows of the accepted path, root first, -1 padded
    accept_lens[bs]              # int32; accepted drafted tokens + 1 (the bonus token)

so that the emitted tokens are ``predict[accept_index]``.
"""

from __future__ import annotations

import contextvars
from typing import Any, Sequence

import attrs
import torch

from adaptivespec.strategies import Verifier
from adaptivespec.tree import make_tree
from adaptivespec.types import TreeShape

VERIFYING: contextvars.ContextVar[Any] = contextvars.ContextVar("adaptivespec_verifying", default=None)
"""The worker whose verify is running, when its verifier replaces SGLang's (read by the
``eagle_sample`` hook in :mod:`adaptivespec.sglang.plugin`)."""


@attrs.frozen(kw_only=True)
class SGLangVerifyOutput:
    """What ``eagle_sample`` returns, plus what the controller records."""

    predict: torch.Tensor  # [bs * ndt] int32; at each accepted node's row, the token emitted after it
    accept_lens: torch.Tensor  # [bs] int32; accepted drafted tokens + 1 (bonus)
    accept_index: torch.Tensor  # [bs, nsteps + 1] int32; rows of the accepted path, -1 padded
    accepted: tuple[int, ...]  # per request: accepted drafted tokens
    promoted: tuple[int, ...]  # per request: accepted tokens that are not the target's greedy choice

    @property
    def num_correct_drafts(self) -> torch.Tensor:
        """SGLang's name for ``accept_lens - 1``."""
        return self.accept_lens - 1


def parents_from_retrieve(next_token: Sequence[int], next_sibling: Sequence[int]) -> list[int]:
    """Parent of every node of one request's tree (-1 for the root and for unreachable nodes)."""
    n = len(next_token)
    parents = [-1] * n
    for p in range(n):
        child = next_token[p]
        hops = 0
        while child != -1 and hops < n:
            parents[child] = p
            child = next_sibling[child]
            hops += 1
    return parents


def retrieve_from_parents(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``(retrieve_index, retrieve_next_token, retrieve_next_sibling)`` of trees given by
    parent indices ``parents`` [bs, ndt] (``parents[:, 0] == -1``, topologically ordered; another
    node with parent -1 is unreachable): children chained in increasing node order, as
    ``build_tree_kernel_efficient`` leaves them. On ``parents``' device, no loop over nodes."""
    bs, n = parents.shape
    device = parents.device
    nodes = torch.arange(n, device=device)
    none = torch.full((), n, device=device)
    child = parents[:, None, :] == nodes[None, :, None]  # [b, p, i]: node i is a child of node p
    first_child = torch.where(child, nodes, none).min(dim=2).values
    # [b, i, j]: j > i shares i's (real) parent
    same = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0) & (nodes[None, :] > nodes[:, None])
    next_sibling = torch.where(same, nodes, none).min(dim=2).values
    index = torch.arange(bs * n, dtype=torch.long, device=device).reshape(bs, n)
    return index, torch.where(first_child == n, -1, first_child), torch.where(next_sibling == n, -1, next_sibling)


def wrap_verify(
    verifier: Verifier,
    *,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    logits: torch.Tensor,
    spec_steps: int,
    topk: int,
) -> SGLangVerifyOutput:
    """Verify SGLang-laid-out trees with an adaptivespec verifier; outputs as ``eagle_sample``'s.

    ``candidates`` / ``retrieve_*``: [bs, ndt] (``EagleVerifyInput.draft_token`` reshaped, and its
    ``retrieve_*`` fields); ``logits``: [bs * ndt, V] target logits of every node, after SGLang's
    penalties and grammar mask; ``spec_steps`` / ``topk``: the step's ``nsteps`` / ``topk``.
    The tree structure crosses to the host once; each request's verifier call works on its own
    slice of ``logits`` (on their device). Nodes SGLang left without a parent are never accepted.
    """
    bs, ndt = candidates.shape
    if logits.shape[0] != bs * ndt:
        raise ValueError(f"logits: expected {bs * ndt} rows (bs={bs} x ndt={ndt}), got {logits.shape[0]}")
    shape = TreeShape(spec_steps, topk, ndt)
    device = logits.device
    host = torch.stack([candidates.long(), retrieve_index.long(), retrieve_next_token.long(), retrieve_next_sibling.long()]).cpu()
    tokens_h, index_h, next_h, sib_h = (t.tolist() for t in host)
    rows = logits.view(bs, ndt, -1)

    set_rows: list[int] = []
    set_tokens: list[int] = []
    accept_index = torch.full((bs, spec_steps + 1), -1, dtype=torch.int32)
    accepted, promoted = [], []
    for b in range(bs):
        parents = parents_from_retrieve(next_h[b], sib_h[b])
        keep, reachable = [0], {0}  # reachable nodes in node order; parents precede children
        for i in range(1, ndt):
            if parents[i] >= i:
                raise ValueError(f"request {b}: node {i} has parent {parents[i]}; SGLang trees list parents first")
            if parents[i] in reachable:
                keep.append(i)
                reachable.add(i)
        slot = {node: k for k, node in enumerate(keep)}
        tree = make_tree(
            torch.tensor([tokens_h[b][i] for i in keep], device=device),
            torch.tensor([-1] + [slot[parents[i]] for i in keep[1:]], device=device),
            shape,
        )
        keep_t = torch.tensor(keep, device=device)
        result = verifier.verify(tree, rows[b].index_select(0, keep_t))
        if len(result.path) > spec_steps + 1 or len(result.tokens) != len(result.path):
            raise ValueError(f"{verifier.name}: path of {len(result.path)} nodes in a tree of depth {spec_steps}")
        path = [keep[k] for k in result.path]
        for j, node in enumerate(path):
            accept_index[b, j] = index_h[b][node]
            set_rows.append(index_h[b][node])  # predict at a node = the token emitted after it
            set_tokens.append(result.tokens[j])
        accepted.append(len(path) - 1)
        promoted.append(int(result.promoted))

    predict = torch.zeros(bs * ndt, dtype=torch.int32, device=device)
    predict[torch.tensor(set_rows, device=device)] = torch.tensor(set_tokens, dtype=torch.int32, device=device)
    return SGLangVerifyOutput(
        predict=predict,
        accept_lens=torch.tensor(accepted, dtype=torch.int32, device=device) + 1,
        accept_index=accept_index.to(device),
        accepted=tuple(accepted),
        promoted=tuple(promoted),
    )
