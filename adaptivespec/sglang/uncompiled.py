"""SGLang functions the plugin runs uncompiled on a CPU. No sglang import (the module is passed in).

SGLang wraps ``spec_utils._select_top_k_tokens_later`` (a draft level's top-k) in ``torch.compile``
with its level and topk specialised: each new (level, topk) an adaptive policy's shapes reach compiles
it again, a stall of up to seconds in the middle of a request, and on a CPU compiling does not pay.
Profiled at 8 concurrent requests: 79 of 2017 samples of the scheduler were spent compiling it.
On tokens/s at one request the effect was within the noise (two pairs of runs, `docs/serving.md`).
``ADAPTIVESPEC_SGLANG_COMPILED_TOPK=1`` keeps SGLang's compiled function.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "ADAPTIVESPEC_SGLANG_COMPILED_TOPK"
COMPILED = ("_select_top_k_tokens_later",)
"""The ``spec_utils`` functions run uncompiled (each is looked up per call by its caller)."""


def run_uncompiled(spec_utils: Any) -> list[str]:
    """Replace each compiled function of :data:`COMPILED` in ``spec_utils`` by the function it wraps;
    returns the names replaced (none when ``$ADAPTIVESPEC_SGLANG_COMPILED_TOPK=1``)."""
    if os.environ.get(ENV, "0") == "1":
        return []
    done = []
    for name in COMPILED:
        original = getattr(getattr(spec_utils, name, None), "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(spec_utils, name, original)
            done.append(name)
    return done
