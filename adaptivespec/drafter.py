"""The EAGLE-3 draft head, in the checkpoint layout SpecForge and the EAGLE repository use.

Layout (``config.json`` + ``model.safetensors``; ``pytorch_model.bin`` is read too)::

    fc.weight                         [H, 3 * H_target]   fuses three target hidden states
    midlayer.hidden_norm.weight       [H]                 RMSNorm of the fused / recurrent state
    midlayer.input_layernorm.weight   [H]                 RMSNorm of the token embedding
    midlayer.self_attn.{q,k,v}_proj   [*, 2 * H]          attention over [embedding ; state]
    midlayer.self_attn.o_proj         [H, heads * head_dim]
    midlayer.post_attention_layernorm [H]
    midlayer.mlp.{gate,up,down}_proj  Llama MLP
    norm.weight                       [H]
    lm_head.weight                    [Vd, H]             over the draft vocabulary
    d2t                               [Vd] int64          target id = draft id + d2t[draft id]
    t2d                               [V] bool            target id is in the draft vocabulary

The token embedding is the target's (not stored). ``config.json`` carries
``eagle_config.eagle_aux_hidden_state_layer_ids``: the target layers whose *outputs* are fused
(SGLang captures the input of layer id+1, i.e. ``hidden_states[id + 1]`` in transformers).

Indexing convention (as EAGLE): drafter position ``i`` reads the pair
``(embed(token[i + 1]), state[i])`` and predicts ``token[i + 2]``, where ``state[i]`` is
``fc(target hidden states at i)`` for verified tokens and the drafter's own previous output while
drafting.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

import adaptivespec
from adaptivespec.errors import ModelLoadError

log = logging.getLogger("adaptivespec.models")
EMBEDDED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default choice of fused target layers (low, middle, high)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(h2, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, T, 2H] -> q [B, heads, T, d], k / v [B, kv_heads, T, d] (RoPE applied)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, h, T, d], k / v [B, kvh, S, d], additive float mask [B|1, 1, T, S] -> [B, T, h*d]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class Eagle3Layer(nn.Module):
    """EAGLE-3's single decoder layer over ``[input_layernorm(emb) ; hidden_norm(state)]``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def pre(self, emb: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(state)], dim=-1)

    def post(self, state: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = state + self.self_attn.o_proj(attn)  # the residual is the (un-normed) state
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft head with its own preallocated KV cache for inference."""

    kind = "eagle3"

    def __init__(self, cfg: LlamaConfig, embed_tokens: nn.Embedding, aux_layers: list[int], target_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layers = list(aux_layers)
        self.target_hidden = target_hidden
        self.fc = nn.Linear(3 * target_hidden, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)
        object.__setattr__(self, "embed_tokens", embed_tokens)  # shared with the target, not saved
        self._k = self._v = None
        self.length = 0
        self.fast = None
        """The fused inference path (:func:`adaptivespec.fastpath.drafter.fast_drafter` enables it), or None."""

    # -- construction / checkpoints ---------------------------------------------------------
    @staticmethod
    def make_config(target_cfg: Any, draft_vocab_size: int, **over: Any) -> LlamaConfig:
        """A head config mirroring the target's attention geometry (as SpecForge's defaults)."""
        tc = target_cfg
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        kw = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_key_value_heads,
            head_dim=head_dim,
            num_hidden_layers=1,
            rms_norm_eps=tc.rms_norm_eps,
            vocab_size=tc.vocab_size,
            max_position_embeddings=tc.max_position_embeddings,
            hidden_act="silu",
            tie_word_embeddings=False,
            rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        )
        kw.update(over)
        cfg = LlamaConfig(**kw)
        cfg.draft_vocab_size = draft_vocab_size
        cfg.architectures = ["LlamaForCausalLMEagle3"]
        return cfg

    @classmethod
    def random_init(cls, target: nn.Module, draft_vocab_size: int = 8192, seed: int = 0, aux_layers: list[int] | None = None) -> "Eagle3Drafter":
        """An untrained head for ``target`` (tests, and the starting point of training).

        The draft vocabulary is the first ``draft_vocab_size`` target ids until training picks
        the most frequent ones.
        """
        tc = target.config
        cfg = cls.make_config(tc, draft_vocab_size)
        aux = aux_layers or default_aux_layers(tc.num_hidden_layers)
        gen = torch.Generator().manual_seed(seed)
        head = cls(cfg, target.get_input_embeddings(), aux, tc.hidden_size)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[1])))
        head.set_vocab(torch.arange(draft_vocab_size))
        dtype = next(target.parameters()).dtype
        return head.to(dtype=dtype, device=next(target.parameters()).device)

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Set the draft vocabulary to ``target_ids`` (sorted ascending): fills d2t and t2d."""
        ids = torch.sort(torch.as_tensor(target_ids, dtype=torch.long)).values
        if ids.shape[0] != self.config.draft_vocab_size:
            raise ValueError(f"expected {self.config.draft_vocab_size} draft ids, got {ids.shape[0]}")
        self.d2t.copy_(ids - torch.arange(ids.shape[0]))
        self.t2d.zero_()
        self.t2d[ids] = True

    def save_pretrained(self, out: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the EAGLE-3 / SpecForge layout."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=self.config.draft_vocab_size,
            target_hidden_size=self.target_hidden,
            eagle_config={"eagle_aux_hidden_state_layer_ids": self.aux_layers, "use_aux_hidden_state": True},
            torch_dtype=str(self.lm_head.weight.dtype).removeprefix("torch."),
        )
        # what SGLang's EAGLE-3 draft model also reads (tests/test_sglang_api.py checks the shipped head):
        # the dtype, and rope_theta at the top level as well, for readers without rope_parameters
        cfg["dtype"] = cfg["torch_dtype"]
        cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module, dtype: torch.dtype | None = None, device: Any = None) -> "Eagle3Drafter":
        """Load a head written in the EAGLE-3 layout for ``target`` (checks they fit together).

        ``path``: a folder, ``embedded``, or a Hugging Face id already in the local cache. The head's
        own ``config.json`` decides its shape (:func:`head_config`)."""
        path = resolve_drafter_path(path)
        where = f"drafter {path}"
        try:
            raw = json.loads((path / "config.json").read_text())
        except ValueError as exc:
            raise ModelLoadError(f"{where}: config.json is not JSON ({exc})") from None
        cfg, aux, target_hidden = head_config(raw, target.config, where)
        head = cls(cfg, target.get_input_embeddings(), aux, target_hidden)
        state = _read_weights(path)
        state = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("embed_tokens.weight")}
        if "d2t" not in state:  # a full-vocabulary head
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        own = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise ModelLoadError(f"{where}: checkpoint does not match the EAGLE-3 layout (missing {missing[:5]}, unexpected {unexpected[:5]})")
        wrong = [f"{k} {list(state[k].shape)} (config.json makes it {list(v.shape)})" for k, v in own.items()
                 if state[k].shape != v.shape]
        if wrong:
            raise ModelLoadError(f"{where}: the weights do not fit config.json (hidden_size, intermediate_size, "
                                 f"num_attention_heads, num_key_value_heads, head_dim, draft_vocab_size, "
                                 f"target_hidden_size): {'; '.join(wrong[:3])}")
        top = int((state["d2t"] + torch.arange(cfg.draft_vocab_size)).max()) if cfg.draft_vocab_size else 0
        if top >= cfg.vocab_size:
            raise ModelLoadError(f"{where}: d2t maps a draft id to target id {top}, outside the target's vocabulary "
                                 f"of {cfg.vocab_size}")
        head.load_state_dict(state, strict=False)
        p = next(target.parameters())
        return head.to(dtype=dtype or p.dtype, device=device or p.device).eval()

    # -- inference --------------------------------------------------------------------------
    def _fused(self):
        """The fused inference path (:mod:`adaptivespec.fastpath.drafter`) for this call, or None: only where
        the runtime enabled it, no gradient is wanted and the head is in eval mode; packed from the
        current weights."""
        if self.fast is None or self.training or torch.is_grad_enabled():
            return None
        return self.fast.ready(self)

    def train(self, mode: bool = True) -> "Eagle3Drafter":
        """As ``nn.Module.train``; training mode also drops the fused path's packed weights (stale once
        the optimizer steps, and memory the training does not need)."""
        if mode and self.fast is not None:
            self.fast.release()
        return super().train(mode)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; the fused path repacks from the loaded weights on next use."""
        if self.fast is not None:
            self.fast.release()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn, *args, **kwargs):
        self.fast = None  # another device or dtype: the runtime enables the fused path again where it applies
        return super()._apply(fn, *args, **kwargs)

    def fuse(self, target_hidden: tuple[torch.Tensor, ...], index: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' ``hidden_states`` tuple [.., T, H_t] -> fused state [.., T, H]; with ``index``
        only those positions (T -> len(index))."""
        parts = [target_hidden[i + 1] for i in self.aux_layers]
        if index is not None:
            parts = [p[..., index, :] for p in parts]
        fast = self._fused()
        if fast is not None:
            return fast.fuse(parts)
        return self.fc(torch.cat(parts, dim=-1))

    def reset_cache(self, capacity: int = 1024) -> None:
        cfg, p = self.config, self.lm_head.weight
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        if self._k is None or self._k.shape[2] < capacity or self._k.device != p.device or self._k.dtype != p.dtype:
            self._k = torch.empty(shape, dtype=p.dtype, device=p.device)
            self._v = torch.empty(shape, dtype=p.dtype, device=p.device)
        self.length = 0

    def _ensure(self, needed: int) -> None:
        if needed > self._k.shape[2]:
            cap = max(needed, 2 * self._k.shape[2])
            k = torch.empty(self._k.shape[:2] + (cap, self._k.shape[3]), dtype=self._k.dtype, device=self._k.device)
            v = torch.empty_like(k)
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = k, v

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype,
                  build_mask: bool = True):
        """Append keys / values [1, kv_heads, b, d] to the cache; returns the cache's keys and values
        up to the new length and the attention mask of the ``b`` new rows (``mask``, or causal over
        the new chunk when None and b > 1, unless ``build_mask`` is False: a caller that attends
        causally without one)."""
        b, start = k.shape[2], self.length
        self._ensure(start + b)
        self._k[:, :, start : start + b] = k
        self._v[:, :, start : start + b] = v
        self.length = start + b
        if mask is None and b > 1 and build_mask:
            mask = torch.zeros(1, 1, b, self.length, dtype=dtype, device=k.device)
            mask[..., start:] = torch.full((b, b), float("-inf"), dtype=dtype, device=k.device).triu(1)
        return self._k[:, :, : self.length], self._v[:, :, : self.length], mask

    def step(self, tokens: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Run ``b`` new positions and append their keys / values to the cache.

        tokens [b] target ids; state [b, H]; positions [b]; mask: additive float
        [1, 1, b, length + b] (None = causal over the new chunk). Returns output states [b, H].
        """
        fast = self._fused()
        if fast is not None:
            return fast.step(self, tokens, state, positions, mask)
        x = self.midlayer.pre(self.embed_tokens(tokens), state).unsqueeze(0)  # [1, b, 2H]
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)
        keys, values, mask = self.append_kv(k, v, mask, x.dtype)
        attn = self.midlayer.self_attn.attend(q, keys, values, mask)
        return self.midlayer.post(state.unsqueeze(0), attn).squeeze(0)

    def log_probs(self, out_state: torch.Tensor) -> torch.Tensor:
        """Output states [.., H] -> draft-vocabulary log-probabilities [.., Vd] (float32)."""
        fast = self._fused()
        if fast is not None:
            return fast.log_probs(out_state)
        return torch.log_softmax(self.lm_head(self.norm(out_state)).float(), dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


DEFAULT_ROPE_THETA = 10000.0
"""RoPE θ of a head whose config.json names no RoPE keys: the reference implementations' (SGLang's
``LlamaForCausalLMEagle3`` reads the head's own config, ``rope_theta`` defaulting to 10000; EAGLE's
``cnets.py`` builds its rotary embedding with base 10000 unless the config names ``rope_theta``).
A head trained by them with such a config would lose acceptance if it inherited a Llama-3 target's
θ 500000 and llama3 scaling instead."""
_told: set[str] = set()


def head_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The head's RoPE parameters (transformers' ``rope_parameters``) from its config.json, and whether
    the config named any: ``rope_parameters``, else ``rope_scaling`` (the legacy key: its ``type`` or
    ``rope_type``, factor, ...) with ``rope_theta``, else θ :data:`DEFAULT_ROPE_THETA` unscaled."""
    if raw.get("rope_parameters"):
        return dict(raw["rope_parameters"]), True
    scaling, theta = raw.get("rope_scaling"), raw.get("rope_theta")
    if not scaling and theta is None:
        return {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA}, False
    params = dict(scaling or {})
    kind = params.pop("type", None)
    params["rope_type"] = params.get("rope_type") or kind or "default"
    params["rope_theta"] = float(theta if theta is not None else DEFAULT_ROPE_THETA)
    return params, True


