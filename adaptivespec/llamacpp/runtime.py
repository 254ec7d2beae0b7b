"""The ``llamacpp`` runtime: the target's forwards through llama.cpp on a GGUF file, the EAGLE-3
head in torch.

The same four operations as :class:`~adaptivespec.runtime.TorchRuntime`, and the same state
between steps (``P`` = tokens the target has processed)::

    KV cache (seq 0)  positions [0, P), in position order (cells.py)
    root              the last emitted token, at position P, not yet run through the target
    head's cache      positions [0, P): position i holds (embed(token[i+1]), state[i])
    root_state        the head's output at P-1; root_logp its draft distribution of token P+1

* :meth:`LlamaCppRuntime.prefill` -- the prompt in ``llama_decode`` calls of up to ``n_batch``
  tokens, the head's three layer inputs read after each (lid = head layer + 1) and run through it.
* :meth:`~LlamaCppRuntime.ar_step` -- one token, one decode: plain decoding through llama.cpp. With
  a head, the step's feature rows wait (``pending``) and the head catches up on all of them in one
  forward when it next drafts (:meth:`~LlamaCppRuntime.catch_up`): a policy's plain steps
  (``TreePolicy.plain_next``, ``defers_head``) cost what plain decoding costs.
* :meth:`~LlamaCppRuntime.draft` -- the head drafts in torch, exactly as on the torch runtime.
* :meth:`~LlamaCppRuntime.verify_forward` -- the whole tree in ONE ``llama_decode`` (each node in the
  sequences of the leaves below it: :mod:`~adaptivespec.llamacpp.cells`), logits and features of
  every node.
* :meth:`~LlamaCppRuntime.commit` -- seq 0 keeps the accepted path's cells; the head runs the
  accepted pairs from the verify's features.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import adaptivespec
from adaptivespec.fastpath.bank import ShapeBank
from adaptivespec.fastpath.drafter import fast_drafter
from adaptivespec.llamacpp.binding import Context, Model
from adaptivespec.llamacpp.cells import FIRST_LEAF, TreeCells, tree_rows
from adaptivespec.runtime import PREFILL_ROWS_MULTIPLE, LevelMasks, TorchRuntime
from adaptivespec.sampling import root_stats
from adaptivespec.tree import DraftLevels, draft_levels, draft_tree
from adaptivespec.types import DraftTree, TreeShape, VerifyResult

N_BATCH = 512
"""Tokens per ``llama_decode`` (a prompt's chunk; a tree's rows must fit)."""
MAX_SEQUENCES = 256
"""llama.cpp's ``LLAMA_MAX_SEQ``: sequences of one context (two taken, one per leaf of a tree)."""
CONTEXT_SLACK = 1024
"""Cells beyond a generation's positions, for the parked cells of rejected nodes (compacted when full)."""
_MODELS: dict[tuple, tuple] = {}
"""(target, tokenizer, drafter) per (file, head, dtype): several engines of a process share one load."""
_FILES: dict[str, Model] = {}
"""llama.cpp's model of each GGUF file loaded in this process."""


def threads(config) -> int:
    """``runtime.threads``, else the CPUs this process may run on."""
    n = getattr(getattr(config, "runtime", None), "threads", None)
    return n or len(os.sched_getaffinity(0))


def head_dtype(config) -> torch.dtype:
    """The head's dtype: ``runtime.dtype`` (``auto`` resolves to bfloat16 where it is fast, else float32)."""
    from adaptivespec.models import DTYPES

    return DTYPES[config.runtime.dtype]


