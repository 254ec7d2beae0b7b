"""Target-feature cache for ``train-drafter --feature-cache DIR``: the target's forward, once per record.

Training an EAGLE-3 head needs, per batch, a no-grad target forward for the three fused hidden
states (the head's ``fc`` input; ``fc`` is trained, so the raw states are stored) and for the soft
labels. The cache stores both for every record, so that each epoch runs the head only::

    DIR/index.json   key (below) and one entry per record: id, state row, length, prompt length,
                     label row, label count
    DIR/states.bin   bfloat16 [tokens, 3 * H_t]: hidden_states[a + 1] of the aux layers a, every
                     position of the record (prompt too: step 0 attends to it), up to max_len
    DIR/logp.bin     float16 [labels, k]: the target's top-k log-probs over the draft vocabulary
                     at each response position q >= 1 (the distribution of z[q-1], predicting t[q])
    DIR/index.bin    int16 (int32 if Vd > 32767) [labels, k]: their draft ids, largest first
    DIR/build.json   while building: the key, entries so far and file lengths (resume point)

Files are memory-mapped when training. A cache is tied to its key: target, its dtype and aux
layers, the draft vocabulary, a hash of all records (ids and tokens), k, max_len and the stored
dtypes; opening it with anything else is refused with a one-line error. Building is resumable:
an interrupted build continues from ``build.json`` (files are cut back to its lengths).

Training on the cache uses the labels renormalised over their k entries (``ttt.topk_cross_entropy``);
the uncached path does the same with ``--label-topk k``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import Batch, Record, collate, plan_batches
from adaptivespec.training.ttt import Features, label_rows, loss_mask

VERSION = 1
FILES = ("states.bin", "logp.bin", "index.bin")
DEFAULT_TOPK = 64  # see the note: tail mass and loss gap by k on held-out records


def records_hash(records: list[Record]) -> str:
    """sha256 over (id, prompt ids, response ids) of the records in id order."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.id):
        h.update(json.dumps([r.id, r.prompt_ids, r.response_ids], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def cache_key(*, target: str, target_dtype: str, aux_layers: list[int], target_hidden: int, vocab_ids: torch.Tensor,
              records: list[Record], topk: int, max_len: int) -> dict[str, Any]:
    ids = torch.as_tensor(vocab_ids, dtype=torch.long)
    topk = min(topk, int(ids.numel()))
    return {"version": VERSION, "target": str(target), "target_dtype": target_dtype, "aux_layers": list(aux_layers),
            "target_hidden": int(target_hidden), "draft_vocab": int(ids.numel()),
            "draft_vocab_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(), "records": len(records),
            "records_sha256": records_hash(records), "label_topk": int(topk), "max_len": int(max_len),
            "states_dtype": "bfloat16", "logp_dtype": "float16", "index_dtype": _index_dtype(int(ids.numel())).__name__}


def _index_dtype(vd: int):
    return np.int16 if vd <= np.iinfo(np.int16).max else np.int32


def _check_key(path: Path, found: dict, wanted: dict) -> None:
    for k, v in wanted.items():
        if found.get(k) != v:
            show = (lambda x: f"{x[:12]}..." if isinstance(x, str) and len(x) > 40 else repr(x))
            raise AdaptiveSpecError(f"--feature-cache: {str(path)!r} was built for {k}={show(found.get(k))}, not {show(v)}; "
                                    "expected a cache built with the same target, draft vocabulary, records, --label-topk and "
                                    "--max-len (or a new folder)")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def status(path: Path, key: dict) -> str:
    """``complete`` | ``partial`` | ``missing``; a cache with another key is refused."""
    for name in ("index.json", "build.json"):
        if (path / name).is_file():
            try:
                found = json.loads((path / name).read_text())["key"]
            except (ValueError, KeyError):
                raise AdaptiveSpecError(f"--feature-cache: {path / name} is not a feature-cache file; expected a folder "
                                        "written by train-drafter --feature-cache") from None
            _check_key(path, found, key)
            return "complete" if name == "index.json" else "partial"
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise AdaptiveSpecError(f"--feature-cache: {str(path)!r} exists and is not a feature cache; expected a new or "
                                "empty folder or one written by train-drafter --feature-cache")
    return "missing"


@torch.no_grad()
def build(path: Path, key: dict, target, records: list[Record], vocab_ids: torch.Tensor, *, batch_tokens: int = 4096,
          pad: int = 0, progress: bool = True) -> None:
    """Compute and store the features of ``records`` (resuming a partial build); see the module doc."""
    from tqdm import tqdm

    if status(path, key) == "complete":
        return
    path.mkdir(parents=True, exist_ok=True)
    max_len, topk, aux = key["max_len"], key["label_topk"], key["aux_layers"]
    idx_dtype = _index_dtype(key["draft_vocab"])
    groups = plan_batches(records, batch_tokens, max_len)  # fixed order: by length, then id
    state = {"key": key, "groups_done": 0, "entries": [], "sizes": [0, 0, 0]}
    if (path / "build.json").is_file():
        state = json.loads((path / "build.json").read_text())
    files = []
    for name, size in zip(FILES, state["sizes"]):
        f = open(path / name, "ab")
        f.truncate(size)  # drop bytes written after the last recorded group
        files.append(f)
    rows, labels = state["sizes"][0] // (2 * 3 * key["target_hidden"]), state["sizes"][1] // (2 * topk)
    w = target.get_output_embeddings().weight
    dev = w.device
    w = w[torch.as_tensor(vocab_ids).to(dev)]  # [Vd, H_t]
    all_t2d = torch.ones(target.config.vocab_size, dtype=torch.bool, device=dev)  # every response position gets a label
    total = sum(min(r.length, max_len) for r in records)
    done = sum(e[2] for e in state["entries"])
    bar = tqdm(total=total, initial=done, desc="feature cache", unit="tok", unit_scale=True, disable=not progress)
    try:
        for gi in range(state["groups_done"], len(groups)):
            recs = [records[i] for i in groups[gi]]
            batch = collate(recs, max_len, pad).to(dev)
            out = target.model(input_ids=batch.ids, output_hidden_states=True)
            states = torch.cat([out.hidden_states[a + 1] for a in aux], dim=-1).to(torch.bfloat16).cpu()
            bi, qi, _ = label_rows(loss_mask(batch, all_t2d), 0)
            logits = out.last_hidden_state[bi, qi - 1] @ w.T
            logp, index = torch.log_softmax(logits.float(), dim=-1).topk(min(topk, w.shape[0]), dim=-1)
            logp, index = logp.cpu(), index.cpu()
            counts = torch.bincount(bi, minlength=len(recs)).tolist()
            for b, r in enumerate(recs):
                n = int(batch.lengths[b])
                files[0].write(states[b, :n].contiguous().view(torch.int16).numpy().tobytes())
                state["entries"].append([r.id, rows, n, len(r.prompt_ids), labels, counts[b]])
                rows, labels = rows + n, labels + counts[b]
            files[1].write(logp.to(torch.float16).numpy().tobytes())
            files[2].write(index.numpy().astype(idx_dtype).tobytes())
            for f in files:
                f.flush()
                os.fsync(f.fileno())
            state["groups_done"], state["sizes"] = gi + 1, [f.tell() for f in files]
            _write_json(path / "build.json", state)
            bar.update(int(batch.lengths.sum()))
    finally:
        bar.close()
        for f in files:
            f.close()
    _write_json(path / "index.json", {"key": key, "tokens": rows, "labels": labels, "entries": state["entries"]})
    (path / "build.json").unlink()


class FeatureCache:
    """A built cache, memory-mapped; ``features(records, batch, t2d, k)`` replaces ``target_features``."""

    def __init__(self, path: Path, key: dict) -> None:
        if status(path, key) != "complete":
            raise AdaptiveSpecError(f"--feature-cache: {str(path)!r} is not a complete cache; expected a finished build "
                                    "(run train-drafter --feature-cache DIR --build-cache-only to finish it)")
        index = json.loads((path / "index.json").read_text())
        self.path, self.key = path, key
        self.width, self.topk = 3 * key["target_hidden"], key["label_topk"]
        self.entries = {e[0]: e[1:] for e in index["entries"]}
        n, m = index["tokens"], index["labels"]
        self.states = np.memmap(path / "states.bin", dtype=np.int16, mode="r", shape=(n, self.width)) if n else None
        self.logp = np.memmap(path / "logp.bin", dtype=np.float16, mode="r", shape=(m, self.topk)) if m else None
        self.index = np.memmap(path / "index.bin", dtype=_index_dtype(key["draft_vocab"]), mode="r", shape=(m, self.topk)) if m else None

    def disk_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in FILES)

    def features(self, records: list[Record], batch: Batch, t2d: torch.Tensor, k_steps: int) -> Features:
        """Features of ``batch`` (collated from ``records``) read from the cache; same layout as the target's."""
        b, t = batch.ids.shape
        buf = np.zeros((b, t, self.width), dtype=np.int16)
        base = torch.zeros(b, dtype=torch.long)
        for i, r in enumerate(records):
            row, n, plen, lab, _ = self.entries[r.id]
            n = min(n, int(batch.lengths[i]))
            buf[i, :n] = self.states[row : row + n]
            base[i] = lab - max(plen, 1)  # label row of position q is base + q
        bi, qi, rows = label_rows(loss_mask(batch, t2d), k_steps)
        sel = (base[bi] + qi).numpy()
        logp = torch.from_numpy(np.asarray(self.logp[sel], dtype=np.float32)) if len(sel) else torch.zeros(0, self.topk)
        index = torch.from_numpy(np.asarray(self.index[sel], dtype=np.int64)) if len(sel) else torch.zeros(0, self.topk, dtype=torch.long)
        states = torch.from_numpy(buf).view(torch.bfloat16)
        return Features(states, torch.softmax(logp, dim=-1), rows, index)
