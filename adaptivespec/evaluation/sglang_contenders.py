"""SGLang in ``adaptivespec bench``: as a peer (``--peers sglang,sglang-eagle3,sglang-ngram``) and as
a backend (``--backend sglang``: every config served through the adaptivespec plugin).

Each contender owns one local SGLang server (:class:`adaptivespec.sglang.server.SGLangServer`),
started when the bench builds its contenders and stopped when the run ends (or fails). Requests
go to SGLang's native ``POST /generate`` as token ids (the bench's own chat-template encoding, so
every contender decodes the very same prompt), greedy unless the config samples; the prefix cache
is flushed before each prompt, untimed: no contender reuses another prompt's (or its own warm-up's)
prefill, and greedy outputs do not depend on what ran before (docs/serving.md).

Stats, as the bench's other contenders report them: ``wall_seconds`` is the request's round trip
(prefill included), ``target_forwards`` SGLang's verify steps (``meta_info.spec_verify_ct``; the
token count for plain decoding), so ``accept_length_mean`` is SGLang's accept length. Per-step
records come from the plugin's trace for ``--backend sglang`` (``accepted``), none for peers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from transformers import AutoTokenizer

from adaptivespec.config import Config
from adaptivespec.constraints import sglang_sampling_params
from adaptivespec.decode import GenerationResult
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.contenders import generate_untimed
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.spec import config_lossless, sampling_seed
from adaptivespec.models import EMBEDDED, embedded_folder, encode_prompt

SGLANG_PEERS = {
    "sglang": "SGLang's plain decoding (its Intel AMX kernels on a CPU)",
    "sglang-eagle3": "SGLang's static EAGLE-3 with the shipped head at configs/eagle3.yaml's shape",
    "sglang-ngram": "SGLang's n-gram drafting (NGRAM)",
    "sglang-adaptive": "SGLang's own adaptive speculation (--speculative-adaptive) from configs/eagle3.yaml's shape; "
                       "reported as not supported where the server refuses to start (SGLang 0.5.23 on a CPU)",
}
MAY_BE_UNSUPPORTED = ("sglang-adaptive",)
"""Peers whose failure to start is a result (the row says "not supported here" and why), not an error."""
BENCH_KV_TOKENS = 16384
"""``--max-total-tokens`` of each bench server (several run side by side; one prompt at a time)."""


class ConfigPrompts:
    """The prompt side of a contender served over HTTP: the config's target tokenizer (loaded once, on
    first use), its chat template and its sampling seeds. Needs ``self.config`` and ``self._tokenizer``."""

    config: Config
    _tokenizer: Any = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            target = str(self.config.model.target)
            if target.endswith(".gguf"):  # the llama.cpp runtime's file: its tokenizer, as that runtime reads it
                from adaptivespec.llamacpp.target import gguf_path, gguf_tokenizer

                self._tokenizer = gguf_tokenizer(gguf_path(target))
            else:
                self._tokenizer = AutoTokenizer.from_pretrained(str(embedded_folder()) if target == EMBEDDED else target)
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat=self.config.generation.chat_template)

    def seed_for(self, index: int) -> int | None:
        return sampling_seed(self.config, index)


class SGLangContender(ConfigPrompts):
    """One SGLang server in a bench run: a peer mode or a config served through the plugin; a
    :class:`~adaptivespec.evaluation.contenders.Contender`."""

    lossless = True
    autoregressive = False

    def __init__(self, name: str, config: Config, *, peer: str | None = None, config_path: str | None = None,
                 server_factory: Callable | None = None, kv_tokens: int = BENCH_KV_TOKENS) -> None:
        """``kv_tokens``: the server's ``--max-total-tokens`` (a load run sizes it for its highest level)."""
        from adaptivespec.sglang.server import SGLangServer, free_port, peer_command, served_command

        self.name, self.config = name, config
        self.kind = "peer" if peer else "config"
        self._tokenizer = None
        self._trace: Path | None = None
        port = free_port()
        extra = ["--max-total-tokens", str(kv_tokens)]
        logdir = Path(tempfile.mkdtemp(prefix=f"adaptivespec-sglang-{name}-"))
        if peer:
            argv, env = peer_command(peer, port, extra_args=extra)
        else:
            if config_path is None:
                raise AdaptiveSpecError(f"{name}: --backend sglang serves config files; this config has no file")
            self._trace = logdir / "steps.jsonl"
            argv, env = served_command(config_path, port, trace=self._trace, extra_args=extra)
            self.lossless = config_lossless(config)
        self.server = (server_factory or SGLangServer)(argv, env, logdir / "server.log", timeout=600)
        self.server.start()  # paused after its first generation: not while other servers start up


    # -- the bench's contender interface ----------------------------------------------------------
    def warm_up(self, problems: list[Problem], max_new_tokens: int, formats: Iterable[Any] = ()) -> None:
        """Warm up on every prompt, then flush the prefix cache: SGLang's CPU backend compiles kernels
        per new prompt length and batch size on first use (stalls of 90-200 s were seen inside timed
        runs). SGLang compiles grammars itself."""
        generate_untimed(self, problems, max_new_tokens)
        self.forget()

    def forget(self) -> None:
        self._resume()
        try:
            self.server.flush_cache()
        finally:
            self._pause()

    def _pause(self) -> None:
        """Idle servers are stopped (SIGSTOP) between their own generations: an idle SGLang
        scheduler busy-polls and would slow the contender being measured."""
        if hasattr(self.server, "pause"):
            self.server.pause()

    def _resume(self) -> None:
        if hasattr(self.server, "resume"):
            self.server.resume()

    def close(self) -> None:
        self.server.stop()

    def generate_ids(self, prompt_ids: list[int], *, max_new_tokens: int, on_step=None, seed: int | None = None,
                     response_format=None):
        """``response_format`` (default: the config's) goes to SGLang as its own constrained
        decoding's sampling parameter (``json_schema``, ``regex`` or ``ebnf``)."""
        g = self.config.generation
        sampling: dict[str, Any] = {}
        if g.temperature > 0:
            sampling = {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k or -1, "min_p": g.min_p or 0.0,
                        "sampling_seed": g.seed if seed is None else seed}
        if not g.stop_at_eos:
            sampling["ignore_eos"] = True
        fmt = response_format if response_format is not None else g.response_format
        if fmt is not None:
            sampling.update(sglang_sampling_params(fmt))
        self._resume()
        try:
            self.server.flush_cache()
            before = self._trace_lines()
            out = self.server.generate(prompt_ids, max_new_tokens, **sampling)
        finally:
            self._pause()
        meta = out.get("meta_info", {})
        ids = list(out.get("output_ids") or [])
        new = int(meta.get("completion_tokens", len(ids)))
        verify = meta.get("spec_verify_ct") or new
        wall = out["wall_seconds"]
        steps = self._trace_records(before)
        stats = {
            "new_tokens": new,
            "target_forwards": int(verify),
            "accept_length_mean": new / verify if verify else None,
            "wall_seconds": wall,
            "tokens_per_second": new / wall if wall > 0 else 0.0,
            "promoted_tokens": 0,
        }
        if on_step is not None:
            for s in steps:
                on_step(s)
        return GenerationResult(token_ids=ids, text=out.get("text", ""), stats=stats, records=steps)

    # -- the plugin's step trace ------------------------------------------------------------------
    def _trace_lines(self) -> int:
        if self._trace is None or not self._trace.exists():
            return 0
        return sum(1 for _ in self._trace.open())

    def _trace_records(self, skip: int) -> list:
        if self._trace is None or not self._trace.exists():
            return []
        lines = self._trace.read_text().splitlines()[skip:]
        return [_TraceStep(json.loads(line)) for line in lines if line.strip()]