def head_config(raw: dict[str, Any], target_config: Any, where: str) -> tuple[LlamaConfig, list[int], int]:
    """(config, fused target layers, target hidden size) of a head from its ``config.json`` ``raw``,
    checked against the target's config; a head that does not fit is a one-line
    :class:`~adaptivespec.errors.ModelLoadError` naming the keys.

    The head's own keys decide its shape, as ``LlamaConfig`` reads them: ``head_dim`` when given,
    else ``hidden_size / num_attention_heads`` (never the target's ``head_dim``: a Qwen3 target's 128
    is not its head's); ``num_key_value_heads`` defaults to the heads. Keys the config leaves out
    (``intermediate_size``, ``rms_norm_eps``, ...) mirror the target's, as :meth:`Eagle3Drafter.make_config`
    does for a new head. RoPE: :func:`head_rope` (its default said once in the log)."""
    tc = target_config
    hidden = raw.get("hidden_size") or tc.hidden_size
    if hidden != tc.hidden_size:
        raise ModelLoadError(f"{where}: hidden_size {hidden} does not match the target's hidden_size {tc.hidden_size} "
                             "(the head reads the target's token embeddings)")
    vocab = raw.get("vocab_size") or tc.vocab_size
    if vocab != tc.vocab_size:
        raise ModelLoadError(f"{where}: vocab_size {vocab} does not match the target's {tc.vocab_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or tc.vocab_size)
    if not 0 < draft_vocab <= tc.vocab_size:
        raise ModelLoadError(f"{where}: draft_vocab_size {draft_vocab}: expected 1 to the target's vocab_size {tc.vocab_size}")
    target_hidden = raw.get("target_hidden_size") or tc.hidden_size
    if target_hidden != tc.hidden_size:
        raise ModelLoadError(f"{where}: target_hidden_size {target_hidden} does not match the target's hidden_size "
                             f"{tc.hidden_size}")
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(tc.num_hidden_layers)
    if len(aux) != 3 or min(aux) < 0 or max(aux) >= tc.num_hidden_layers:
        raise ModelLoadError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {aux}: expected 3 layers of "
                             f"the {tc.num_hidden_layers}-layer target (0 to {tc.num_hidden_layers - 1})")
    heads = raw.get("num_attention_heads") or tc.num_attention_heads
    kv_heads = raw.get("num_key_value_heads") or (heads if raw.get("num_attention_heads") else tc.num_key_value_heads)
    head_dim = raw.get("head_dim")
    if not head_dim:
        if hidden % heads:
            raise ModelLoadError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                                 "config.json names no head_dim")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    rope, named = head_rope(raw)
    if not named and where not in _told:
        _told.add(where)
        log.warning("adaptivespec: %s: config.json names no rope_theta, rope_scaling or rope_parameters: RoPE θ %g unscaled, as "
                    "SGLang and EAGLE read such a head (not the target's RoPE)", where, DEFAULT_ROPE_THETA)
    over = {k: raw[k] for k in ("intermediate_size", "rms_norm_eps", "max_position_embeddings") if raw.get(k)}
    cfg = Eagle3Drafter.make_config(tc, draft_vocab, hidden_size=hidden, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, head_dim=head_dim, rope_parameters=rope, **over)
    return cfg, list(aux), target_hidden


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"drafter {path}: no {' or '.join(WEIGHTS)} in the folder")


