"""Pure-torch glue between adaptivespec strategies and SGLang's EAGLE worker (no sglang import).

Three pieces, each usable on CPU with tensors laid out as SGLang lays them out:

* :class:`TripletController` -- wraps one :class:`~adaptivespec.strategies.TreePolicy`: reads the
  signals of a step from the draft input (``EagleDraftInput.topk_p``), returns the step's
  ``(nsteps, topk, ndt)`` and feeds the policy a :class:`~adaptivespec.types.StepRecord` when the
  scheduler reports the accept lengths.
* :class:`ShapeStateBank` -- one pre-built runtime state per selectable triplet (graph runners and
  attention backends on a GPU, opaque objects in tests), with a loud error naming the captured keys.
* :func:`wrap_verify` -- runs an adaptivespec :class:`~adaptivespec.strategies.Verifier` on SGLang's
  verify inputs and returns ``(predict, accept_lens, accept_index)`` exactly as ``eagle_sample`` does.

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

import collections
import time
from typing import Any, Callable, Generic, Iterable, Sequence, TypeVar

import attrs
import torch

from adaptivespec.costmodel import CostModel
from adaptivespec.errors import AdaptiveSpecError, ShapeNotInBankError
from adaptivespec.strategies import TreePolicy, Verifier
from adaptivespec.tree import make_tree
from adaptivespec.types import StepRecord, StepSignals, TreeShape

BATCH_REDUCERS = ("mean", "min", "max")
"""How a batch's per-request signals become the one value a batch-wide shape is chosen from."""

S = TypeVar("S")


def format_shapes(shapes: Iterable[TreeShape]) -> str:
    return ", ".join(str(s) for s in sorted(shapes)) or "(none)"


def sglang_shape_problem(shape: TreeShape) -> str | None:
    """Why SGLang's EAGLE worker cannot run ``shape``, as a sentence; None when it can.

    SGLang's topk=1 path drafts a plain chain and keeps every drafted token (its server-argument
    hook forces ``ndt = nsteps + 1`` and ``_rebuild_topk1_chain_buffers`` asserts it).
    """
    if shape.topk == 1 and shape.ndt != shape.nsteps + 1:
        return f"{shape}: SGLang's topk=1 chain path needs ndt == nsteps + 1 (here {shape.nsteps + 1})"
    return None


def sglang_shape(shape: TreeShape) -> TreeShape:
    """The shape SGLang runs for ``shape``: no deeper than ``ndt - 1`` levels.

    A verified tree of ``ndt`` nodes (the root and the ``ndt - 1`` best drafted nodes, a set closed
    under ancestors, since a node's score never exceeds its parent's) holds no node deeper than
    ``ndt - 1``, so drafting further levels changes nothing but the cost; and SGLang 0.5.23's verify
    compacts ``nsteps + 1`` accepted rows into ``ndt`` slots, which fails when ``nsteps >= ndt``
    (``_compact_accept_to_front``: "expanded size ... must match"), e.g. cost_aware's ``(6, 4, 4)``.
    """
    return TreeShape(min(shape.nsteps, shape.ndt - 1), shape.topk, shape.ndt) if shape.ndt >= 2 else shape


def sglang_shapes(shapes: Iterable[TreeShape]) -> set[TreeShape]:
    """The set of shapes SGLang runs for a policy's ``shapes`` (:func:`sglang_shape` of each)."""
    return {sglang_shape(s) for s in shapes}


def load_floor_shape(shapes: Iterable[TreeShape]) -> TreeShape:
    """The smallest tree a load-aware controller falls back to under a large batch: one draft
    step, one drafted token verified (``ndt = 2``), at the bank's smallest ``topk`` (SGLang's EAGLE
    worker cannot skip drafting; this is the least speculation it runs)."""
    k = min(s.topk for s in shapes)
    return TreeShape(1, k, 2)


def _reduce(values: Sequence[float], how: str) -> float:
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    return sum(values) / len(values)


# -- the per-step controller ---------------------------------------------------------------------
def draft_top1_prob(topk_p: torch.Tensor, reduce: str = "mean") -> float:
    """The draft's top-1 probability of a step's first level, one number for the batch.

    ``topk_p``: [bs, k] probabilities of the root's k best children (``EagleDraftInput.topk_p``;
    SGLang sorts them, the max is taken anyway). One device-to-host transfer.
    """
    per_request = topk_p.float().amax(dim=-1).tolist()  # [bs]
    return float(_reduce(per_request, reduce))


