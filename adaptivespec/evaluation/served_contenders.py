"""A config served over HTTP by ``adaptivespec serve --runtime torch`` in ``adaptivespec bench``
(``--served-configs FILE...``: each runs as ``<stem>-served`` beside the configs on the engine
and the SGLang peers, so one run measures what HTTP and streaming cost).

Each contender owns one local server (started when the bench builds its contenders, stopped when
the run ends) and paused (SIGSTOP) between its own generations, as the SGLang contenders are: an
idle process's OpenMP threads would otherwise spin beside the contender being measured. Requests go to ``POST /v1/completions`` as the bench's own prompt token ids (so
every contender decodes the very same prompt), streamed (``"stream": true``) as a chat client
would read them. Stats: ``wall_seconds`` is the client's round trip, ``prefill_seconds`` the time
to the first streamed text, ``target_forwards`` and ``promoted_tokens`` the server's
``speculation`` on the last chunk; no per-step records.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence


from adaptivespec.config import Config
from adaptivespec.constraints import openai_response_format, sglang_sampling_params
from adaptivespec.decode import GenerationResult
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.contenders import generate_untimed, warmup_problems
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.load import post_stream
from adaptivespec.evaluation.sglang_contenders import ConfigPrompts
from adaptivespec.evaluation.spec import config_lossless
from adaptivespec.server.launch import torch_command

SERVED_SUFFIX = "-served"


class TorchServedContender(ConfigPrompts):
    """One ``serve --runtime torch`` server in a bench run; a
    :class:`~adaptivespec.evaluation.contenders.Contender`."""

    kind = "config"

    def __init__(self, name: str, config: Config, config_path: str, *, queue_size: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        """``queue_size`` and ``extra_args`` (further ``serve`` flags) for a load run's server."""
        from adaptivespec.sglang.server import SGLangServer, free_port

        self.name, self.config = name, config
        self.lossless = config_lossless(config)
        self._tokenizer = None
        self.port = free_port()
        log = Path(tempfile.mkdtemp(prefix=f"adaptivespec-served-{name}-")) / "server.log"
        runtime = "llamacpp" if config.runtime.name == "llamacpp" else "torch"  # (the same server)
        argv = torch_command(config_path, self.port, queue_size=queue_size, runtime=runtime) + list(extra_args)
        self.server = SGLangServer(argv, dict(os.environ), log, timeout=600)
        self.server.start()
        self.server.pause()

    def warm_up(self, problems: list[Problem], max_new_tokens: int, formats: Iterable[Any] = ()) -> None:
        generate_untimed(self, warmup_problems(problems), max_new_tokens)

    def close(self) -> None:
        self.server.stop()

    def generate_ids(self, prompt_ids: list[int], *, max_new_tokens: int, on_step=None, seed: int | None = None,
                     response_format=None) -> GenerationResult:
        g = self.config.generation
        body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": max_new_tokens, "stream": True,
                                "temperature": g.temperature}
        if g.temperature > 0:
            body.update(top_p=g.top_p, top_k=g.top_k or -1, min_p=g.min_p or 0.0, seed=g.seed if seed is None else seed)
        fmt = response_format if response_format is not None else g.response_format
        if fmt is not None:
            if fmt.type in ("json_schema", "json_object"):
                body["response_format"] = openai_response_format(fmt)
            else:
                body.update(sglang_sampling_params(fmt))
        self.server.resume()
        try:
            text, last, first, wall = self._stream(body)
        finally:
            self.server.pause()
        spec, usage = last.get("speculation", {}), last.get("usage", {})
        new = int(usage.get("completion_tokens", 0))
        stats = {"new_tokens": new, "target_forwards": spec.get("target_forwards") or new,
                 "accept_length_mean": spec.get("accept_length"), "wall_seconds": wall,
                 "tokens_per_second": new / wall if wall > 0 else 0.0, "prefill_seconds": first,
                 "promoted_tokens": spec.get("promoted_tokens", 0), "server_seconds": spec.get("generation_seconds"),
                 "server_prefill_seconds": spec.get("prefill_seconds")}
        return GenerationResult(token_ids=[], text=text, stats=stats)

    def _stream(self, body: dict[str, Any]) -> tuple[str, dict, float | None, float]:
        """(text, last chunk, seconds to the first text, wall seconds) of one streamed completion."""
        parts: list[str] = []
        last: dict = {}
        first = None
        t0 = time.perf_counter()
        try:
            for t, last in post_stream(self.port, "/v1/completions", body, timeout=600):
                piece = last["choices"][0]["text"]
                if piece and first is None:
                    first = t - t0
                parts.append(piece)
        except AdaptiveSpecError as exc:
            raise AdaptiveSpecError(f"{self.name}: {exc}") from None
        return "".join(parts), last, first, time.perf_counter() - t0