def resolve_drafter_path(path: str | Path) -> Path:
    """``embedded`` -> the shipped head; a local folder with config.json; or a Hugging Face id
    (``owner/name``) already in the local cache, as ``model.target`` accepts one: never downloaded."""
    if str(path) == "embedded":
        if not (EMBEDDED_HEAD / "config.json").is_file():
            raise ModelLoadError(
                f"model.drafter: the embedded head is not in this installation ({EMBEDDED_HEAD}); "
                "train one with `adaptivespec train-drafter` or point model.drafter at a folder"
            )
        return EMBEDDED_HEAD
    p = Path(path).expanduser()
    if not p.exists() and _looks_like_id(str(path)):
        cached = _cached_snapshot(str(path))
        if cached is None:
            raise ModelLoadError(
                f"model.drafter: {str(path)!r} is neither a folder nor a Hugging Face id in the local cache (nothing is "
                "downloaded); expected an EAGLE-3 head folder (config.json + model.safetensors), a cached id, "
                "'embedded', or null for autoregressive decoding"
            )
        p = cached
    if not p.is_dir():
        raise ModelLoadError(
            f"model.drafter: {str(path)!r} is not a folder; expected an EAGLE-3 head folder "
            "(config.json + model.safetensors), a Hugging Face id in the local cache, 'embedded', or null for "
            "autoregressive decoding"
        )
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model.drafter: {p} has no config.json; expected an EAGLE-3 head folder")
    return p


def _looks_like_id(text: str) -> bool:
    """``owner/name`` as the Hugging Face hub spells a repository (not a path: no leading ``.``, ``/`` or ``~``)."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of ``repo_id`` in the Hugging Face cache, or None; never downloads."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), a malformed id, no hub library
        return None


@adaptivespec.hookimpl
def adaptivespec_register_drafters(registry):
    registry.register(Eagle3Drafter, name="eagle3")
