"""Training data: prompts, self-distillation by batched greedy decoding, and token batches.

A record is one prompt and the target's own greedy answer, as token ids (the format of
``/work/shared/data/distill``)::

    {"id": "gsm8k-train-12", "prompt_ids": [...chat template...], "response_ids": [..., 2]}

Prompt sources (training splits only; evaluation sets are refused by name):

    gsm8k-train   gsm8k/train.jsonl            question                     id gsm8k-train-<line>
    code-alpaca   train/code_alpaca.jsonl      instruction [+ blank + input]  id code-alpaca-<line>
    mbpp          train/mbpp_nontest.jsonl     text + newline + first test  id mbpp-<task_id>

The pooled prompts are shuffled with ``random.Random(seed)`` (20261129 reproduces the shared
corpus' order). Batches group records of similar length so that ``rows * max_len <=
batch_tokens``; their order is a seeded permutation per epoch, so a data position is just
``(epoch, batch index)``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
import os
from typing import Iterable, Iterator

import attrs
import torch

from adaptivespec.errors import AdaptiveSpecError

def _default_data_root() -> Path:
    """``$ADAPTIVESPEC_DATA``, else the ``shared/data`` folder beside a source checkout."""
    env = os.environ.get("ADAPTIVESPEC_DATA")
    if env:
        return Path(env)
    beside_checkout = Path(__file__).resolve().parents[3] / "shared" / "data"
    return beside_checkout if beside_checkout.is_dir() else Path("/work/shared/data")


DATA_ROOT = _default_data_root()
SOURCES = {
    "gsm8k-train": "gsm8k/train.jsonl",
    "code-alpaca": "train/code_alpaca.jsonl",
    "mbpp": "train/mbpp_nontest.jsonl",
}
EVAL_FILES = ("test.jsonl", "question.jsonl", "humaneval.jsonl", "humaneval.jsonl.gz")
EVAL_DIRS = ("humaneval", "specbench", "spec_bench", "mtbench", "mt_bench", "math500")


@attrs.frozen
class Prompt:
    id: str
    text: str


@attrs.frozen
class Record:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# -- prompts ---------------------------------------------------------------------------------
def _format(source: str, i: int, row: dict) -> Prompt:
    if source == "gsm8k-train":
        return Prompt(f"gsm8k-train-{i}", row["question"])
    if source == "code-alpaca":
        extra = (row.get("input") or "").strip()
        return Prompt(f"code-alpaca-{i}", row["instruction"] + (f"\n\n{extra}" if extra else ""))
    if source == "mbpp":
        return Prompt(f"mbpp-{row['task_id']}", row["text"] + "\n" + row["test_list"][0])
    text = row.get("prompt") or row.get("question") or row.get("instruction") or row.get("text")
    return Prompt(str(row.get("id", f"{Path(source).stem}-{i}")), text)


def check_not_eval(path: Path, arg: str = "--data") -> None:
    parts = [x.lower() for x in path.parts]
    if parts[-1] in EVAL_FILES or any(x in EVAL_DIRS for x in parts[:-1]):
        raise AdaptiveSpecError(f"{arg}: {str(path)!r} looks like an evaluation set; expected training prompts only "
                                f"({', '.join(SOURCES)} or a jsonl of training prompts)")


def source_path(spec: str, root: Path) -> tuple[str, Path]:
    """``gsm8k-train`` | ``code-alpaca`` | ``mbpp`` | a jsonl with prompt/question/instruction/text."""
    path = root / SOURCES[spec] if spec in SOURCES else Path(spec).expanduser()
    if not path.is_file():
        raise AdaptiveSpecError(f"--data: {spec!r} is not a file ({path}); expected one of "
                                f"{', '.join(SOURCES)} or a jsonl file of training prompts")
    check_not_eval(path)
    return (spec if spec in SOURCES else str(path)), path


def load_prompts(specs: Iterable[str], root: Path = DATA_ROOT, seed: int = 20261129, limit: int | None = None) -> list[Prompt]:
    """All prompts of ``specs`` pooled and shuffled with ``random.Random(seed)``; the first ``limit``."""
    pool: list[Prompt] = []
    for spec in specs:
        name, path = source_path(spec, root)
        with path.open() as f:
            pool += [_format(name, i, json.loads(line)) for i, line in enumerate(f) if line.strip()]
    random.Random(seed).shuffle(pool)
    return pool[:limit] if limit else pool


# -- records on disk -------------------------------------------------------------------------
def read_records(path: Path, arg: str = "--distilled") -> list[Record]:
    if not path.is_file():
        raise AdaptiveSpecError(f"{arg}: {str(path)!r} is not a file; expected a jsonl of "
                                "{id, prompt_ids, response_ids} records")
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Record(str(row["id"]), list(row["prompt_ids"]), list(row["response_ids"])))
            except (ValueError, KeyError, TypeError):
                if n > 1 and not line.endswith("\n"):  # a line cut short by an interrupted run
                    break
                raise AdaptiveSpecError(f"{arg}: line {n} of {path} is not a {{id, prompt_ids, response_ids}} record") from None
    return out


def split(records: list[Record], val_frac: float, seed: int) -> tuple[list[Record], list[Record]]:
    """(train, validation): a fixed seeded choice of ``round(val_frac * n)`` records (at least 1)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(val_frac * len(records))) if len(records) > 1 else 0
    val = set(order[:n_val])
    return [r for i, r in enumerate(records) if i not in val], [r for i, r in enumerate(records) if i in val]


