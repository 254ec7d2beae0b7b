"""A verify tree in llama.cpp's unified KV cache: the sequences of its nodes, and the commit.

llama.cpp has no tree attention mask; it has sequences. A token sees the cells of its (first)
sequence at positions up to its own. So a tree verifies in one ``llama_decode`` when every leaf
gets a sequence of its own that holds the committed context, and every node belongs to the
sequences of the leaves below it: a node then sees the context and exactly its ancestors.
Worked example (P = 7 committed positions on seq 0; the tree t0 -> a -> c, t0 -> b)::

    node      t0      a      b      c        leaves: b -> seq 1, c -> seq 2
    position  P       P+1    P+1    P+2      (P + depth)
    seqs      [1, 2]  [2]    [1]    [2]      (the leaves below each node)

Cells and summation order. llama.cpp's CPU flash attention walks the cells in cell order, skipping
masked ones, so a row's result depends only on the *order* of the cells it sees. A decode puts its
tokens in the free cells from the cache's ``head`` in batch order; parents come before children
in a tree's rows, so an accepted path's cells are in position order. What would break it is a
freed cell *below* the last accepted one: ``seq_rm`` moves ``head`` back to it and the next token
would land there, before cells of earlier positions (the next row's logits then differ in the
last bits from one-by-one decoding: a near tie can flip). So the commit

* joins the accepted path's cells to seq 0,
* *parks* the rejected cells that lie below the last accepted one in :data:`PARKED` (a sequence
  that never decodes: its cells stay taken and no token sees them),
* frees the rejected cells above it (``head`` then moves to the first of them, past every kept cell),

and seq 0's cells stay in position order. Parked cells pile up (the rejected nodes listed before
the accepted path's last); when the cache would overflow, :meth:`TreeCells.compact` rewrites seq 0's
cells contiguously (``llama_state_seq_get_data`` / ``set_data``: a copy of its K and V) and
drops the parked ones.
"""

from __future__ import annotations

import attrs
import numpy as np

from adaptivespec.types import DraftTree

COMMITTED = 0
"""The committed context's sequence."""
PARKED = 1
"""Rejected cells kept taken (see the module docstring); never decoded, never seen."""
FIRST_LEAF = 2
"""Leaf sequences are FIRST_LEAF, FIRST_LEAF + 1, ...: at most ``n_seq_max - FIRST_LEAF`` leaves a tree."""


@attrs.frozen(kw_only=True)
class TreeRows:
    """One tree as llama.cpp's batch reads it."""

    tokens: np.ndarray  # [n] int32, tree order (parents before children)
    positions: np.ndarray  # [n] int32, P + depth
    seqs: list[list[int]]  # [n] the sequences of the leaves below each node
    leaf_of: np.ndarray  # [n] int: the sequence of one leaf below each node
    leaf_seqs: list[int]  # every leaf's sequence
    leaf_paths: np.ndarray  # [L, n] bool: node j is on leaf sequence l's root path


def tree_rows(tree: DraftTree, P: int) -> TreeRows:
    """The batch rows of ``tree`` below ``P`` committed positions (see the module docstring)."""
    anc = tree.ancestors.cpu().numpy()  # [n, n]: anc[i, j] = j is i or an ancestor of i
    leaves = np.flatnonzero(anc.sum(0) == 1)  # no node but itself has it as an ancestor
    seq = {int(l): FIRST_LEAF + k for k, l in enumerate(leaves)}
    below = anc[leaves]  # [L, n]: node j is on leaf l's root path
    seqs = [[seq[int(l)] for l in leaves[below[:, j]]] for j in range(anc.shape[0])]
    return TreeRows(tokens=tree.tokens.cpu().numpy().astype(np.int32),
                    positions=(P + tree.depth.cpu().numpy()).astype(np.int32), seqs=seqs,
                    leaf_of=np.array([s[0] for s in seqs]), leaf_seqs=[seq[int(l)] for l in leaves], leaf_paths=below)


class TreeCells:
    """The cache bookkeeping of the runtime's context: how many cells seq 0 and the parked cells take."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.parked = 0
        """Cells parked since the last compaction."""
        self.compactions = 0

    def reset(self) -> None:
        self.ctx.clear()
        self.parked = 0

    def room(self, P: int, rows: int) -> None:
        """Make room for ``rows`` new cells after ``P`` committed ones (compacting when needed)."""
        if P + self.parked + rows > self.ctx.n_ctx and self.parked:
            self.compact()
        if P + rows > self.ctx.n_ctx:
            raise ValueError(f"the context of {self.ctx.n_ctx} cells cannot hold {P} positions and {rows} new rows")

    def compact(self) -> None:
        """seq 0's cells rewritten contiguously from cell 0, the parked ones dropped."""
        data = self.ctx.save_seq(COMMITTED)
        self.ctx.clear()
        self.ctx.load_seq(data, COMMITTED)
        self.parked = 0
        self.compactions += 1

    def open(self, rows: TreeRows) -> None:
        """Before the tree's decode: every leaf sequence holds the committed context."""
        for s in rows.leaf_seqs:
            self.ctx.seq_cp(COMMITTED, s)

    def commit(self, rows: TreeRows, path: list[int], P: int) -> None:
        """After it: seq 0 = context + the accepted ``path`` (node indices from the root); the
        rejected cells below the path's last parked, those above it freed; the leaf sequences empty."""
        last, kept = path[-1], len(path)
        self.ctx.seq_cp(int(rows.leaf_of[last]), COMMITTED, P, P + kept)  # that leaf's first `kept` nodes: the path
        n = len(rows.tokens)
        before = np.arange(n) < last  # rows listed before the path's last (their cells lie below its cell)
        for l, s in enumerate(rows.leaf_seqs):
            depth_before = int((rows.leaf_paths[l] & before).sum())  # a root path's rows ascend: a prefix of it
            if depth_before:
                self.ctx.seq_cp(s, PARKED, P, P + depth_before)
            self.ctx.seq_rm(s)
        on_path = np.zeros(n, dtype=bool)
        on_path[path] = True
        self.parked += int((before & ~on_path).sum())
