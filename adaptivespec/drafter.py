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
        """Load a head written in the EAGLE-3 layout for ``target`` (checks they fit together)."""
        path = resolve_drafter_path(path)
        raw = json.loads((path / "config.json").read_text())
        tc = target.config
        where = f"drafter {path}"
        vocab = raw.get("vocab_size")
        if vocab != tc.vocab_size:
            raise ModelLoadError(f"{where}: vocab_size {vocab} does not match the target's {tc.vocab_size}")
        raw.pop("architectures", None)
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(tc.num_hidden_layers)
        if len(aux) != 3 or max(aux) + 1 >= tc.num_hidden_layers + 1:
            raise ModelLoadError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} must be 3 layers of a {tc.num_hidden_layers}-layer target")
        target_hidden = raw.get("target_hidden_size") or tc.hidden_size
        over = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings") if raw.get(k)}
        if raw.get("rope_parameters"):
            over["rope_parameters"] = raw["rope_parameters"]
        elif raw.get("rope_theta"):
            over["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
        cfg = cls.make_config(tc, int(raw.get("draft_vocab_size") or tc.vocab_size), **over)
        head = cls(cfg, target.get_input_embeddings(), aux, target_hidden)
        state = _read_weights(path)
        state = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("embed_tokens.weight")}
        if "d2t" not in state:  # a full-vocabulary head
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ModelLoadError(f"{where}: checkpoint does not match the EAGLE-3 layout (missing {missing[:5]}, unexpected {unexpected[:5]})")
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

    def append_kv(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype):
        """Append keys / values [1, kv_heads, b, d] to the cache; returns the cache's keys and values
        up to the new length and the attention mask of the ``b`` new rows (``mask``, or causal over
        the new chunk when None and b > 1)."""
        b, start = k.shape[2], self.length
        self._ensure(start + b)
        self._k[:, :, start : start + b] = k
        self._v[:, :, start : start + b] = v
        self.length = start + b
        if mask is None and b > 1:
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


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"drafter {path}: no {' or '.join(WEIGHTS)} in the folder")


def resolve_drafter_path(path: str | Path) -> Path:
    """``embedded`` -> the shipped head; otherwise a local folder with config.json."""
    if str(path) == "embedded":
        if not (EMBEDDED_HEAD / "config.json").is_file():
            raise ModelLoadError(
                f"model.drafter: the embedded head is not in this installation ({EMBEDDED_HEAD}); "
                "train one with `adaptivespec train-drafter` or point model.drafter at a folder"
            )
        return EMBEDDED_HEAD
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(
            f"model.drafter: {str(path)!r} is not a folder; expected an EAGLE-3 head folder "
            "(config.json + model.safetensors), 'embedded', or null for autoregressive decoding"
        )
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model.drafter: {p} has no config.json; expected an EAGLE-3 head folder")
    return p


@adaptivespec.hookimpl
def adaptivespec_register_drafters(registry):
    registry.register(Eagle3Drafter, name="eagle3")
