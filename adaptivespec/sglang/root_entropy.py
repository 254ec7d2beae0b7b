"""The entropy of the draft's distribution at each request's root, read from SGLang's draft-extend.

SGLang hands the next step only the root's top-k probabilities (``topk_p``); a policy that reads the
draft's entropy at the root (``learned``: one of its fitted features, computed over the head's whole
vocabulary in the torch runtime, :func:`adaptivespec.sampling.root_stats`) needs the whole
distribution. The EAGLE worker module's ``renorm_draft_probs`` (looked up per call) is wrapped so
that, while the draft worker runs its draft-extend (:func:`measuring`), the entropy of the
probabilities it returns is kept, one value per request ([bs], on the device: read to the host with
the step's other signals, :meth:`~adaptivespec.sglang.controller.TripletController.begin_step`).
Imported only inside SGLang's processes, but imports no sglang itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from adaptivespec.sglang.module_wraps import wrap_once

_STATE: dict[str, Any] = {"on": False, "last": None}


def keep_root_entropy(ew: Any) -> None:
    """Wrap ``ew.renorm_draft_probs`` (SGLang's EAGLE worker module) once."""
    wrap_once(ew, "renorm_draft_probs", _renorm_keeping_entropy)


def _renorm_keeping_entropy(renorm, *args, **kwargs):
    probs = renorm(*args, **kwargs)
    if _STATE["on"] and probs.dim() == 2:
        _STATE["last"] = entropy(probs)
    return probs


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of ``probs`` [rows, V] (zeros contribute nothing)."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


@contextlib.contextmanager
def measuring(on: bool) -> Iterator[None]:
    """Within: the draft-extend's root distributions are measured (``on`` False: nothing is done)."""
    if not on:
        yield
        return
    _STATE["on"] = True
    try:
        yield
    finally:
        _STATE["on"] = False


def take(rows: int) -> torch.Tensor | None:
    """The last measured entropies if there are ``rows`` of them (one per request of the step), else
    None; either way they are used once."""
    last, _STATE["last"] = _STATE["last"], None
    return last if last is not None and last.shape[0] == rows else None
