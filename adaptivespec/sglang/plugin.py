"""SGLang plugin: each EAGLE step runs at the tree shape an adaptivespec policy picks, verified by
an adaptivespec verifier.

SGLang (0.5.23) runs every function advertised in the entry-point group ``sglang.srt.plugins`` in
each of its processes (``load_plugins``: launcher, scheduler, detokenizer), then applies the hooks
they registered with ``HookRegistry``. :func:`register` is ours; it does nothing unless
``ADAPTIVESPEC_CONFIG`` names an adaptivespec YAML (``adaptivespec serve`` sets it). Then it

1. asserts the SGLang API it needs (:func:`adaptivespec.sglang.api_check.assert_api`) and reads the config;
2. replaces ``EAGLEWorkerV2`` (the worker of ``--speculative-algorithm EAGLE3``: the algorithm name
   stays, so every EAGLE-3 code path stays) and its ``EagleDraftWorker`` by subclasses that keep
   a :class:`~adaptivespec.sglang.state_bank.ShapeStateBank` of captured states, one per policy
   shape, and ask a :class:`~adaptivespec.sglang.controller.TripletController` for each step's
   shape (:mod:`adaptivespec.sglang.workers`);
3. wraps ``eagle_sample`` so that, inside our worker's verify and when the verifier is lossy (a
   lossless one, ``strict``, accepts what SGLang's own verify accepts), the adaptivespec verifier
   decides what is accepted (greedy batches only: sampled batches keep SGLang's own lossless tree
   sampling, and ``serve`` refuses a lossy verifier in a config at ``generation.temperature > 0``);
4. wraps ``get_alloc_len_per_decode`` so every decode reserves KV for the largest bank shape: the
   scheduler reserves before the policy has chosen.

The server must start at the bank's largest shape (``ShapeStateBank.max_shape``), so every buffer
SGLang sizes from its arguments fits every shape. SGLang's ``load_plugins`` logs a plugin's
exception and carries on; so that a broken setup never runs as plain EAGLE-3, a failure here also
makes the EAGLE worker refuse to start, with the same message.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.sglang import CONFIG_ENV
from adaptivespec.sglang.api_check import assert_api
from adaptivespec.sglang.controller import build_strategies
from adaptivespec.sglang.shapes import sglang_shapes
from adaptivespec.sglang.state_bank import KV_RESERVE, ShapeStateBank
from adaptivespec.sglang.verification import VERIFYING, wrap_verify

logger = logging.getLogger("adaptivespec.sglang")

WORKER_TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
DRAFT_TARGET = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
SAMPLE_TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
KV_TARGET = "sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode"
VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"

_WARNED: set[str] = set()


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: install adaptivespec when configured."""
    path = os.environ.get(CONFIG_ENV, "").strip()
    if not path:
        logger.info("%s is not set: the adaptivespec plugin stays inactive", CONFIG_ENV)
        return
    try:
        assert_api()
        config = load_config(path)
        ShapeStateBank(sglang_shapes(build_strategies(config)[0].shapes()))  # refuse what SGLang cannot run, now
        _install()
    except Exception as exc:
        _refuse_eagle_worker(f"{type(exc).__name__}: {exc}")
        raise


def _install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import eagle_worker_common  # noqa: F401  holds eagle_sample by name

    from adaptivespec.sglang.workers import AdaptiveSpecDraftWorker, AdaptiveSpecWorker  # imports SGLang

    HookRegistry.register(DRAFT_TARGET, AdaptiveSpecDraftWorker, HookType.REPLACE)
    HookRegistry.register(WORKER_TARGET, AdaptiveSpecWorker, HookType.REPLACE)
    HookRegistry.register(SAMPLE_TARGET, _eagle_sample_around, HookType.AROUND)
    HookRegistry.register(KV_TARGET, _kv_alloc_len_around, HookType.AROUND)
    HookRegistry.register(VALIDATE_TARGET, _validate_request_around, HookType.AROUND)


def _refuse_eagle_worker(message: str) -> None:
    """Make the EAGLE worker fail at construction with ``message`` (best effort)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        from sglang.srt.speculative import eagle_worker_v2
    except ImportError:
        return  # no SGLang to block
    try:

        class RefusedEAGLEWorker(eagle_worker_v2.EAGLEWorkerV2):
            def __init__(self, *args, **kwargs):
                raise AdaptiveSpecError(f"adaptivespec SGLang plugin failed to load ({CONFIG_ENV} is set): {message}")

        HookRegistry.register(WORKER_TARGET, RefusedEAGLEWorker, HookType.REPLACE)
    except Exception:
        logger.exception("adaptivespec: could not block the EAGLE worker after a failed load")


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _eagle_sample_around(original, *args, **kwargs):
    """AROUND hook of ``eagle_sample``: SGLang's pass first (it applies penalties and the grammar
    mask to the logits in place), then, inside our worker's verify, the adaptivespec verifier."""
    out = original(*args, **kwargs)
    worker = VERIFYING.get()
    if worker is None:
        return out
    if original not in _SIGNATURES:
        _SIGNATURES[original] = inspect.signature(original)
    bound = _SIGNATURES[original].bind(*args, **kwargs).arguments
    verify_input, batch, logits_output = bound["verify_input"], bound["batch"], bound["logits_output"]
    if batch.forward_mode.is_idle():
        return out
    if not batch.sampling_info.is_all_greedy:
        _warn_once(f"adaptivespec: verifier {worker.adaptivespec_verifier.name!r} runs on greedy batches; "
                   "sampled batches use SGLang's lossless verification")
        return out
    bs = verify_input.retrieve_index.shape[0]
    result = wrap_verify(
        worker.adaptivespec_verifier,
        candidates=verify_input.draft_token.reshape(bs, verify_input.draft_token_num),
        retrieve_index=verify_input.retrieve_index,
        retrieve_next_token=verify_input.retrieve_next_token,
        retrieve_next_sibling=verify_input.retrieve_next_sibling,
        logits=logits_output.next_token_logits,
        spec_steps=verify_input.spec_steps,
        topk=verify_input.topk,
    )
    worker.adaptivespec.note_promoted(result.promoted)
    return result.predict, result.accept_lens, result.accept_index


def _kv_alloc_len_around(original, *args, **kwargs):
    """AROUND hook of ``get_alloc_len_per_decode``: never less than the largest bank shape needs."""
    return max(original(*args, **kwargs), KV_RESERVE["len"])


def _validate_request_around(original, *args, **kwargs):
    """AROUND hook of the tokenizer manager's request check: token ids outside the vocabulary are
    refused there (HTTP 400, SGLang's own error path), as SGLang 0.5.23 does for
    ``token_ids_logprob`` but not for ``input_ids``: an out-of-range prompt id otherwise reaches
    the embedding in the scheduler and kills the server."""
    manager = args[0] if args else None
    input_ids = kwargs.get("input_ids", args[2] if len(args) > 2 else None)
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    if vocab and input_ids:
        bad = next((t for t in input_ids if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab}).")
    return original(*args, **kwargs)
