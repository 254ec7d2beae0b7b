"""The training loop: AdamW, warmup + cosine, clipping, checkpoints, validation, export.

Schedule over training *progress* ``u in [0, 1]`` (the largest of step / steps, epoch fraction
/ epochs, tokens / token budget, seconds / time budget, for the limits that are set)::

    lr(step, u) = lr_peak * min(1, (step + 1) / warmup) * (r + (1 - r) * (1 + cos(pi u)) / 2)

with ``r = min_lr_ratio``. Training stops at ``u >= 1``. Every ``checkpoint_minutes`` (and at
the end, or on SIGTERM / Ctrl-C) it writes ``<out>/training/checkpoint.pt`` (fp32 head,
optimiser, step, tokens, seconds, data position), exports the head in bf16 to ``<out>``
(``config.json`` + ``model.safetensors``) and logs validation loss and per-step top-1
agreement to ``<out>/training/log.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from adaptivespec.training.data import Record, collate, epoch_order, plan_batches
from adaptivespec.training.mix import kind_of
from adaptivespec.training.ttt import target_features, ttt_loss


@attrs.frozen(kw_only=True)
class TrainConfig:
    out: Path
    k_steps: int = 7
    decay: float = 0.8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.01
    clip: float = 0.5
    batch_tokens: int = 4096
    max_len: int = 1024
    steps: int | None = None
    epochs: float | None = None
    budget_seconds: float | None = None
    budget_tokens: int | None = None
    checkpoint_minutes: float = 15.0
    val_max_tokens: int = 12000
    log_every: int = 5
    bf16: bool = True
    seed: int = 0
    progress: bool = True
    label_topk: int | None = None  # sparse top-k soft labels (the feature cache's own k when it is used)


@attrs.define
class State:
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    epoch: int = 0
    index: int = 0


class Trainer:
    """Owns the head, optimiser and data order of one run (see module docstring)."""

    def __init__(self, cfg: TrainConfig, target, drafter, vocab_ids: torch.Tensor, train: list[Record], val: list[Record], pad: int,
                 cache=None) -> None:
        self.cfg, self.target, self.drafter = cfg, target, drafter
        self.cache = cache  # a features.FeatureCache: the target is not run
        self.vocab_ids, self.train_set, self.val_set, self.pad = vocab_ids, train, val, pad
        self.device = next(drafter.parameters()).device  # the head's; the target (when it runs) is on it too
        self._vocab_dev = vocab_ids.to(self.device)
        self._t2d_host = drafter.t2d.cpu()  # the cache reads on the host
        self.groups = plan_batches(train, cfg.batch_tokens, cfg.max_len)
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.state = State()
        self.dir = cfg.out / "training"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "log.jsonl"
        self._stop = False

    # -- schedule ---------------------------------------------------------------------------
    def progress(self) -> float:
        c, s = self.cfg, self.state
        parts = [0.0]
        if c.steps:
            parts.append(s.step / c.steps)
        if c.epochs:
            parts.append((s.epoch + s.index / len(self.groups)) / c.epochs)
        if c.budget_tokens:
            parts.append(s.tokens / c.budget_tokens)
        if c.budget_seconds:
            parts.append(s.seconds / c.budget_seconds)
        return max(parts)

    def lr(self) -> float:
        c = self.cfg
        u = min(1.0, self.progress())
        warm = min(1.0, (self.state.step + 1) / max(1, c.warmup))
        return c.lr * warm * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * u)))

    # -- one step ---------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def features(self, records: list[Record], host_batch, batch):
        """The target's features on the head's device, from the cache (which reads ``host_batch``,
        collated from ``records``) or a target forward on ``batch`` (the same batch on the device)."""
        d, c = self.drafter, self.cfg
        if self.cache is not None:
            return self.cache.features(records, host_batch, self._t2d_host, c.k_steps).to(self.device)
        return target_features(self.target, d.aux_layers, batch, self._vocab_dev, d.t2d, c.k_steps, c.label_topk)

    def train_step(self, host_batch, records: list[Record]) -> dict[str, Any]:
        d, c = self.drafter, self.cfg
        batch = host_batch.to(self.device)
        feats = self.features(records, host_batch, batch)
        with self._autocast():
            stats = ttt_loss(d, batch, feats, c.k_steps, c.decay)
        lr = self.lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        stats.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(d.parameters(), c.clip)
        self.opt.step()
        return {"loss": float(stats.loss.detach()), "lr": lr, "grad_norm": float(gnorm), "step_loss": stats.step_loss,
                "acc": [k / max(n, 1) for k, n in zip(stats.correct, stats.count)]}

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Per-step loss (row-weighted) and top-1 agreement on the validation split (capped)."""
        c, d = self.cfg, self.drafter
        recs, total = [], 0
        for r in self.val_set:
            if total >= c.val_max_tokens:
                break
            recs.append(r)
            total += min(r.length, c.max_len)
        k = c.k_steps
        loss, correct, count = [0.0] * k, [0] * k, [0] * k
        kinds: dict[str, list[list[int]]] = {}  # kind -> [rows per step, hits per step]
        d.eval()
        for group in plan_batches(recs, c.batch_tokens, c.max_len):
            part = [recs[i] for i in group]
            host_batch = collate(part, c.max_len, self.pad)
            batch = host_batch.to(self.device)
            feats = self.features(part, host_batch, batch)
            with self._autocast():
                st = ttt_loss(d, batch, feats, k, c.decay, by_record=True)
            for j in range(k):
                loss[j] += st.step_loss[j] * st.count[j]
                correct[j] += st.correct[j]
                count[j] += st.count[j]
                rows, hits = (x.tolist() for x in st.by_record[j])
                for r, n, h in zip(part, rows, hits):
                    acc_k = kinds.setdefault(kind_of(r.id), [[0] * k, [0] * k])
                    acc_k[0][j] += n
                    acc_k[1][j] += h
        d.train()
        acc = [a / max(n, 1) for a, n in zip(correct, count)]
        return {"val_loss": [x / max(n, 1) for x, n in zip(loss, count)], "val_acc": acc, "val_rows": count,
                "val_tokens": total, "val_acc_mean": sum(acc) / k,
                "val_acc_by_kind": {kind: [h / max(n, 1) for n, h in zip(*v)] for kind, v in sorted(kinds.items())},
                "val_rows_by_kind": {kind: v[0][0] for kind, v in sorted(kinds.items())}}

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> State:
        from tqdm import tqdm

        c, s = self.cfg, self.state
        self._install_signals()
        it = self.batches((s.epoch, s.index))
        last_ckpt = time.monotonic()
        bar = tqdm(desc="train", unit="tok", unit_scale=True, initial=s.tokens, disable=not c.progress,
                   total=c.budget_tokens, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        if s.step == 0 and self.val_set:  # where the head starts (a warm start's own score on this validation split)
            self.log({"kind": "val", **self._where(), **self.validate()})
        self.drafter.train()
        while self.progress() < 1.0 and not self._stop:
            epoch, index, records, batch = next(it)
            t0 = time.perf_counter()
            info = self.train_step(batch, records)
            dt = time.perf_counter() - t0
            s.step, s.tokens, s.seconds = s.step + 1, s.tokens + batch.tokens, s.seconds + dt
            s.epoch, s.index = (epoch, index + 1) if index + 1 < len(self.groups) else (epoch + 1, 0)
            release_memory()
            bar.update(batch.tokens)
            bar.set_postfix(loss=f"{info['loss']:.3f}", acc0=f"{info['acc'][0]:.3f}", step=s.step)
            if s.step % c.log_every == 0 or s.step == 1:
                self.log({"kind": "train", **self._where(), "tok_per_s": batch.tokens / dt, "batch": list(batch.ids.shape), **info})
            if time.monotonic() - last_ckpt >= 60 * c.checkpoint_minutes:
                self.checkpoint()
                last_ckpt = time.monotonic()
        bar.close()
        self.checkpoint()
        return s

    def batches(self, start: tuple[int, int]):
        """Endless ``(epoch, index, records, batch)`` from data position ``start`` (as ``data.iterate``)."""
        epoch, index = start
        while True:
            order = epoch_order(len(self.groups), epoch, self.cfg.seed)
            for k in range(index, len(order)):
                records = [self.train_set[i] for i in self.groups[order[k]]]
                yield epoch, k, records, collate(records, self.cfg.max_len, self.pad)
            epoch, index = epoch + 1, 0

    def _where(self) -> dict[str, Any]:
        s = self.state
        return {"step": s.step, "tokens": s.tokens, "seconds": round(s.seconds, 1), "epoch": s.epoch, "index": s.index,
                "progress": round(self.progress(), 4)}

    def _install_signals(self) -> None:
        def stop(signum, frame):
            self._stop = True
            print(f"train-drafter: signal {signum}: stopping after this step and saving a checkpoint", file=sys.stderr, flush=True)

        try:
            signal.signal(signal.SIGTERM, stop)
            signal.signal(signal.SIGINT, stop)
        except ValueError:  # not the main thread
            pass

    def log(self, row: dict[str, Any]) -> None:
        row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
        with self.log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Validate, save training state atomically, export the bf16 head to ``out``."""
        val = self.validate() if self.val_set else {}
        self.log({"kind": "val", **self._where(), **val})
        path = self.dir / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"drafter": self.drafter.state_dict(), "optim": self.opt.state_dict(), "state": attrs.asdict(self.state),
                    "vocab_ids": self.vocab_ids, "val": val}, tmp)
        os.replace(tmp, path)
        export(self.drafter, self.cfg.out)
        if self.cfg.progress:
            acc = " ".join(f"{a:.3f}" for a in val.get("val_acc", []))
            print(f"train-drafter: checkpoint step {self.state.step}, {self.state.tokens} tokens; val top-1 by step: {acc}",
                  file=sys.stderr, flush=True)

    def restore(self, path: Path) -> None:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        self.drafter.load_state_dict(ck["drafter"])
        self.opt.load_state_dict(ck["optim"])
        self.state = State(**ck["state"])


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Batches of varying shapes fragment glibc's arenas: without this the process grew to 11 GiB
    RSS after ~400 steps (peak live memory is ~2-3 GiB).
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def export(drafter, out: Path) -> None:
    """Write the head in bf16 (EAGLE-3 layout) to ``out``, replacing files atomically."""
    tmp = out / ".export.tmp"
    head = type(drafter)(drafter.config, drafter.embed_tokens, drafter.aux_layers, drafter.target_hidden)
    head.load_state_dict(drafter.state_dict())
    head.to(torch.bfloat16).save_pretrained(tmp)
    for name in ("config.json", "model.safetensors"):
        os.chmod(tmp / name, 0o644)
        os.replace(tmp / name, out / name)
    tmp.rmdir()
