"""Time to the first token of a long prompt: ``adaptivespec generate``'s engine in process against
the same config served by ``adaptivespec serve --runtime torch`` (streamed, the client's clock),
alternating A B A B on the same prompt ids.

The prompt: Spec-Bench's held-out RAG and summarization prompts joined until the chat-templated
prompt has ``--tokens`` tokens, cut there. Prints one JSON line: per contender the times to the
first token (seconds), their median, and the ratio served / in process::

    python scripts/torch_server_ttft.py --config configs/hybrid.yaml --tokens 1024 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def long_prompt(tokenizer, n_tokens: int) -> str:
    from adaptivespec.evaluation.datasets import load_dataset
    from adaptivespec.models import encode_prompt

    texts = [p.prompt for p in load_dataset("specbench") if p.category in ("rag", "summarization")]
    text = ""
    for t in texts:
        text += t + "\n\n"
        if len(encode_prompt(tokenizer, text)) > n_tokens + 64:
            break
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    lo, hi = 0, len(ids)
    while lo < hi:  # the longest cut whose chat-templated prompt has at most n_tokens tokens
        mid = (lo + hi + 1) // 2
        if len(encode_prompt(tokenizer, tokenizer.decode(ids[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return tokenizer.decode(ids[:lo])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/hybrid.yaml")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens (default 1024)")
    ap.add_argument("--rounds", type=int, default=6, help="A B rounds (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    from adaptivespec.evaluation.contenders import ConfigContender
    from adaptivespec.evaluation.served_contenders import TorchServedContender
    from adaptivespec.evaluation.sglang_contenders import served_config_file
    from adaptivespec.evaluation.spec import Entry, load_bench_config

    config = load_bench_config(args.config, [f"generation.max_new_tokens={args.max_new_tokens}"])
    local = ConfigContender(Entry(name="generate", config=config))
    served = TorchServedContender("served", config, served_config_file(config, "served"))
    try:
        ids = local.encode(long_prompt(local.engine.tokenizer, args.tokens))
        for c in (local, served):  # warm-up on this very prompt length, untimed
            c.generate_ids(ids, max_new_tokens=args.max_new_tokens)
        times: dict[str, list[float]] = {"generate": [], "served": [], "served_server_side": []}
        for i in range(args.rounds):
            for c in ((local, served) if i % 2 == 0 else (served, local)):
                s = c.generate_ids(ids, max_new_tokens=args.max_new_tokens).stats
                times[c.name].append(round(s["prefill_seconds"], 4))
                if c is served:
                    times["served_server_side"].append(round(s["server_prefill_seconds"], 4))
    finally:
        served.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"config": args.config, "prompt_tokens": len(ids), "rounds": args.rounds, "seconds": times,
                      "median": med, "ratio_served_over_generate": round(med["served"] / med["generate"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
