"""pytest plugin with fixtures for adaptivespec plugin authors (loaded through ``pytest11``).

Installed with adaptivespec, so every pytest run has these fixtures without an import:

* ``make_tree_with_logits`` -- a factory: a :class:`~adaptivespec.types.DraftTree` from explicit
  tokens and parents, plus target logits ``[n, V]`` whose top-1 and probabilities you choose;
* ``tiny_tree`` -- one such tree, ready made, with the strict verifier's answer written down;
* ``step_signals`` -- a factory of fake :class:`~adaptivespec.types.StepSignals` /
  :class:`~adaptivespec.types.StepRecord` streams (accepted lengths, draft confidences) to drive
  a tree policy without a model;
* ``assert_lossless`` -- ``check(config_overrides, prompts, max_new_tokens=48)``: runs adaptivespec
  on the embedded target in float32 with a random EAGLE-3 head (optionally steered toward the
  right continuation, ``oracle=True``) and asserts the token ids equal transformers' greedy
  ``generate`` (slow: loads the model once per session; mark such tests ``@pytest.mark.model``).

and plain helpers to import: :func:`registered` (the registry entry of a plugin's strategy),
:func:`tree_with_logits` (the factory behind the fixture), :func:`draft_with_fake_drafter`
(run :func:`~adaptivespec.tree.draft_tree` with a policy's level rules and a seeded fake drafter)
and :func:`install_plugin` (a plugin module installed as a distribution with its entry point, into
a folder for ``sys.path`` or ``PYTHONPATH``: what adaptivespec finds is what ``pip install`` gives).

This module is imported by every pytest run in an environment where adaptivespec is installed:
it imports torch and adaptivespec's light modules only; models load inside the fixtures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs
import pytest
import torch

import adaptivespec
from adaptivespec.tree import draft_tree, make_tree
from adaptivespec.types import DraftTree, StepRecord, StepSignals, TreeShape

LOSSLESS_PROMPTS = (
    "What is 12 times 7? Answer briefly.",
    "Write a Python function that returns the factorial of n.",
    "List three colours of the rainbow.",
    "Explain in one sentence what a hash table is.",
    "Translate 'good morning' into French.",
)
"""Five short chat prompts ``assert_lossless`` uses when given none (math, code, list, prose, translation)."""

DRAFT_VOCAB = 8192
"""Draft vocabulary of the kit's random EAGLE-3 head (the first 8192 target ids)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "model: loads the embedded SmolLM2-135M target (slower)")


# -- registry --------------------------------------------------------------------------------------
_HOST = None


def install_plugin(site: Path, distribution: str, module: str, source: str, entry: str | None = None) -> Path:
    """``source`` as module ``module`` of a distribution ``distribution`` (version 1.0) with the
    entry point ``entry = module`` (default: the distribution's name less ``adaptivespec-``) in
    adaptivespec's group, installed into ``site``: put ``site`` on ``sys.path`` (or ``PYTHONPATH`` for
    a subprocess) and the plugin loads as an installed one does. Returns ``site``."""
    entry = entry or distribution.removeprefix("adaptivespec-")
    (site / f"{module}.py").write_text(source)
    info = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[adaptivespec]\n{entry} = {module}\n")
    (info / "RECORD").write_text("")
    return site


def registered(kind: str, name: str):
    """The :class:`~adaptivespec.plugins.Entry` registered as ``name`` of ``kind`` (``policy``,
    ``verifier``, ``drafter`` or ``runtime``), from a plugin host built once per process.

    Fails the test, listing the registered names, when nothing of that name is registered::

        entry = registered("policy", "talon")
        assert entry.provider == "adaptivespec-talon" and entry.lossless
    """
    global _HOST
    from adaptivespec.errors import UnknownStrategyError
    from adaptivespec.plugins import make_plugin_host

    if _HOST is None:
        _HOST = make_plugin_host()
    try:
        return _HOST.registry(kind).get(name)
    except UnknownStrategyError as exc:
        pytest.fail(f"{exc} (is the plugin installed? `pip install -e` its folder)")
    except KeyError:
        pytest.fail(f"unknown strategy kind {kind!r}; expected policy, verifier, drafter or runtime")


