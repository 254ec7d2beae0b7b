"""The prefix cache (``batch.prefix_cache_mb``, :mod:`adaptivespec.batch.prefix`): the pool's
bookkeeping on a toy cache, then the batch engine on the real model (float32): a request that starts
from a kept prefix reads only the rest, decodes greedy's tokens, and its draft head drafts from the
state it would have reached reading the whole prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from adaptivespec.batch import BatchEngine, Request, Status
from adaptivespec.batch.prefix import BLOCK, MIN_REUSE, PrefixCache
from adaptivespec.config import load_config
from adaptivespec.decode import Engine
from adaptivespec.fastpath.kvcache import buffered_cache, empty

from shared_prompts import PROMPTS

ROOT = Path(__file__).parents[1]
TOY = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8, head_dim=4,
                  intermediate_size=16, vocab_size=32)
PER_POSITION = (2 * 2 * 1 * 4 + 3) * 4
"""Bytes per position of TOY in float32 with a 3-wide head state."""


def toy_pool(blocks: int) -> PrefixCache:
    return PrefixCache(TOY, blocks * BLOCK * PER_POSITION / 2**20, torch.float32, "cpu", head_size=3)


def toy_sequence(tokens: list[int]):
    """A toy cache whose position i holds keys and values ``tokens[i]`` + layer, and head states ``tokens[i]``."""
    cache = buffered_cache(TOY, 256, dtype=torch.float32, device="cpu")
    t = torch.tensor(tokens, dtype=torch.float32)
    for i, layer in enumerate(cache.layers):
        kv = (t + i)[None, None, :, None].expand(1, 1, len(tokens), 4)
        layer.update(kv, -kv)
    return cache, t[:, None].expand(len(tokens), 3).clone()


def keep(pool: PrefixCache, tokens: list[int]) -> bool:
    cache, states = toy_sequence(tokens)
    return pool.store(tokens, cache, states)


def test_a_prompt_gets_the_longest_kept_prefix_and_its_values_less_its_last_position():
    pool = toy_pool(8)
    a = list(range(100, 140))  # 40 positions: 3 blocks
    b = list(range(100, 120)) + list(range(500, 530))
    assert keep(pool, a) and keep(pool, b)
    assert len(pool.free) == 8 - 3 - 4
    pool.resident()  # a server's start-up writes the free blocks: the kept ones stay as they are
    prompt = list(range(100, 135)) + [7, 8]  # shares 35 with a, 20 with b
    cache = empty(buffered_cache(TOY, 256, dtype=torch.float32, device="cpu"))
    n, states = pool.load(prompt, cache)
    assert n == 35 and cache.get_seq_length() == 35
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys[0, 0, :, 0], torch.tensor(prompt[:35], dtype=torch.float32) + i)
        assert torch.equal(layer.values[0, 0, :, 0], -(torch.tensor(prompt[:35], dtype=torch.float32) + i))
    assert torch.equal(states[:, 0], torch.tensor(prompt[:35], dtype=torch.float32))
    # the whole of a kept sequence as the prompt: its last position is read again (it gives the first token)
    n, _ = pool.load(a, empty(cache))
    assert n == len(a) - 1
    # too little shared: nothing loaded
    n, states = pool.load(list(range(100, 100 + MIN_REUSE - 1)) + [1] * 30, empty(cache))
    assert n == 0 and states is None and cache.get_seq_length() == 0


def test_an_extension_replaces_what_it_extends_and_a_repeat_copies_nothing():
    pool = toy_pool(8)
    turn1 = list(range(40))
    assert keep(pool, turn1)
    assert not keep(pool, turn1) and not keep(pool, turn1[:30])  # held already
    turn2 = turn1 + list(range(900, 930))
    cache, states = toy_sequence(turn2)
    for layer in cache.layers:  # what turn1 holds is not copied again: marked here, it must not show
        layer.keys[:, :, :40] += 0.5
    assert pool.store(turn2, cache, states)  # the next turn: it takes over turn1's blocks
    assert len(pool.kept) == 1 and pool.positions == 70 and len(pool.free) == 8 - 5
    n, _ = pool.load(turn2 + [1], empty(cache))
    assert n == 70 and torch.equal(cache.layers[0].keys[0, 0, :, 0], torch.tensor(turn2, dtype=torch.float32))


def test_least_recently_used_sequences_leave_first_and_what_never_fits_is_not_kept():
    pool = toy_pool(6)  # 96 positions
    seqs = [[k * 1000 + i for i in range(32)] for k in range(3)]  # 2 blocks each: the pool is full
    for s in seqs:
        assert keep(pool, s)
    assert not pool.free
    cache = empty(buffered_cache(TOY, 256, dtype=torch.float32, device="cpu"))
    assert pool.load(seqs[0] + [1], cache)[0] == 32  # seqs[0] used: seqs[1] is now the oldest
    assert keep(pool, [7000 + i for i in range(20)])
    assert [pool.match(s)[1] for s in seqs] == [32, 0, 32]
    assert not keep(pool, list(range(6 * BLOCK + 1)))  # larger than the whole pool
    assert not keep(pool, list(range(MIN_REUSE - 1)))  # too short to be worth it
    pool.clear()
    assert len(pool.free) == 6 and not pool.kept


# -- the engine on the real model ---------------------------------------------------------------------
N = 24


def engine(name: str, *overrides: str, slots: int = 2) -> BatchEngine:
    from test_batch import TYPICAL, pin_speculation

    config = load_config(ROOT / "configs" / name, overrides=["runtime.dtype=float32", *overrides])
    be = BatchEngine(config, slots=slots, costs=TYPICAL, context_length=256, log=lambda _: None)
    if be.budget is not None:
        pin_speculation(be.budget)
    return be


def run(be: BatchEngine, *prompts: list[int], limit: int = N) -> list[Request]:
    reqs = [be.submit(Request(prompt=list(p), max_new_tokens=limit)) for p in prompts]
    while be.busy:
        be.step()
    return reqs


@pytest.mark.model
@pytest.mark.parametrize("name", ["ar.yaml", "batched-hybrid.yaml"])
def test_the_same_prompt_again_and_the_next_turn_read_only_what_is_new(name, greedy_reference):
    """The same prompt again takes all but its last position from the cache; the next turn of the
    chat (prompt, answer, a new message) takes the first turn's prompt and answer; a different prompt
    shares the chat template's system prompt. Every output is greedy's."""
    be = engine(name)
    ids, ref = greedy_reference(PROMPTS[3], N)
    (first,) = run(be, ids)
    (again,) = run(be, ids)
    assert (first.cached, again.cached) == (0, len(ids) - 1)
    assert first.out == again.out == ref
    assert again.stats()["cached_tokens"] == len(ids) - 1
    other_ids, other_ref = greedy_reference(PROMPTS[1], N)
    (other,) = run(be, other_ids)
    shared = next(i for i, (x, y) in enumerate(zip(ids, other_ids)) if x != y)
    assert other.cached == shared >= MIN_REUSE and other.out == other_ref  # the system prompt
    turn2 = ids + ref + other_ids[shared:]
    (second,) = run(be, turn2)
    # the first turn's prompt and answer, but for its last step's tokens (the request ended before committing them)
    assert len(ids) + len(ref) - 8 <= second.cached < len(ids) + len(ref)
    alone = Engine(load_config(ROOT / "configs" / "ar.yaml", overrides=["runtime.dtype=float32"]))
    assert second.out == alone.generate_ids(turn2, max_new_tokens=N).token_ids


@pytest.mark.model
def test_a_cached_prefix_gives_the_head_the_state_it_reaches_reading_the_whole_prompt(greedy_reference):
    """After a kept prefix the head runs its rows with those of the prompt's last row, in the step
    that reads it (a drafting step), or after plain steps with the rows they left, before it first
    drafts: its cache length and root state are what reading the prompt alone gives, and it drafts
    and accepts as much as the request did the first time."""
    be = engine("batched.yaml")
    # the row budget learns nothing here, so the trees it cuts depend on the head's state alone (its
    # acceptance calibration and running means would otherwise differ between the two runs)
    be.budget.observe = be.budget.step_done = lambda *a, **k: None
    ids, ref = greedy_reference(PROMPTS[0], N)
    alone = Engine(load_config(ROOT / "configs" / "batched.yaml", overrides=["runtime.dtype=float32"])).runtime
    (first,) = run(be, ids)
    again = be.submit(Request(prompt=list(ids), max_new_tokens=N))
    be.step()  # joins: the prefix loaded, its last position read; the head follows all of it at once
    assert again.cached == len(ids) - 1 and again.status is Status.DECODE
    assert not again.lane.pending and again.lane.kv.length == len(ids) and again.lane.kept_rows is None
    assert alone.prefill(ids, N) == again.out[0]
    rt = again.lane.engine.runtime
    torch.testing.assert_close(rt.root_state.reshape(-1), alone.root_state.reshape(-1), rtol=1e-4, atol=1e-4)
    while be.busy:
        be.step()
    # a plain step reads it: the head's rows (the prefix's, the last row's) wait, and run before it drafts
    from test_batch import pin_speculation

    pin_speculation(be.budget, drafts=False)
    other_ids, other_ref = greedy_reference(PROMPTS[2], N)
    other = be.submit(Request(prompt=other_ids, max_new_tokens=N))
    while other.status is not Status.DECODE:
        be.step()
    third = be.submit(Request(prompt=list(ids), max_new_tokens=N))
    be.step()  # a plain step (the other decodes) reads its last row: the prompt's rows wait, the cached ones first
    assert third.cached == len(ids) - 1 and third.status is Status.DECODE
    assert [(int(p[2][0]), int(p[2][-1])) for p in third.lane.pending] == [(0, len(ids) - 1)]
    be.step()
    assert [int(p[2][0]) for p in third.lane.pending] == [0, len(ids)] and not any(x.undrafted is None for x in third.records)
    pin_speculation(be.budget)
    be.step()  # the first drafting step brings the head up to date first
    assert any(x.undrafted is None for x in third.records) and not third.lane.pending
    rt = third.lane.engine.runtime
    assert rt.P == len(ids) + len(third.out) - 1 == third.lane.kv.length
    assert alone.prefill(ids + third.out[:-1], N) == third.out[-1]
    torch.testing.assert_close(rt.root_state.reshape(-1), alone.root_state.reshape(-1), rtol=1e-4, atol=1e-4)
    while be.busy:
        be.step()
    assert first.out == again.out == third.out == ref and other.out == other_ref
    # the head accepts as it did reading the prompt whole (one missing part of its prompt had accepted
    # far less); step for step equality is not asked: in float32 the head's rows read in one pass or
    # in chunks round apart (1e-6), which can reorder a near-tie in a draft's top-k
    accepted = [sum(x.accepted for x in r.records if x.undrafted is None) for r in (first, again)]
    assert accepted[1] >= 0.8 * accepted[0], accepted


@pytest.mark.model
def test_requests_sharing_a_prefix_in_one_batch_and_no_cache_at_zero(greedy_reference):
    """Three requests at once, two of them the same prompt: the second waits while the first reads
    it, then takes all of it but its last token from the cache (``n`` choices read their prompt
    once); then both prompts again: the repeats load; with ``batch.prefix_cache_mb: 0`` nothing is
    kept. Every output is greedy's."""
    refs = [greedy_reference(PROMPTS[i], N) for i in (0, 2)]
    be = engine("batched-hybrid.yaml", slots=3)
    a, b, c = run(be, refs[0][0], refs[0][0], refs[1][0])
    assert (a.cached, b.cached, c.cached) == (0, len(refs[0][0]) - 1, 0)
    d, e = run(be, refs[0][0], refs[1][0])
    assert (d.cached, e.cached) == (len(refs[0][0]) - 1, len(refs[1][0]) - 1)
    assert [r.out for r in (a, b, c, d, e)] == [refs[0][1], refs[0][1], refs[1][1], refs[0][1], refs[1][1]]
    off = engine("batched-hybrid.yaml", "batch.prefix_cache_mb=0")
    assert off.prefix is None
    x, y = run(off, refs[0][0]) + run(off, refs[0][0])
    assert x.cached == y.cached == 0 and x.out == y.out == refs[0][1]