class LlamaCppRuntime:
    """Prefill, plain steps, tree verification and commit through llama.cpp; the head in torch."""

    name = "llamacpp"
    sampler = None
    """The engine's sampler at temperature > 0 (prefill's first token and :meth:`ar_step` draw with it)."""
    logits_processor = None
    """Changes the next token's logits [V] in place before prefill and :meth:`ar_step` pick (the grammar's mask)."""
    keep_logits = False
    last_rows = None
    defers_head = True
    """:meth:`ar_step` leaves the head's rows for later: the engine may run a policy's plain steps through it."""

    @classmethod
    def load_models(cls, config, host):
        """(target, tokenizer, drafter) for ``config``: the GGUF file's torch side
        (:class:`~adaptivespec.llamacpp.target.GGUFTarget`) and the head; the engine calls this
        instead of loading a transformers target."""
        from adaptivespec.llamacpp.target import load_target

        dtype = head_dtype(config)
        m = config.model
        key = (m.target, m.drafter_kind, m.drafter, dtype)
        if key not in _MODELS:
            target, tok = load_target(m.target, dtype)
            drafter = None
            if m.drafter is not None:
                drafter = host.drafters.get(m.drafter_kind).cls.from_pretrained(m.drafter, target, dtype, "cpu")
            _MODELS[key] = (target, tok, drafter)
        return _MODELS[key]

    def __init__(self, target, drafter=None, config=None) -> None:
        from adaptivespec.llamacpp.target import check_vocab, gguf_path

        if config is not None and config.runtime.device != "cpu":
            from adaptivespec.errors import ConfigError

            raise ConfigError("", "runtime.device", f"the llamacpp runtime runs on the CPU; got {config.runtime.device!r}")
        path = getattr(target, "path", None) or gguf_path(config.model.target)
        self.target, self.drafter = target, drafter
        if str(path) not in _FILES:  # one llama.cpp model per file and process (memory-mapped), shared by the engines
            _FILES[str(path)] = Model(path)
        self.model = _FILES[str(path)]
        if hasattr(target, "config"):
            tok = getattr(target, "tokenizer", None)
            if tok is not None:
                check_vocab(self.model, tok, target.config)
        self.fast_drafter = fast_drafter(drafter)
        self.device = torch.device("cpu")
        self.dtype = drafter.lm_head.weight.dtype if drafter is not None else torch.float32
        self.neg = torch.finfo(self.dtype).min
        self.threads = threads(config)
        self.aux = list(getattr(drafter, "aux_layers", ())) if drafter is not None else []
        self.lids = tuple(a + 1 for a in self.aux)  # the input of layer a + 1 = the output of layer a
        self.ctx: Context | None = None
        self.cells: TreeCells | None = None
        self.bank: ShapeBank | None = None
        self.P = 0
        self.root: torch.Tensor | None = None
        self.root_state: torch.Tensor | None = None
        self.root_logp: torch.Tensor | None = None
        self.rows = None  # the last verify's TreeRows
        self.pending: list = []  # plain steps' (next token, layer inputs, position) the head has not run yet
        self._costs = None

    def describe(self) -> str:
        """``llamacpp <file>, head <dtype>, <n> threads``: what ran, for summary lines."""
        head = f", head {str(self.dtype).removeprefix('torch.')}" if self.drafter is not None else ""
        return f"llamacpp {self.model.path.name}{head}, {self.threads} threads"

    def cost_table(self):
        """This machine's measured step costs on this file (llama.cpp's decode by rows, the head's
        level), for the policies that price steps: read from the cache or measured (~10-20 s) and cached
        (:func:`~adaptivespec.llamacpp.costs.load_or_measure`)."""
        if self._costs is None:
            from adaptivespec.llamacpp.costs import load_or_measure

            self._costs = load_or_measure(self, log=lambda m: print(m, file=sys.stderr, flush=True))
        return self._costs

    # -- buffers ------------------------------------------------------------------------------------
    def prepare(self, shapes, capacity: int = 1024, extra_rows: int = 0) -> ShapeBank:
        """The shape bank (the head's level masks) for every shape the policy may choose."""
        self.bank = ShapeBank(shapes, capacity=capacity, dtype=self.dtype, device=self.device, extra_rows=extra_rows)
        if FIRST_LEAF + self.max_rows() > MAX_SEQUENCES:
            from adaptivespec.errors import ConfigError

            raise ConfigError("", "policy", f"trees of up to {self.max_rows()} rows (ndt plus the sources' extra slots) may "
                              f"have as many leaves, one llama.cpp sequence each; expected at most "
                              f"{MAX_SEQUENCES - FIRST_LEAF} rows on the llamacpp runtime")
        self.ctx = None  # the tree's leaves decide the context's sequences: built again at the next reserve
        return self.bank

    def max_rows(self) -> int:
        return max(s.ndt for s in self.bank.shapes) + self.bank.extra_rows if self.bank is not None else 1

    def reserve(self, positions: int) -> None:
        """A llama.cpp context with room for ``positions`` positions, one tree and the parked cells,
        built once and reused by every generation that fits; the head's cache likewise."""
        rows = self.max_rows()
        n_ctx = -(-(positions + rows + 1 + CONTEXT_SLACK) // 256) * 256
        n_seq = min(MAX_SEQUENCES, FIRST_LEAF + rows)
        if self.ctx is None or self.ctx.n_ctx < n_ctx or self.ctx.n_seq_max < n_seq:
            self.ctx = self.cells = None  # the old cache goes before the new one is taken
            self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=max(N_BATCH, rows), n_seq_max=n_seq,
                               threads=self.threads, layer_inputs=self.lids)
            self.cells = TreeCells(self.ctx)
        if self.bank is not None:
            self.bank.reserve(positions + rows + 1)
        if self.drafter is not None:
            self.drafter.reset_cache(capacity=positions + rows + 1)

    def _hidden(self, n: int) -> tuple:
        """The last decode's layer inputs as transformers' ``hidden_states`` tuple: [1, n, H] float32
        tensors at the head's indices (aux + 1), None elsewhere (copied: the next decode overwrites them)."""
        hidden: list = [None] * (self.model.n_layer + 1)
        for lid in self.lids:
            hidden[lid] = torch.from_numpy(self.ctx.layer_input(lid, n).copy()).to(self.dtype).unsqueeze(0)
        return tuple(hidden)

    # -- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_new_tokens: int = 0) -> int:
        """Run the prompt (chunks of ``n_batch`` tokens, the head following each); the first token."""
        n = len(prompt_ids)
        self.reserve(n + (max_new_tokens or 1024))
        self.cells.reset()
        self.pending = []
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        d = self.drafter
        chunk = self.ctx.n_batch
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            rows = end - start
            keep = np.zeros(rows, dtype=bool)
            keep[-1] = end == n
            self.ctx.decode(ids[start:end].numpy(), np.arange(start, end), None, keep)
            if end == n:
                self.root = self.pick(torch.from_numpy(self.ctx.logits(1)[0].copy()), n)
            if d is not None:
                state = d.fuse(self._hidden(rows))  # [1, rows, H]
                tokens = ids[start + 1 : end + 1] if end < n else torch.cat([ids[start + 1 :], self.root.reshape(1)])
                pad = -rows % PREFILL_ROWS_MULTIPLE  # the head's row counts bounded, as on the torch runtime
                positions = torch.arange(start, end + pad)
                states = state[0]
                if pad:
                    tokens = torch.cat([tokens, tokens[-1:].expand(pad)])
                    states = torch.cat([states, states[-1:].expand(pad, -1)])
                last = d.step(tokens, states, positions, None)[rows - 1]
                d.length -= pad
        self.P = n
        if d is not None:
            self._set_root(last)
        return int(self.root)

    pick = TorchRuntime.pick  # the same attributes (keep_logits, last_rows, logits_processor, sampler)
    _set_root = TorchRuntime._set_root

    # -- autoregressive ---------------------------------------------------------------------------
    @torch.inference_mode()
    def ar_step(self) -> int:
        """One plain decoding step: the root through llama.cpp, the next token."""
        self.cells.room(self.P, 1)
        self.ctx.decode(np.array([int(self.root)]), np.array([self.P]), None, True)
        self.P += 1
        self.root = self.pick(torch.from_numpy(self.ctx.logits(1)[0].copy()), self.P)
        if self.drafter is not None:  # the head's pair for position P - 1, run at the next catch_up
            self.pending.append((self.root.reshape(1), self._hidden(1), self.P - 1))
        return int(self.root)

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Run the head over the plain steps' rows it has not seen (one forward for all of them):
        its cache, root state and draft distribution are then those of a head run at every step."""
        if not self.pending:
            return
        d, pending, self.pending = self.drafter, self.pending, []
        tokens = torch.cat([t for t, _, _ in pending])
        hidden = tuple(None if rows[0] is None else torch.cat(rows, dim=1) for rows in zip(*(h for _, h, _ in pending)))
        positions = torch.arange(pending[0][2], pending[-1][2] + 1)
        d.length = pending[0][2]
        self._set_root(d.step(tokens, d.fuse(hidden)[0], positions, None)[-1])

    # -- speculative step -----------------------------------------------------------------------
    def draft_root_stats(self) -> tuple[float, float, float]:
        self.catch_up()
        top1, entropy, top4 = root_stats(self.root_logp)
        return top1, entropy, top4

    @torch.inference_mode()
    def draft(self, shape: TreeShape, rules) -> DraftTree:
        """The head's tree of ``shape`` below the root (as :meth:`TorchRuntime.draft`)."""
        self.catch_up()
        d = self.drafter
        masks = LevelMasks(self, shape)

        def expand(tokens, states, parent_slots, depth):
            positions, mask = masks.inputs(tokens.shape[0], parent_slots, depth)
            out = d.step(tokens, states, positions, mask)
            masks.clear()
            return d.log_probs(out), out

        return draft_tree(shape, self.root, self.root_logp, self.root_state, expand, d.to_target, rules)

    def draft_levels(self, shape: TreeShape, rules) -> DraftLevels:
        self.catch_up()
        return draft_levels(shape, self.root, self.root_logp, self.root_state, self.drafter.to_target, rules)

    @torch.inference_mode()
    def verify_forward(self, tree: DraftTree):
        """The whole tree in one ``llama_decode``: (logits [n, V] float32, hidden_states tuple or None)."""
        n = tree.size
        self.cells.room(self.P, n)
        rows = self.rows = tree_rows(tree, self.P)
        self.cells.open(rows)
        self.ctx.decode(rows.tokens, rows.positions, rows.seqs, True)
        logits = torch.from_numpy(self.ctx.logits(n).copy())
        return logits, (self._hidden(n) if self.drafter is not None else None)

    @torch.inference_mode()
    def commit(self, tree: DraftTree, result: VerifyResult, hidden_states) -> None:
        """seq 0 keeps the accepted path; the head runs the accepted pairs; the bonus token is the root."""
        path = result.path
        self.cells.commit(self.rows, path, self.P)
        d = self.drafter
        if d is not None:
            self.catch_up()  # (a step of sources' candidates alone, after plain steps)
            kept = len(path)
            idx = torch.tensor(path, dtype=torch.long)
            d.length = self.P  # the head's rows from P on are this step's
            state = d.fuse(hidden_states, idx)[0]  # [kept, H]
            tokens = torch.tensor(result.tokens, dtype=torch.long)  # accepted + bonus
            self._set_root(d.step(tokens, state, self.P + torch.arange(kept), None)[-1])
        self.P += len(path)
        self.root = torch.tensor(result.tokens[-1], dtype=torch.long)


@adaptivespec.hookimpl
def adaptivespec_register_runtimes(registry):
    registry.register(LlamaCppRuntime, name="llamacpp")
