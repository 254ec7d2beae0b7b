"""Cost of the target's packed forward by rows, bf16 against the int8 target (docs/int8.md's table).

    python scripts/int8_rows.py 1 4 8 16 32 64 128

One request, R rows over 256 cached keys (causal), best of 7 x 5 calls, contenders alternating.
"""

import sys
import time

import torch

from adaptivespec.fastpath.batched import Part, layer_pieces, packed_forward
from adaptivespec.fastpath.kvcache import buffered_cache
from adaptivespec.models import load_target

CONTENDERS = {  # name: load_target keyword arguments
    "bf16": {},
    "int8, one scale per row": {"quantization": "int8"},
    "int8 shipped (slices)": {"quantization": "int8", "groups": {"down_proj": 4, "lm_head": 3}},
}


def best(f, rounds: int = 7, calls: int = 5) -> float:
    f()
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        out = min(out, (time.perf_counter() - t0) / calls)
    return out * 1e3


def main(rows: list[int]) -> None:
    torch.set_num_threads(2)
    models = {}
    for name, kw in CONTENDERS.items():
        model, _ = load_target("smollm2-135m-instruct", "bfloat16", **kw)
        models[name] = (model, layer_pieces(model))
    times: dict[tuple[int, str], float] = {}
    for R in rows:
        for _ in range(2):  # contenders alternating, twice
            for name, (model, pieces) in models.items():
                cache = buffered_cache(model.config, 1024)

                def run():
                    for layer in cache.layers:
                        layer.length = 256
                        layer._view()
                    ids, pos = torch.zeros(R, dtype=torch.long), torch.arange(256, 256 + R)
                    packed_forward(pieces, ids, pos, [Part(cache=cache, rows=R, mask=None, slot=None)], torch.arange(R))

                t = best(run)
                times[R, name] = min(t, times.get((R, name), t))
    names = list(CONTENDERS)
    print("| R | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for R in rows:
        base = times[R, names[0]]
        cells = [f"{base:.2f}"] + [f"{times[R, n]:.2f} ({times[R, n] / base:.2f}x)" for n in names[1:]]
        print(f"| {R} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 32, 64, 128])