# -- self-distillation -----------------------------------------------------------------------
@torch.inference_mode()
def distill(model, tok, prompts: list[Prompt], out: Path, *, batch_size: int = 16, max_new_tokens: int = 384,
            chunk: int = 640, progress: bool = True) -> list[Record]:
    """Greedy answers of ``model`` to ``prompts``, appended to ``out``; ids already there are skipped.

    Prompts are sorted by length within chunks of ``chunk`` and decoded in left-padded batches
    (pad = eos). A response is cut after its first eos (kept) or at ``max_new_tokens``.
    """
    from tqdm import tqdm

    from adaptivespec.models import encode_prompt

    done = {r.id for r in read_records(out)} if out.is_file() else set()
    todo = [p for p in prompts if p.id not in done]
    eos = tok.eos_token_id
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=not progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for c in range(0, len(todo), chunk):
            part = sorted(((encode_prompt(tok, p.text), p) for p in todo[c : c + chunk]), key=lambda x: len(x[0]))
            for b in range(0, len(part), batch_size):
                rows = part[b : b + batch_size]
                for ids, resp, p in zip(*_generate(model, [r[0] for r in rows], eos, max_new_tokens), [r[1] for r in rows]):
                    f.write(json.dumps({"id": p.id, "prompt_ids": ids, "response_ids": resp}, separators=(",", ":")) + "\n")
                f.flush()
                bar.update(len(rows))
    bar.close()
    return read_records(out)


def _generate(model, prompts: list[list[int]], eos: int, max_new_tokens: int) -> tuple[list, list]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # one row per prompt, not per token
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=eos, eos_token_id=eos)[:, width:]
    is_eos = gen == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, gen.shape[1])
    return prompts, [gen[i, : int(first[i])].tolist() for i in range(len(prompts))]


# -- batches ---------------------------------------------------------------------------------
@attrs.frozen
class Batch:
    ids: torch.Tensor  # [B, T] int64, right-padded with eos
    lengths: torch.Tensor  # [B] real lengths
    prompt_lens: torch.Tensor  # [B]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def plan_batches(records: list[Record], batch_tokens: int, max_len: int) -> list[list[int]]:
    """Record indices grouped by length so that ``rows * longest <= batch_tokens`` (fixed order)."""
    order = sorted(range(len(records)), key=lambda i: (min(records[i].length, max_len), records[i].id))
    groups, cur, longest = [], [], 0
    for i in order:
        n = min(records[i].length, max_len)
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return groups + ([cur] if cur else [])


def epoch_order(n_batches: int, epoch: int, seed: int) -> list[int]:
    order = list(range(n_batches))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


def collate(records: list[Record], max_len: int, pad: int) -> Batch:
    seqs = [(r.prompt_ids + r.response_ids)[:max_len] for r in records]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):  # one row per record
        ids[i, : len(s)] = torch.tensor(s)
    return Batch(ids, torch.tensor([len(s) for s in seqs]), torch.tensor([len(r.prompt_ids) for r in records]))


def iterate(records: list[Record], groups: list[list[int]], start: tuple[int, int], seed: int, max_len: int,
            pad: int) -> Iterator[tuple[int, int, Batch]]:
    """Endless ``(epoch, index, batch)`` from data position ``start`` = (epoch, index)."""
    epoch, index = start
    while True:
        order = epoch_order(len(groups), epoch, seed)
        for k in range(index, len(order)):
            yield epoch, k, collate([records[i] for i in groups[order[k]]], max_len, pad)
        epoch, index = epoch + 1, 0
