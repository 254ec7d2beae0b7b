"""The shape bank: every selectable shape prepared up front; unknown shapes fail with the list."""

from __future__ import annotations

import pytest
import torch

from adaptivespec.fastpath.bank import ShapeBank, max_beam, max_expanded
from adaptivespec.errors import ShapeNotInBankError
from adaptivespec.policies.dcs import DcsParams, DcsPolicy
from adaptivespec.types import StepRecord, StepSignals, TreeShape


def test_every_shape_the_dcs_policy_can_choose_is_prepared():
    policy = DcsPolicy(DcsParams())
    bank = ShapeBank(policy.shapes(), capacity=64, dtype=torch.float32, device="cpu")
    chosen = set()
    for p1 in [i / 20 for i in range(21)]:
        for accepted in range(0, 9):
            policy.reset()
            for step in range(6):  # walk the EMA through its range
                shape = policy.next_shape(StepSignals(step=step, draft_top1_prob=p1, last_accepted=accepted))
                chosen.add(shape)
                bank.get(shape)  # never raises
                policy.observe(StepRecord(step=step, shape=shape, tree_size=shape.ndt, accepted=accepted, promoted=0,
                                          new_tokens=accepted + 1, draft_ms=0, verify_ms=0, other_ms=0))
    assert chosen <= set(bank.shapes)
    assert TreeShape(3, 4, 4) in chosen and TreeShape(7, 1, 8) in chosen


def test_unknown_shape_raises_with_the_list():
    bank = ShapeBank([TreeShape(3, 4, 4), TreeShape(7, 1, 8)], capacity=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ShapeNotInBankError) as info:
        bank.get(TreeShape(5, 2, 8))
    assert str(info.value) == "tree shape (5,2,8) is not in the shape bank; prepared shapes: (3,4,4), (7,1,8)"


def test_executor_buffers_fit_their_shape_and_survive_reserve():
    shape = TreeShape(5, 2, 8)
    bank = ShapeBank([shape], capacity=32, dtype=torch.bfloat16, device="cpu")
    ex = bank.get(shape)
    assert ex.verify_mask.shape == (1, 1, 8, 32) and ex.verify_mask.dtype == torch.bfloat16
    assert ex.draft_mask.shape[2] == max_beam(shape)
    assert ex.slot_anc.shape == (max_expanded(shape),) * 2
    ex.graphs["verify"] = "captured"
    before = ex.verify_mask.data_ptr()
    bank.reserve(20)  # already enough: nothing reallocated
    assert bank.get(shape).verify_mask.data_ptr() == before
    bank.reserve(100)
    grown = bank.get(shape)
    assert grown.capacity >= 100 and grown.graphs == {"verify": "captured"}
    assert (grown.verify_mask == 0).all()


@pytest.mark.model
def test_switching_shapes_allocates_no_bank_buffers(random_head_dir):
    """Decoding with a policy that alternates shapes leaves every bank buffer in place and zeroed."""
    from adaptivespec.config import load_config
    from adaptivespec.decode import Engine

    engine = Engine(load_config(None, [f"model.drafter={random_head_dir}", "policy.name=dcs", "runtime.dtype=float32"]))
    bank = engine.runtime.bank
    assert set(bank.shapes) == set(engine.policy.shapes())
    engine.generate("Count to five.", max_new_tokens=4)  # first prompt may grow the buffers once
    ptrs = {s: (bank.get(s).verify_mask.data_ptr(), bank.get(s).draft_mask.data_ptr()) for s in bank.shapes}
    res = engine.generate("Count to five.", max_new_tokens=12)
    assert len({r.shape for r in res.records}) >= 1
    assert ptrs == {s: (bank.get(s).verify_mask.data_ptr(), bank.get(s).draft_mask.data_ptr()) for s in bank.shapes}
    for s in bank.shapes:  # the per-step tree blocks are cleared after use
        assert (bank.get(s).verify_mask == 0).all() and (bank.get(s).draft_mask == 0).all()
