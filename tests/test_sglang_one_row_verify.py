"""The no-draft step's one-row verify runs with the decode kernel (adaptivespec.sglang.one_row_verify).

The routing is checked on a stand-in backend (no sglang); the equivalence it rests on -- SGLang's CPU
decode kernel over the sequence plus the row equals its extend kernel over a one-token extend, output
and written K/V -- on the real kernels where they are installed (``sgl_kernel``; skipped otherwise).
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from adaptivespec.sglang.one_row_verify import decode_one_row_verify


class _Mode:
    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def is_target_verify(self) -> bool:
        return self.verify


class IntelAMXAttnBackend:  # the name decode_one_row_verify recognises; records which path ran
    def __init__(self) -> None:
        self.draft_decode_metadata = None
        self.extend_metadata = (torch.tensor([11, 21]), None, None, None)
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros(4, 32, dtype=torch.int32))
        self.calls: list[tuple] = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        self.calls.append(("extend", self.draft_decode_metadata))
        return "extend"

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        self.calls.append(("decode", self.draft_decode_metadata))
        return "decode"


def _batch(verify: bool, rows: int):
    return types.SimpleNamespace(forward_mode=_Mode(verify), spec_info=types.SimpleNamespace(draft_token_num=rows),
                                 req_pool_indices=torch.tensor([2, 3]))


LAYER = types.SimpleNamespace(is_cross_attention=False)
K = torch.zeros(1)


def test_a_one_row_verify_runs_as_a_decode_over_the_verify_lengths_and_other_forwards_do_not():
    backend = IntelAMXAttnBackend()
    assert decode_one_row_verify(backend) and not decode_one_row_verify(backend)  # once
    assert backend.forward_extend(K, K, K, LAYER, _batch(True, 1)) == "decode"
    kind, (table, lens, rows) = backend.calls[-1]
    assert kind == "decode" and table is backend.req_to_token_pool.req_to_token
    assert lens.tolist() == [11, 21] and rows.tolist() == [2, 3]  # seq_lens + 1, this batch's rows
    assert backend.draft_decode_metadata is None  # restored: the draft's own decode is unaffected
    assert backend.forward_extend(K, K, K, LAYER, _batch(True, 8)) == "extend"  # a tree
    assert backend.forward_extend(K, K, K, LAYER, _batch(False, 1)) == "extend"  # a prefill
    assert backend.forward_extend(K, None, None, LAYER, _batch(True, 1)) == "extend"  # a KV-shared layer
    cross = types.SimpleNamespace(is_cross_attention=True)
    assert backend.forward_extend(K, K, K, cross, _batch(True, 1)) == "extend"


def test_other_backends_keep_their_verify():
    class TritonAttnBackend(IntelAMXAttnBackend):
        pass

    backend = TritonAttnBackend()
    assert not decode_one_row_verify(backend)
    assert backend.forward_extend(K, K, K, LAYER, _batch(True, 1)) == "extend"


@pytest.mark.skipif(importlib.util.find_spec("sgl_kernel") is None, reason="SGLang's CPU kernels (sgl_kernel) are not installed (scripts/install_sglang_cpu.sh: a Xeon with AMX, or a CPU with AVX-512 bf16 such as an AMD EPYC)")
def test_the_cpu_decode_kernel_over_the_row_equals_the_one_token_extend():
    import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)

    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 3  # the embedded target's attention
    lens = torch.tensor([5, 130, 47], dtype=torch.int64)  # committed tokens per request
    table = torch.zeros(bs, 256, dtype=torch.int32)
    for r in range(bs):
        table[r, : lens[r] + 1] = torch.randperm(1000)[: lens[r] + 1].int() + 1000 * r
    pool = (torch.randn(3000, kv_heads, dim, dtype=torch.bfloat16), torch.randn(3000, kv_heads, dim, dtype=torch.bfloat16))
    q = torch.randn(bs, heads, dim, dtype=torch.bfloat16)
    k, v = torch.randn(bs, kv_heads, dim, dtype=torch.bfloat16), torch.randn(bs, kv_heads, dim, dtype=torch.bfloat16)
    loc = table[torch.arange(bs), lens].long()
    rows = torch.arange(bs)

    def extend():
        kb, vb = pool[0].clone(), pool[1].clone()
        kb[loc], vb[loc] = k, v  # the backend writes the row before its extend kernel
        o = torch.empty_like(q)
        torch.ops.sgl_kernel.extend_attention_cpu(q, k, v, o, kb, vb, table, rows, lens + 1, torch.ones(bs, dtype=torch.int32),
                                                  torch.arange(bs, dtype=torch.int32), 1, dim ** -0.5, 0.0, False, 0, None, None, None)
        return o, kb, vb

    def decode():
        kb, vb = pool[0].clone(), pool[1].clone()
        o, logits = torch.empty_like(q), torch.zeros(bs, heads, 8, dim + 1)
        torch.ops.sgl_kernel.decode_attention_cpu(q, kb, vb, o, k, v, loc, logits, table, rows, lens + 1, dim ** -0.5, 0.0,
                                                  False, 0, None, None)
        return o, kb, vb

    (oe, ke, ve), (od, kd, vd) = extend(), decode()
    assert torch.equal(ke, kd) and torch.equal(ve, vd)  # the row's K/V land where the verify writes them
    torch.testing.assert_close(od.float(), oe.float(), atol=2e-2, rtol=2e-2)  # bf16 accumulation order