# -- hand-built trees with chosen target logits -------------------------------------------------
def _rows(n: int, spec: Any, what: str) -> dict[int, Any]:
    """A per-node value given as one value for all nodes, a length-n sequence or {node: value}."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    if isinstance(spec, (int, float)):
        return {i: spec for i in range(n)}
    if len(spec) != n:
        raise ValueError(f"{what}: expected one entry per node ({n}), got {len(spec)}")
    return {i: v for i, v in enumerate(spec) if v is not None}


def tree_with_logits(
    tokens: Sequence[int],
    parents: Sequence[int],
    *,
    target_top1: Sequence[int | None] | Mapping[int, int] | None = None,
    top1_prob: float | Sequence[float] | Mapping[int, float] = 0.9,
    probs: Mapping[int, Mapping[int, float]] | None = None,
    vocab: int | None = None,
    shape: TreeShape | None = None,
) -> tuple[DraftTree, torch.Tensor]:
    """A draft tree and float32 target logits ``[n, V]`` (log-probabilities) with chosen rows.

    ``tokens`` / ``parents``: the nodes, root first (``parents[0] == -1``, parents before children).
    Row ``i`` of the logits is the target's distribution over the token *after* node ``i``, i.e.
    over node ``i``'s children, and is built as:

    * ``probs[i] = {token: p, ...}`` when given: those probabilities exactly, the remaining mass
      spread evenly over every other token;
    * else the target's top-1 ``target_top1[i]`` (a length-n sequence, ``None`` entries allowed, or
      ``{node: token}``) gets ``top1_prob`` (one value, per node, or ``{node: p}``) and the rest is
      spread evenly; nodes without a top-1 get the *filler* token ``V - 1``, which no drafted
      token should use, so by default no child of that node matches.

    ``vocab`` defaults to the largest id mentioned + 2. ``shape`` defaults to one large enough for
    any tree of this size (``make_tree``'s inferred shape is invalid for trees that branch).
    Raises ``ValueError`` when a row's chosen top-1 would not be its argmax.
    """
    n = len(tokens)
    top1 = _rows(n, target_top1, "target_top1")
    p1 = _rows(n, top1_prob, "top1_prob")
    probs = {int(k): dict(v) for k, v in (probs or {}).items()}
    mentioned = list(tokens) + list(top1.values()) + [t for row in probs.values() for t in row]
    V = vocab if vocab is not None else max(mentioned) + 2
    if max(mentioned) >= V:
        raise ValueError(f"vocab: expected more than the largest token id mentioned ({max(mentioned)}), got {V}")
    filler = V - 1
    logp = torch.empty(n, V, dtype=torch.float64)
    for i in range(n):
        row = probs.get(i) or {top1.get(i, filler): p1.get(i, 0.9)}
        total = sum(row.values())
        if any(p <= 0 for p in row.values()) or total > 1 + 1e-9 or len(row) > V:
            raise ValueError(f"node {i}: probabilities must be positive and sum to at most 1, got {row}")
        rest = V - len(row)
        fill = max(1.0 - total, 1e-12) / rest if rest else 0.0
        logp[i] = math.log(fill) if rest else 0.0
        for tok, p in row.items():
            logp[i, tok] = math.log(p)
        if i in top1 and i not in probs and int(logp[i].argmax()) != top1[i]:
            raise ValueError(
                f"node {i}: top1_prob {p1.get(i, 0.9)} is not above the even share {fill:.3g} of the "
                f"other {rest} tokens, so token {top1[i]} would not be the target's top-1"
            )
    m = max(n - 1, 1)
    tree = make_tree(torch.tensor(list(tokens)), torch.tensor(list(parents)), shape=shape or TreeShape(m, m, m + 1))
    return tree, logp.float()


@pytest.fixture
def make_tree_with_logits() -> Callable[..., tuple[DraftTree, torch.Tensor]]:
    """Factory ``make_tree_with_logits(tokens, parents, target_top1=..., top1_prob=..., probs=...,
    vocab=...) -> (tree, logits)``: see :func:`tree_with_logits`. Example (a chain the target
    accepts twice, then rejects)::

        tree, logits = make_tree_with_logits([9, 1, 2, 3], [-1, 0, 1, 2], target_top1=[1, 2, 7, 4])
        assert StrictVerifier().verify(tree, logits).tokens == [1, 2, 7]
    """
    return tree_with_logits


@attrs.frozen(kw_only=True)
class TinyTree:
    """A ready-made tree (``tiny_tree`` fixture) and what strict verification keeps of it."""

    tree: DraftTree
    logits: torch.Tensor  # [n, V] float32
    strict_path: list[int]
    """Accepted node indices, root first, under greedy exact match."""
    strict_tokens: list[int]
    """Tokens strict verification emits (accepted drafted tokens, then the bonus)."""


@pytest.fixture
def tiny_tree() -> TinyTree:
    """Seven nodes, two branches; the target follows the second branch for two tokens::

        node:    0      1   2   3   4   5   6
        token:  (9)     1   2   3   4   5   6
        parent:  -      0   0   1   2   4   4        target top-1 at nodes 0..6: 2 . 4 . 8 . .

    Node 2 (token 2) and node 4 (token 4) match; neither child of node 4 (tokens 5, 6) is the
    target's 8, so strict verification accepts path [0, 2, 4] and emits tokens [2, 4, 8].
    """
    tree, logits = tree_with_logits(
        [9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 4, 4], target_top1={0: 2, 2: 4, 4: 8}, vocab=12
    )
    return TinyTree(tree=tree, logits=logits, strict_path=[0, 2, 4], strict_tokens=[2, 4, 8])


# -- fake step streams for tree policies -------------------------------------------------------------
@attrs.frozen(kw_only=True)
class FakeStep:
    """One step of a :class:`SignalStream`: the signals a policy reads, and the step's outcome."""

    signals: StepSignals
    accepted: int
    """Drafted tokens this step accepts (before clamping to the chosen shape's depth)."""

    def record(
        self, shape: TreeShape | None, *, tree_size: int | None = None, policy_state: dict | None = None
    ) -> StepRecord:
        """The :class:`StepRecord` of this step run with ``shape`` (accepted clamped to its depth)."""
        accepted = self.accepted if shape is None else min(self.accepted, shape.nsteps)
        size = tree_size if tree_size is not None else (1 if shape is None else shape.ndt)
        return StepRecord(
            step=self.signals.step, shape=shape, tree_size=size, accepted=accepted, promoted=0,
            new_tokens=accepted + 1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0,
            signals=self.signals, policy_state=policy_state or {},
        )


class SignalStream:
    """Fake decode steps: iterate for :class:`FakeStep` objects, or :meth:`drive` a policy."""

    def __init__(self, accepted: Sequence[int], draft_probs: Sequence[float] | float = 0.5) -> None:
        if isinstance(draft_probs, (int, float)):
            draft_probs = [float(draft_probs)] * len(accepted)
        if len(draft_probs) != len(accepted):
            raise ValueError(f"draft_probs: expected one per step ({len(accepted)}), got {len(draft_probs)}")
        self.accepted, self.draft_probs = list(accepted), [float(p) for p in draft_probs]
        self.records: list[StepRecord] = []
        """Records of the last :meth:`drive`."""

    def __len__(self) -> int:
        return len(self.accepted)

    def __iter__(self) -> Iterator[FakeStep]:
        """Steps whose ``last_accepted`` is the previous step's *given* accepted length."""
        last = -1
        for i, (acc, p) in enumerate(zip(self.accepted, self.draft_probs)):
            yield FakeStep(signals=StepSignals(step=i, draft_top1_prob=p, last_accepted=last), accepted=acc)
            last = acc

    def drive(self, policy) -> list[TreeShape]:
        """Run ``policy`` over the stream: ``reset()``, then per step ``next_shape`` and ``observe``.

        ``last_accepted`` is what the previous record accepted (clamped to its shape's depth), as
        in the decode loop. Returns the shapes chosen; the records are kept in :attr:`records`.
        """
        policy.reset()
        shapes, self.records, last = [], [], -1
        for i, (acc, p) in enumerate(zip(self.accepted, self.draft_probs)):
            step = FakeStep(signals=StepSignals(step=i, draft_top1_prob=p, last_accepted=last), accepted=acc)
            shape = policy.next_shape(step.signals)
            record = step.record(shape, policy_state=policy.state())
            policy.observe(record)
            shapes.append(shape)
            self.records.append(record)
            last = record.accepted
        return shapes


@pytest.fixture
def step_signals() -> Callable[..., SignalStream]:
    """Factory ``step_signals(accepted, draft_probs=0.5) -> SignalStream`` of fake decode steps.

    ``accepted``: drafted tokens accepted at each step; ``draft_probs``: the draft's top-1
    probability each step reports (one value or one per step). Example::

        shapes = step_signals([0, 0, 5, 5], draft_probs=[0.1, 0.1, 0.9, 0.9]).drive(policy)
    """
    return SignalStream


# -- a fake drafter for policies' level rules ---------------------------------------------------------
def draft_with_fake_drafter(
    policy, shape: TreeShape | None = None, *, vocab: int = 64, seed: int = 0, temperature: float = 1.0
) -> DraftTree:
    """Draft one tree with ``policy``'s ``select_level`` / ``select_final`` and a seeded fake
    drafter whose every distribution is ``softmax(randn(vocab) / temperature)`` (lower temperature:
    more confident drafts). ``shape`` defaults to the policy's first shape. Draft ids are target ids.
    """
    shape = shape or policy.shapes()[0]
    gen = torch.Generator().manual_seed(seed)
    hidden = 4

    def logp(rows: int) -> torch.Tensor:
        return torch.log_softmax(torch.randn(rows, vocab, generator=gen) / temperature, dim=-1)

    def expand(tokens, states, parent_slots, depth):
        return logp(tokens.shape[0]), torch.zeros(tokens.shape[0], hidden)

    return draft_tree(shape, torch.tensor(0), logp(1)[0], torch.zeros(hidden), expand, lambda ids: ids, policy)


# -- end to end: token-identical to transformers' greedy generate ---------------------------------------
ORACLE_KIND = "testing-oracle"
"""Drafter kind of ``assert_lossless(..., oracle=True)``, registered only in the kit's own plugin host."""

_ORACLE_CLS = None


def _oracle_drafter_class():
    """An EAGLE-3 head that knows the continuation: built on first use (it imports transformers)."""
    global _ORACLE_CLS
    if _ORACLE_CLS is not None:
        return _ORACLE_CLS
    from adaptivespec.drafter import Eagle3Drafter

    class OracleDrafter(Eagle3Drafter):
        """A random head whose next-token scores are pushed toward ``reference`` (prompt + greedy
        continuation): the reference token's logit becomes the row's maximum plus a margin drawn
        uniformly from [-1, 3) nats, so it is usually the draft's top-1 and sometimes 2nd or 3rd.
        Tokens outside the draft vocabulary cannot be proposed (as with a trained head)."""

        reference: torch.Tensor | None = None  # [L] int64 target ids
        generator: torch.Generator | None = None

        def step(self, tokens, state, positions, mask):
            self._positions = positions  # drafter position i predicts token[i + 2]
            return super().step(tokens, state, positions, mask)

        def log_probs(self, out_state):
            logits = self.lm_head(self.norm(out_state)).float()
            if self.reference is None:
                return torch.log_softmax(logits, dim=-1)
            rows = logits.reshape(-1, logits.shape[-1])  # one row per position just run (or the last)
            want = self._positions[-rows.shape[0]:] + 2
            known = want < self.reference.shape[0]
            draft_id = self._target_to_draft[self.reference[want.clamp(max=self.reference.shape[0] - 1)]]
            hit = (known & (draft_id >= 0)).nonzero().squeeze(1)
            margin = torch.rand(rows.shape[0], generator=self.generator) * 4 - 1
            rows[hit, draft_id[hit]] = rows[hit].max(-1).values + margin[hit].to(rows.dtype)
            return torch.log_softmax(rows.reshape(logits.shape), dim=-1)

        def prime(self, reference: list[int], seed: int = 0) -> None:
            """Aim at ``reference`` (prompt ids + expected continuation) with a fresh seeded margin."""
            vd = self.d2t.shape[0]
            t2d = torch.full((self.t2d.shape[0],), -1, dtype=torch.long, device=self.d2t.device)
            t2d[torch.arange(vd, device=self.d2t.device) + self.d2t] = torch.arange(vd, device=self.d2t.device)
            self._target_to_draft = t2d
            self.reference = torch.tensor(reference, dtype=torch.long, device=self.d2t.device)
            self.generator = torch.Generator().manual_seed(seed)

    _ORACLE_CLS = OracleDrafter
    return OracleDrafter


class _OraclePlugin:
    """Registers the oracle drafter kind in the kit's plugin host only."""

    @staticmethod
    @adaptivespec.hookimpl
    def adaptivespec_register_drafters(registry):
        registry.register(_oracle_drafter_class(), name=ORACLE_KIND)


class _LosslessEnv:
    """Session state of ``assert_lossless``: the float32 target, a random EAGLE-3 head, references."""

    def __init__(self, head_dir) -> None:
        from adaptivespec.config import load_config
        from adaptivespec.decode import load_models
        from adaptivespec.drafter import Eagle3Drafter
        from adaptivespec.plugins import make_plugin_host

        self.host = make_plugin_host(extra_plugins=[_OraclePlugin])
        base = load_config(None, ["model.drafter=null", "runtime.dtype=float32", "runtime.device=cpu"], host=self.host)
        self.target, self.tokenizer, _ = load_models(base, self.host)  # cached per process, shared with Engine
        Eagle3Drafter.random_init(self.target, DRAFT_VOCAB, seed=0).save_pretrained(head_dir)
        self.head_dir = str(head_dir)
        self.references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(self, prompt_ids: list[int], max_new_tokens: int, eos: list[int] | None) -> list[int]:
        """transformers' greedy continuation, stopping at any of the ``eos`` ids (None: none)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self.references:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = self.target.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                )
            self.references[key] = out[0, ids.shape[1]:].tolist()
        return self.references[key]

    def check(self, config_overrides: Sequence[str], prompts: Sequence[str] | None = None,
              max_new_tokens: int = 48, *, drafter: str | None = None, oracle: bool = False) -> list:
        from adaptivespec.config import load_config
        from adaptivespec.decode import Engine

        if oracle and drafter is not None:
            raise ValueError("oracle=True drives the kit's random head; drop drafter=")
        overrides = [f"model.drafter={drafter or self.head_dir}", "runtime.dtype=float32", "runtime.device=cpu"]
        overrides += [f"model.drafter_kind={ORACLE_KIND}"] if oracle else []
        config = load_config(None, [*overrides, *config_overrides], host=self.host)
        if config.runtime.dtype != "float32":
            raise ValueError("assert_lossless compares token ids, which only float32 makes reproducible; "
                             f"drop the runtime.dtype={config.runtime.dtype} override")
        engine = Engine(config, host=self.host)
        results = []
        for prompt in prompts or LOSSLESS_PROMPTS:
            ids = engine.encode(prompt)
            want = self.reference(ids, max_new_tokens, sorted(engine.eos_ids) or None)
            if oracle:
                engine.runtime.drafter.prime(ids + want)
            result = engine.generate_ids(ids, max_new_tokens=max_new_tokens)
            got = result.token_ids
            if got != want:
                at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                text = self.tokenizer.decode
                pytest.fail(
                    f"not lossless with {list(config_overrides)} on prompt {prompt!r}: token {at} differs "
                    f"(adaptivespec {got[at:at + 1]}, greedy {want[at:at + 1]}; lengths {len(got)} / {len(want)})\n"
                    f"  adaptivespec: {text(got)!r}\n  greedy:       {text(want)!r}"
                )
            results.append(result)
        return results


@pytest.fixture(scope="session")
def _adaptivespec_lossless_env(tmp_path_factory) -> _LosslessEnv:
    from adaptivespec.errors import ModelLoadError

    try:
        return _LosslessEnv(tmp_path_factory.mktemp("random-eagle3-head"))
    except ModelLoadError as exc:
        pytest.skip(f"the embedded target is not available: {exc}")


@pytest.fixture
def assert_lossless(_adaptivespec_lossless_env: _LosslessEnv) -> Callable[..., list]:
    """``check(config_overrides, prompts=None, max_new_tokens=48, *, drafter=None, oracle=False)``:
    assert that adaptivespec's output equals transformers' greedy ``generate`` token for token.

    Runs on the embedded SmolLM2-135M target in float32 on CPU (loaded once per session) with a
    random EAGLE-3 head (draft vocabulary 8192, seed 0) written once per session to a temporary
    folder, or ``drafter`` (a head folder, or ``embedded``). A random head accepts almost nothing;
    ``oracle=True`` pushes its scores toward the greedy continuation (see ``OracleDrafter``), so
    most drafts are accepted and accepted paths leave the first branch, which exercises the
    accepted-path bookkeeping (cache compaction, drafter extension) a lossless claim rests on.

    ``config_overrides`` are ``--set`` strings such as ``["policy.name=talon", "policy.budget=20"]``;
    ``prompts`` defaults to :data:`LOSSLESS_PROMPTS`. Fails on the first differing token, showing
    both texts; returns each prompt's :class:`~adaptivespec.decode.GenerationResult` (step records
    included) for further checks. Skips when the embedded target is not installed. Example::

        @pytest.mark.model
        def test_lossless(assert_lossless):
            assert_lossless(["policy.name=talon", "verifier.name=strict"], max_new_tokens=32, oracle=True)
    """
    return _adaptivespec_lossless_env.check