class _TraceStep:
    """A trace line where the bench reads a StepRecord (``accepted``, ``shape``)."""

    def __init__(self, d: dict) -> None:
        self.accepted = int(d["accepted"])
        self.shape = tuple(d["shape"])
        self.batch_size = d.get("bs")
        self.undrafted = None  # SGLang's trace has a line per drafted step


def served_config_file(config: Config, name: str) -> str:
    """A YAML file of ``config`` as loaded (``--set`` overrides applied), for ``adaptivespec serve``."""
    folder = Path(tempfile.mkdtemp(prefix=f"adaptivespec-served-{name}-"))
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(config.to_dict(), default=str)), sort_keys=False))
    return str(path)


def describe_sglang_peer(name: str, config: Config) -> dict[str, Any]:
    """What stands in for a config in the results for SGLang's own modes."""
    from adaptivespec.sglang.server import NGRAM_DRAFT_TOKENS

    out: dict[str, Any] = {"peer": name, "what": SGLANG_PEERS[name], "model": {"target": config.model.target},
                           "runtime": {"engine": "sglang", "max_total_tokens": BENCH_KV_TOKENS}}
    if name in ("sglang-eagle3", "sglang-adaptive"):
        out["model"]["drafter"] = config.model.drafter
        out["shape"] = "configs/eagle3.yaml"
    if name == "sglang-ngram":
        out["speculative_num_draft_tokens"] = NGRAM_DRAFT_TOKENS
    return out
