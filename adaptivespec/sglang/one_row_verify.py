"""The step that drafts nothing, with plain decoding's attention. No sglang import (the backend is passed in).

An undrafted step (the load controls' :data:`~adaptivespec.sglang.shapes.NO_DRAFT`) is still an EAGLE
verify: one row per request, the request's last token, run in ``TARGET_VERIFY`` mode. SGLang's CPU
attention backend runs that mode with its *extend* kernel, which at 8 requests of ~400 tokens costs
2.6x its decode kernel for the same one query per request (9.8 vs 3.8 ms per forward of the 30-layer
embedded target, measured with the CPU kernels on this project's machine) -- a large part of why an
undrafted served step cost more than a step of SGLang's plain decoding. A one-row verify *is* a decode
step: :func:`decode_one_row_verify` makes the undrafted state's target backend run it with the decode
kernel, over the sequence plus the row, writing the row's K/V where the verify would.
"""

from __future__ import annotations

from typing import Any

ENV = "ADAPTIVESPEC_SGLANG_ONE_ROW_DECODE"
"""``0``: the no-draft step keeps SGLang's extend kernel."""

BACKENDS = ("IntelAMXAttnBackend",)
"""The attention backends whose one-row verify runs as a decode (their ``forward_decode`` reads
``draft_decode_metadata`` for its sequence table and lengths when it is set)."""


def decode_one_row_verify(backend: Any) -> bool:
    """Route ``backend``'s one-row target verify through its decode kernel; returns whether it did
    (False for backends not in :data:`BACKENDS`: they keep SGLang's path)."""
    if type(backend).__name__ not in BACKENDS or getattr(backend, "_adaptivespec_one_row", False):
        return False
    extend = backend.forward_extend

    def forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        spec = forward_batch.spec_info
        if (
            not forward_batch.forward_mode.is_target_verify()
            or getattr(spec, "draft_token_num", 0) != 1
            or layer.is_cross_attention
            or not save_kv_cache
            or k is None
            or backend.draft_decode_metadata is not None
        ):
            return extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        # the verify's metadata already holds the lengths with the row: seq_lens + 1
        seq_lens = backend.extend_metadata[0]
        backend.draft_decode_metadata = (
            backend.req_to_token_pool.req_to_token, seq_lens, forward_batch.req_pool_indices
        )
        try:
            return backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs)
        finally:
            backend.draft_decode_metadata = None

    backend.forward_extend = forward_extend
    backend._adaptivespec_one_row = True
    return True
