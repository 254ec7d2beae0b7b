"""Perplexity of the torch runtime's target by llama.cpp's protocol (``llama-perplexity``): the text's
tokens cut into chunks of ``ctx`` (512), each chunk one forward from an empty cache, the second half
of each chunk scored. Same text and tokenizer as a ``llama-perplexity -f`` run, so the figures of our
bf16 / int8 targets and of llama.cpp's GGUF files sit side by side (docs/int8.md).

    python -m adaptivespec.analysis.perplexity --text held_out.txt --set runtime.quantization=int8

The text file is written by ``--write-text`` from ``train/long_docs.jsonl``'s Wikipedia articles
(never used to calibrate or tune anything).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "train" / "long_docs.jsonl"


def held_out_text(path: Path = DATA, articles: int = 6, chars: int = 12000) -> str:
    """The first ``chars`` characters of the last ``articles`` Wikipedia articles of ``long_docs.jsonl``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wiki = [r["text"] for r in rows if r.get("source") == "wikipedia"]
    return "\n\n".join(t[:chars] for t in wiki[-articles:])


@torch.inference_mode()
def perplexity(forward, cache_for, ids: list[int], ctx: int = 512, progress=None) -> tuple[float, int]:
    """(perplexity, tokens scored): chunks of ``ctx`` tokens, the second half of each scored."""
    nll, count = 0.0, 0
    chunks = len(ids) // ctx
    for c in range(chunks):
        x = torch.tensor([ids[c * ctx:(c + 1) * ctx]])
        logits = forward(x, cache_for()).logits[0].float()  # [ctx, V]
        first = ctx // 2
        logp = torch.log_softmax(logits[first - 1:ctx - 1], dim=-1)
        target = x[0, first:ctx]
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += ctx - first
        if progress is not None:
            progress(c + 1, chunks, math.exp(nll / count))
    return math.exp(nll / max(count, 1)), count


def machine(model) -> dict:
    """Where the figure came from: the CPU's level (capped by ``$ADAPTIVESPEC_CPU_ISA``), and for an int8
    target the kernel its matmuls ran (every one exact: docs/int8.md, *Every CPU*)."""
    from adaptivespec import hardware
    from adaptivespec.fastpath.int8 import kernel_name, quantization_of
    from adaptivespec.fastpath.native import ops

    out = {"isa": hardware.isa()}
    if quantization_of(model) == "int8":
        out["int8_kernel"] = kernel_name(ops())
    return out


def main(argv=None) -> int:
    from adaptivespec.config import load_config
    from adaptivespec.fastpath.forward import fast_forward
    from adaptivespec.fastpath.kvcache import buffered_cache
    from adaptivespec.models import load_target

    ap = argparse.ArgumentParser(prog="python -m adaptivespec.analysis.perplexity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs" / "ar.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--text", help="a UTF-8 text file (default: the held-out Wikipedia text)")
    ap.add_argument("--write-text", metavar="PATH", help="write the held-out text here (for llama-perplexity -f) and exit")
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args(argv)
    source = Path(args.text) if args.text else DATA
    if not source.is_file():
        print(f"perplexity: --text: {source}: file not found (expected a UTF-8 text file)", file=sys.stderr)
        return 2
    text = source.read_text() if args.text else held_out_text()
    if args.write_text:
        Path(args.write_text).write_text(text)
        print(f"wrote {len(text)} characters to {args.write_text}")
        return 0
    cfg = load_config(args.config, args.set)
    rt = cfg.runtime
    model, tok = load_target(cfg.model.target, rt.dtype, rt.device, quantization=rt.quantization, keep=rt.quantization_keep,
                             groups=rt.groups)
    forward = fast_forward(model) or (lambda x, cache: model(input_ids=x, past_key_values=cache, use_cache=True))
    ids = tok(text, add_special_tokens=False)["input_ids"]

    def tick(done, total, ppl):
        print(f"\r[{done}/{total}] {ppl:.4f}", end="", file=sys.stderr, flush=True)

    ppl, n = perplexity(forward, lambda: buffered_cache(model.config, args.ctx), ids, args.ctx, tick)
    print(file=sys.stderr)
    print(json.dumps({"precision": rt.precision, "perplexity": round(ppl, 4), "tokens_scored": n, "ctx": args.ctx,
                      "text_tokens": len(ids), **machine(model)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
