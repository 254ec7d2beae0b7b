"""What SGLang reads from an EAGLE-3 head's ``config.json``, read off its sources with ``ast``, and
whether a head's config carries every key SGLang needs (:func:`check_head_config`)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from adaptivespec.sglang.api import Api, SGLangAPIError
from adaptivespec.sglang.source_ast import find, module_candidates


# -- the EAGLE-3 draft model's config keys (what SGLang reads from a head's config.json) -----------
DRAFT_MODEL_API: tuple[Api, ...] = (
    Api("sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3", "class",
        why="the architecture a head's config.json names; its config reads are checked by check_head_config"),
    Api("sglang.srt.models.llama", "LlamaDecoderLayer", "class", why="the draft layer's base class"),
    Api("sglang.srt.models.llama", "LlamaAttention", "class"),
    Api("sglang.srt.models.llama", "LlamaMLP", "class"),
)
"""Sources read by :func:`draft_config_reads` (the draft model and the parts of Llama it builds on)."""

MODEL_SPECIFIC_READS = ("rope_parameters", "rope_theta", "head_dim", "max_position_embeddings", "eagle_config")
"""Keys SGLang reads with a default (``getattr(config, key, default)``) that is wrong for some
models (``rope_theta`` 10000, ``max_position_embeddings`` 8192, ...): a head must carry them."""

CONDITIONAL_READS = {"intermediate_size_mlp": "read only when model_type is llama4_text"}
"""Hard ``config.X`` reads that do not apply to a Llama head."""


def _config_reads(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(``config.X`` / ``self.config.X`` loads, ``getattr(config, "X", default)`` keys, keys read
    from ``rope_parameters`` / ``rope_scaling`` dicts with ``.get("X", ...)``) under ``node``."""
    def is_config(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "config") or (
            isinstance(n, ast.Attribute) and n.attr == "config" and isinstance(n.value, ast.Name) and n.value.id == "self")

    hard, soft, rope = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load) and is_config(sub.value):
            hard.add(sub.attr)
        elif isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Name) and f.id == "getattr" and len(sub.args) >= 2 and is_config(sub.args[0]) \
                    and isinstance(sub.args[1], ast.Constant):
                (soft if len(sub.args) > 2 else hard).add(sub.args[1].value)
            elif isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name) \
                    and f.value.id in ("rope_parameters", "rope_scaling") and sub.args and isinstance(sub.args[0], ast.Constant):
                rope.add(sub.args[0].value)
    return hard, soft, rope


def draft_config_reads(root: Path) -> dict[str, set[str]]:
    """Config keys SGLang's EAGLE-3 Llama draft model reads, from the sources under ``root``:
    ``required`` (attribute reads, no default), ``optional`` (``getattr`` with a default) and
    ``rope`` (keys read from the rope parameters dict)."""
    hard, soft, rope = set(), set(), set()
    for api in DRAFT_MODEL_API:
        path = next((root / c for c in module_candidates(api.module) if (root / c).is_file()), None)
        if path is None:
            raise SGLangAPIError(f"{api.module}: module not found under {root}")
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        node = tree if api.module.endswith("llama_eagle3") else find(tree, api.name)
        if node is None:
            raise SGLangAPIError(f"{api.where()}: not found under {root}")
        h, s, r = _config_reads(node)
        hard, soft, rope = hard | h, soft | s, rope | r
    # a direct read guarded by ``getattr(config, "X", default)`` elsewhere is optional
    return {"required": hard - soft - set(CONDITIONAL_READS), "optional": soft, "rope": rope}


def check_head_config(config: dict[str, Any], root: Path, target_config: dict[str, Any] | None = None) -> list[str]:
    """Problems of a head's ``config.json`` (as a dict) for SGLang's EAGLE-3 Llama draft model.

    Every key the model reads without a default must be there; the rope settings must be there
    too (SGLang falls back to ``rope_theta`` 10000 silently) and, given ``target_config``, equal the
    target's; ``architectures`` must name ``LlamaForCausalLMEagle3`` and the dtype must be set."""
    reads = draft_config_reads(root)
    problems = [f"config.json: missing {key!r} (read by SGLang's LlamaForCausalLMEagle3)"
                for key in sorted(reads["required"]) if key not in config]
    problems += [f"config.json: missing {key!r} (SGLang's LlamaForCausalLMEagle3 falls back to a default that fits "
                 "other models)" for key in MODEL_SPECIFIC_READS if key in reads["optional"] and key not in config]
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    theta = (rope or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        problems.append("config.json: no rope_theta (in rope_parameters or top level); SGLang would use 10000")
    if rope is not None and not ({"rope_type", "type"} & set(rope)):
        problems.append("config.json: rope_parameters has no rope_type; SGLang's get_rope refuses it")
    if target_config is not None:
        t_rope = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
        t_theta = t_rope.get("rope_theta", target_config.get("rope_theta", 10000.0))
        for name, value in (("rope_parameters.rope_theta", theta), ("rope_theta", config.get("rope_theta"))):
            if value is not None and float(value) != float(t_theta):
                problems.append(f"config.json: {name} {value} differs from the target's {t_theta}")
    if "LlamaForCausalLMEagle3" not in (config.get("architectures") or []):
        problems.append(f"config.json: architectures {config.get('architectures')!r} does not name LlamaForCausalLMEagle3")
    if not (config.get("dtype") or config.get("torch_dtype")):
        problems.append("config.json: neither dtype nor torch_dtype is set; SGLang would assume float32")
    return problems