@attrs.define(eq=False)
class _PendingStep:
    """A step whose shape was chosen and whose accept lengths have not come back yet."""

    step: int
    epoch: int  # the controller's reset count when the step began
    shape: TreeShape
    signals: StepSignals
    policy_state: dict[str, Any]
    batch_size: int = 1
    promoted: list[int] | None = None
    started: float = 0.0  # perf_counter() when the shape was chosen (before drafting)
    gap_ms: float | None = None  # from the previous step's accept lengths to this start, same batch


class LoadModel:
    """Load-aware trees: the shape that gives a batch the most tokens per second, from a cost model
    of the *served* step and the accept lengths seen so far.

    A step of ``bs`` requests at shape ``s`` is priced by the cost model as
    ``step_ms(verified=bs * s.ndt, levels=s.nsteps, nodes=bs * s.nsteps * s.topk)`` and yields
    ``bs * (1 + accepted(s))`` tokens, ``accepted(s)`` the exponential moving average of the
    drafted tokens accepted per request at that shape (unseen shapes: the average over all shapes,
    at most ``s.nsteps``). :meth:`choose` keeps the policy's shape unless a smaller bank shape
    (``ndt`` no larger) is expected to give more tokens per second: as the batch grows, every
    verified row costs more of the step and the tree shrinks, down to the bank's one-drafted-token
    floor. At batch size 1 the policy's shape always runs (the paper's setting).

    The cost model is fitted from a served trace (``serve --trace`` records each step's time):
    ``python -m adaptivespec.analysis.served_cost``; the embedded pair's CPU profile ships as
    ``sglang-cpu-smollm2-135m-bf16.json``.
    """

    def __init__(self, cost: CostModel, *, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise AdaptiveSpecError(f"load model decay: expected a number in (0, 1), got {decay!r}")
        self.cost, self.decay = cost, decay
        self._accepted: dict[TreeShape, float] = {}
        self._overall: float | None = None

    def observe(self, shape: TreeShape, accepted: float) -> None:
        """A step ran at ``shape`` and accepted ``accepted`` drafted tokens per request (batch mean)."""
        d = self.decay
        prev = self._accepted.get(shape)
        self._accepted[shape] = accepted if prev is None else d * prev + (1 - d) * accepted
        self._overall = accepted if self._overall is None else d * self._overall + (1 - d) * accepted

    def accepted(self, shape: TreeShape) -> float:
        if shape in self._accepted:
            return self._accepted[shape]
        return min(float(shape.nsteps), self._overall if self._overall is not None else 1.0)

    def step_ms(self, shape: TreeShape, batch_size: int) -> float:
        return self.cost.step_ms(verified=batch_size * shape.ndt, levels=shape.nsteps,
                                 nodes=batch_size * shape.nsteps * shape.topk, context=0.0)

    def tokens_per_s(self, shape: TreeShape, batch_size: int) -> float:
        return 1e3 * batch_size * (1.0 + self.accepted(shape)) / self.step_ms(shape, batch_size)

    def choose(self, shape: TreeShape, batch_size: int, shapes: Iterable[TreeShape]) -> TreeShape:
        """The shape to run for ``batch_size`` requests when the policy chose ``shape``."""
        if batch_size <= 1:
            return shape
        best, best_rate = shape, self.tokens_per_s(shape, batch_size)
        for s in shapes:
            if s.ndt < shape.ndt:
                rate = self.tokens_per_s(s, batch_size)
                if rate > best_rate:
                    best, best_rate = s, rate
        return best


class TripletController:
    """Asks one tree policy for each step's ``(nsteps, topk, ndt)`` in an SGLang worker.

    Per decode step the worker calls :meth:`begin_step` with the draft input's ``topk_p`` before
    drafting, and :meth:`observe` with the accept lengths when the scheduler has them on the host
    (``on_verify_complete_cpu``). Results come back in launch order, so pending steps form a FIFO:
    with SGLang's overlap scheduler the accept lengths of step t arrive after step t+1 began and the
    policy's ``last_accepted`` then lags one step (``adaptivespec serve`` disables overlap).

    **Batches.** One CUDA graph serves the whole batch, so one shape is chosen per batch: the draft
    top-1 probabilities and the accepted lengths of the requests are reduced with
    ``batch_reduce`` (``mean`` by default; ``min`` picks the shape the least confident request
    wants: wider, shallower trees). At batch size 1 (the paper's setting) every reducer is exact.

    **Sequences.** :meth:`TreePolicy.reset` is called when a step's request ids share none with
    the previous step's (a new request at batch size 1). The circuit breaker lives in the policy
    (the ``dcs`` policy restores its start shape after consecutive zero-accept steps): the
    controller feeds it every step's record, zero-accept steps included.
    """

    def __init__(
        self,
        policy: TreePolicy,
        *,
        batch_reduce: str = "mean",
        on_record: Callable[[StepRecord], None] | None = None,
        on_trace: Callable[[StepRecord, int, float | None], None] | None = None,
        verify_budget: int | None = None,
        load: LoadModel | None = None,
    ) -> None:
        if batch_reduce not in BATCH_REDUCERS:
            raise AdaptiveSpecError(f"batch_reduce: expected one of {', '.join(BATCH_REDUCERS)}, got {batch_reduce!r}")
        if verify_budget is not None and verify_budget < 2:
            raise AdaptiveSpecError(f"verify_budget: expected at least 2 verified rows per step, got {verify_budget}")
        own = sglang_shapes(policy.shapes())
        if (verify_budget is not None or load is not None) and own:
            own.add(load_floor_shape(own))
        shapes = tuple(sorted(own))
        if not shapes:
            raise AdaptiveSpecError(f"policy {policy.name!r} declares no tree shapes")
        problems = [p for p in map(sglang_shape_problem, shapes) if p]
        if problems:
            raise AdaptiveSpecError(f"policy {policy.name!r} declares shapes SGLang cannot run: " + "; ".join(problems))
        self.policy = policy
        self.shapes = shapes
        self.batch_reduce = batch_reduce
        self.on_record = on_record
        self.on_trace = on_trace
        self.verify_budget = verify_budget
        self.load = load
        self.last_record: StepRecord | None = None
        self._pending: collections.deque[_PendingStep] = collections.deque()
        self._epoch = 0
        self._step = 0
        self._last_accepted = -1
        self._last_requests: frozenset | None = None
        self._observed_at: float | None = None  # perf_counter() of the last observe

    def reset(self) -> None:
        """Start a new sequence: the policy forgets its history; steps still in flight are dropped."""
        self.policy.reset()
        self._epoch += 1
        self._step = 0
        self._last_accepted = -1

    def begin_step(self, topk_p: torch.Tensor, request_ids: Iterable[Any] | None = None) -> TreeShape | None:
        """The shape of the step about to be drafted; None for an empty (idle) batch.

        ``topk_p``: [bs, k_max] first-level draft probabilities; ``request_ids``: the batch's
        request ids (for sequence boundaries), or None to never reset here.
        """
        if topk_p.shape[0] == 0:
            return None
        now, gap_ms = time.perf_counter(), None
        if request_ids is not None:
            ids = frozenset(request_ids)
            if ids == self._last_requests and self._observed_at is not None and not self._pending:
                gap_ms = (now - self._observed_at) * 1e3  # the same batch: nothing else ran in between
            if self._last_requests is not None and not (ids & self._last_requests):
                self.reset()
            self._last_requests = ids
        signals = StepSignals(
            step=self._step,
            draft_top1_prob=draft_top1_prob(topk_p, self.batch_reduce),
            last_accepted=self._last_accepted,
        )
        shape = sglang_shape(self.policy.next_shape(signals))
        if shape not in self.shapes:
            raise ShapeNotInBankError(
                f"policy {self.policy.name!r} chose {shape}, which is not among the shapes it declared "
                f"(and that were captured): {format_shapes(self.shapes)}"
            )
        bs = int(topk_p.shape[0])
        state = dict(self.policy.state())
        run = self.fit_load(shape, bs)
        if run != shape:
            state["load_capped_from"] = str(shape)
        self._pending.append(_PendingStep(self._step, self._epoch, run, signals, state, batch_size=bs,
                                          started=now, gap_ms=gap_ms))
        self._step += 1
        return run

    def fit_load(self, shape: TreeShape, batch_size: int) -> TreeShape:
        """The shape to run for a batch of ``batch_size``: the policy's ``shape``, shrunk by the
        load model (:class:`LoadModel`: the shape with the most tokens per second by the served
        step's cost model) and capped so that the verify forward's rows (``batch_size * ndt``) fit
        ``verify_budget`` (the bank's largest shape that fits, the deepest of those, else the
        smallest: :func:`load_floor_shape`)."""
        if self.load is not None:
            shape = self.load.choose(shape, batch_size, self.shapes)
        budget = self.verify_budget
        if budget is None or batch_size * shape.ndt <= budget:
            return shape
        fits = [s for s in self.shapes if batch_size * s.ndt <= budget and s.ndt <= shape.ndt]
        if fits:
            return max(fits, key=lambda s: (s.ndt, s.nsteps, -s.topk))
        return min(self.shapes, key=lambda s: (s.ndt, s.nsteps * s.topk))

    def note_promoted(self, promoted_per_request: Sequence[int]) -> None:
        """Promoted (lossy-accepted) tokens per request of the newest step, from the verifier."""
        if self._pending:
            self._pending[-1].promoted = list(promoted_per_request)

    def observe(self, num_correct_drafts_per_req: Sequence[int]) -> StepRecord | None:
        """Feed the oldest pending step's accepted drafted tokens (bonus excluded) to the policy.

        Returns its record; None when no step was pending (an idle batch) or the step belonged to
        a sequence that was reset since.
        """
        if not num_correct_drafts_per_req or not self._pending:
            return None
        p = self._pending.popleft()
        if p.epoch != self._epoch:
            return None
        self._observed_at = time.perf_counter()
        step_ms = (self._observed_at - p.started) * 1e3
        per_request = [int(a) for a in num_correct_drafts_per_req]
        if self.load is not None:
            self.load.observe(p.shape, _reduce(per_request, "mean"))
        accepted = int(_reduce(per_request, self.batch_reduce))
        promoted = int(_reduce(p.promoted, self.batch_reduce)) if p.promoted else 0
        record = StepRecord(
            step=p.step,
            shape=p.shape,
            tree_size=p.shape.ndt,
            accepted=accepted,
            promoted=promoted,
            new_tokens=accepted + 1,
            # host times, no device sync added: the draft and the verify together (from the shape's
            # choice to the accept lengths), and the rest of the previous step (its draft extension
            # and the scheduler, from its accept lengths to this step's start; 0 when the batch changed)
            draft_ms=0.0,
            verify_ms=step_ms,
            other_ms=p.gap_ms or 0.0,
            signals=p.signals,
            policy_state=p.policy_state,
        )
        self.policy.observe(record)
        self._last_accepted = accepted
        self.last_record = record
        if self.on_record is not None:
            self.on_record(record)
        if self.on_trace is not None:
            self.on_trace(record, p.batch_size, p.gap_ms)
        return record


TREE_RULES = ("select_level", "select_final", "verify_shape", "observe_tree")
"""TreePolicy hooks that act inside a step (per draft level, per verified tree): SGLang's EAGLE worker
drafts a fixed beam per level and verifies its own top-``ndt`` nodes, so these have no place there."""


def step_level_notice(policy: TreePolicy) -> str | None:
    """One line saying which of the policy's in-step rules SGLang cannot run (None: none).

    Such a policy is served by its per-step shape choice alone (``next_shape``): each step drafts
    SGLang's EAGLE beam at that shape."""
    own = [r for r in TREE_RULES if getattr(type(policy), r, None) is not getattr(TreePolicy, r)]
    if not own:
        return None
    shapes = format_shapes(policy.shapes())
    return (f"policy {policy.name!r}: its in-step rules ({', '.join(own)}) have no hook in SGLang's EAGLE worker "
            f"(a fixed top-k beam per level, top-ndt nodes verified); served by its per-step shape choice among "
            f"{shapes}")


def build_strategies(config, host=None) -> tuple[TreePolicy, Verifier | None]:
    """The config's policy, and its verifier unless it is ``strict`` (then SGLang's own greedy
    kernel verifies: same result, no host round trip). ``config``: :class:`~adaptivespec.config.Config`."""
    if host is None:
        from adaptivespec.plugins import get_plugin_host

        host = get_plugin_host()
    policy = host.policies.get(config.policy.name).cls(config.policy.params)
    if config.verifier.name == "strict":
        return policy, None
    return policy, host.verifiers.get(config.verifier.name).cls(config.verifier.params)


# -- the bank of per-shape runtime states --------------------------------------------------------
def kv_alloc_len_per_decode(shape: TreeShape, page_size: int, max_ndt: int) -> int:
    """KV slots one request may take in one decode step of ``shape`` (mirrors SGLang's
    ``get_alloc_len_per_decode`` in ``sglang/srt/mem_cache/allocation_sizing.py``: the draft
    writes ``nsteps * topk`` slots, the verify ``ndt``; with pages and topk > 1 every branch
    rounds up to whole pages)."""
    if page_size == 1 or shape.topk == 1:
        return max(shape.nsteps * shape.topk, max_ndt)
    pages_per_branch = (page_size - 1 + shape.nsteps + page_size - 1) // page_size
    return max(pages_per_branch * page_size * shape.topk, max_ndt)


class ShapeStateBank(Generic[S]):
    """One pre-built runtime state per ``(nsteps, topk, ndt)`` triplet, keyed by the whole triplet.

    SGLang's own ``--speculative-adaptive`` keys its states by ``num_steps`` alone (topk = 1); the
    paper swaps among trees that differ in width too, so the key here is the full
    :class:`TreeShape`. States are built once at start-up (:meth:`build_missing`) and looked up
    every step (:meth:`get`), which fails loudly with the captured keys.
    """

    def __init__(self, shapes: Iterable[TreeShape]) -> None:
        self.shapes = tuple(sorted(set(shapes)))
        if not self.shapes:
            raise AdaptiveSpecError("a shape bank needs at least one tree shape")
        problems = [p for p in map(sglang_shape_problem, self.shapes) if p]
        if problems:
            raise AdaptiveSpecError("shapes SGLang cannot run: " + "; ".join(problems))
        self._states: dict[TreeShape, S] = {}

    def register(self, shape: TreeShape, state: S) -> None:
        if shape not in self.shapes:
            raise ShapeNotInBankError(f"{shape} is not one of this bank's shapes: {format_shapes(self.shapes)}")
        self._states[shape] = state

    def build_missing(self, build: Callable[[TreeShape], S]) -> list[TreeShape]:
        """Build and register a state for every shape without one, in shape order; returns them."""
        built = [s for s in self.shapes if s not in self._states]
        for shape in built:
            self.register(shape, build(shape))
        return built

    def get(self, shape: TreeShape) -> S:
        try:
            return self._states[shape]
        except KeyError:
            missing = [s for s in self.shapes if s not in self._states]
            hint = f"; declared but not built: {format_shapes(missing)}" if missing else ""
            raise ShapeNotInBankError(
                f"no runtime state for tree shape {shape}; captured shapes: {format_shapes(self._states)}{hint}"
            ) from None

    def keys(self) -> tuple[TreeShape, ...]:
        """Shapes that have a state."""
        return tuple(sorted(self._states))

    def missing(self) -> tuple[TreeShape, ...]:
        return tuple(s for s in self.shapes if s not in self._states)

    def __contains__(self, shape: object) -> bool:
        return shape in self._states

    def __len__(self) -> int:
        return len(self._states)

    def max_shape(self) -> TreeShape:
        """The element-wise largest triplet: every buffer SGLang sizes from its server arguments
        at start-up (attention backends, KV headroom, draft-input relay) fits every bank shape
        when the server starts with it. A valid shape, since ``max_nodes`` grows with both depth
        and width."""
        return TreeShape(
            max(s.nsteps for s in self.shapes), max(s.topk for s in self.shapes), max(s.ndt for s in self.shapes)
        )

    def max_topk(self) -> int:
        return max(s.topk for s in self.shapes)

    def kv_alloc_len_per_decode(self, page_size: int = 1) -> int:
        """KV slots per request and decode step that cover every shape of the bank: reserved
        before the policy picks the step's shape, so it must fit the largest."""
        max_ndt = max(s.ndt for s in self.shapes)
        return max(kv_alloc_len_per_decode(s, page_size, max_ndt) for s in self.shapes)


# -- verification ----------------------------------------------------------------------------------
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
    parent indices ``parents`` [bs, ndt] (``parents[:, 0] == -1``, topologically ordered):
    children chained in increasing node order, as ``build_tree_kernel_efficient`` leaves them."""
    bs, n = parents.shape
    index = torch.arange(bs * n, dtype=torch.long).reshape(bs, n)
    next_token = torch.full((bs, n), -1, dtype=torch.long)
    next_sibling = torch.full((bs, n), -1, dtype=torch.long)
    rows = parents.tolist()
    for b in range(bs):
        for i in range(n - 1, 0, -1):  # prepend children last-to-first: the list ends up ascending
            p = rows[b][i]
            next_sibling[b, i] = next_token[b, p]
            next_token[b, p] = i
    return index, next_token, next_sibling


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
