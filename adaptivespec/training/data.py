"""Training data: prompts, self-distillation by batched greedy decoding, and token batches.

A record is one prompt and the target's own greedy answer, as token ids (the format of
``shared/data/distill``)::

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
from adaptivespec.models import cache_forward

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
    follow_up: str | None = None
    """A second user turn (two-turn chats): it is asked after the model's own answer to ``text``."""


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


def split(records: list[Record], val_frac: float, seed: int,
          val_ids: set[str] | None = None) -> tuple[list[Record], list[Record]]:
    """(train, validation): a fixed seeded choice of ``round(val_frac * n)`` records (at least 1), or, given
    ``val_ids``, exactly the records with those ids (``train-drafter --val-ids``)."""
    if val_ids is not None:
        return [r for r in records if r.id not in val_ids], [r for r in records if r.id in val_ids]
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(val_frac * len(records))) if len(records) > 1 else 0
    val = set(order[:n_val])
    return [r for i, r in enumerate(records) if i not in val], [r for i, r in enumerate(records) if i in val]


def read_ids(path: Path, arg: str) -> set[str]:
    """Record ids, one per line (blank lines ignored); ``arg`` names the option in errors."""
    if not Path(path).is_file():
        raise AdaptiveSpecError(f"{arg}: {str(path)!r} is not a file; expected record ids, one per line")
    return {x.strip() for x in Path(path).read_text().splitlines() if x.strip()}


def unreserved(items: list, reserved: set[str]) -> list:
    """``items`` (prompts or records) whose id is not in ``reserved``; a two-turn prompt's first-turn
    record ``<id>-t1`` goes with its prompt (``train-drafter --reserve-ids``)."""
    if not reserved:
        return items
    return [x for x in items if x.id.removesuffix("-t1") not in reserved]


# -- self-distillation -----------------------------------------------------------------------
def encode_chat(tok, turns: list[str], answers: list[str]) -> list[int]:
    """Chat-template ids of alternating user ``turns`` and assistant ``answers`` (one fewer), ready to answer."""
    from adaptivespec.models import encode_prompt

    if not answers:
        return encode_prompt(tok, turns[0])
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "get") else ids)


def plan_generation(lengths: list[int], max_new_tokens: int, batch_size: int, gen_tokens: int) -> list[list[int]]:
    """Indices grouped into generation batches: sorted by prompt length, so a long prompt never pads
    a batch of short ones, and sized so that ``rows * (longest prompt + max_new_tokens) <= gen_tokens``
    (at most ``batch_size`` rows; a prompt longer than the budget runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        width = lengths[i] + max_new_tokens  # sorted: the newest row is the longest
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * width > gen_tokens):
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + ([cur] if cur else [])


@torch.inference_mode()
def distill(model, tok, prompts: list[Prompt], out: Path, *, batch_size: int = 16, max_new_tokens: int = 384,
            chunk: int = 640, progress: bool = True, gen_tokens: int = 16384) -> list[Record]:
    """Greedy answers of ``model`` to ``prompts``, appended to ``out``; ids already there are skipped.

    Prompts are taken ``chunk`` at a time in their given order (so an interrupted run holds a fair
    sample of every kind), sorted by length within the chunk and decoded by continuous batching
    (:func:`generate_stream`: a row leaves as soon as it finishes and the next prompts take its place).
    A response is cut after its first eos (kept) or at ``max_new_tokens``.

    Two-turn prompts (``follow_up`` set) run in two passes: the first turn is answered as record
    ``<id>-t1``, then the follow-up is asked after that answer as record ``<id>``.
    """
    from tqdm import tqdm

    from adaptivespec.models import encode_prompt

    done = {r.id: r for r in read_records(out)} if out.is_file() else {}
    first = [p if p.follow_up is None else Prompt(f"{p.id}-t1", p.text) for p in prompts]  # in order: a fair sample
    first = [p for p in first if p.id not in done]
    second = [p for p in prompts if p.follow_up is not None and p.id not in done]
    eos = tok.eos_token_id
    bar = tqdm(total=len(first) + len(second), desc="distill", unit="prompt", disable=not progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        def run(items: list[tuple[str, list[int]]]) -> None:
            for c in range(0, len(items), chunk):
                part = sorted(items[c : c + chunk], key=lambda x: len(x[1]))  # a long prompt never pads short ones
                for i, resp in generate_stream(model, [x[1] for x in part], eos, max_new_tokens, batch_size=batch_size,
                                               gen_tokens=gen_tokens):
                    pid, ids = part[i]
                    done[pid] = Record(pid, ids, resp)
                    f.write(json.dumps({"id": pid, "prompt_ids": ids, "response_ids": resp}, separators=(",", ":")) + "\n")
                    f.flush()
                    bar.update(1)

        run([(p.id, encode_prompt(tok, p.text)) for p in first])
        turns = []
        for p in second:
            answer = tok.decode([t for t in done[f"{p.id}-t1"].response_ids if t != eos], skip_special_tokens=True)
            turns.append((p.id, encode_chat(tok, [p.text, p.follow_up], [answer.strip()])))
        run(turns)
    bar.close()
    return read_records(out)


@torch.inference_mode()
def generate_greedy(model, prompts: list[list[int]], eos: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy answers to a batch of prompts (left-padded), each cut after its first ``eos`` (kept).

    Unlike ``model.generate`` the batch shrinks as rows finish: a finished row's KV cache rows are
    dropped, so a batch costs what its unfinished rows cost, not what its longest answer costs.
    """
    got = dict(generate_stream(model, prompts, eos, max_new_tokens, batch_size=len(prompts), gen_tokens=None))
    return [got[i] for i in range(len(prompts))]


@torch.inference_mode()
def generate_stream(model, prompts: list[list[int]], eos: int, max_new_tokens: int, *, batch_size: int,
                    gen_tokens: int | None, refill: int | None = None) -> Iterator[tuple[int, list[int]]]:
    """Greedy answers by continuous batching: ``(index, response)`` pairs, in the order rows finish.

    Prompts are admitted in the given order (sort them by length so that a long prompt never pads
    a batch of short ones) while ``rows <= batch_size`` and ``rows * (cache width + max_new_tokens)
    <= gen_tokens`` (``None``: no token budget; one prompt is always admitted). A finished row leaves
    at once, and once ``refill`` rows (default ``batch_size // 4``, at least 1) are free the next
    prompts are prefilled together and joined to the running batch: its cache and theirs are
    left-padded to one width (masked), and the columns no live row uses are cut from the left. So a
    batch keeps its width instead of running its longest answers with a few rows, and a prompt's
    answer is what it would be in a batch of its own (same positions, masked padding).
    """
    n = len(prompts)
    dev = getattr(model, "device", None) or torch.device("cpu")  # a transformers model knows its device
    run = cache_forward(model)
    refill = max(1, batch_size // 4) if refill is None else max(1, refill)
    out = torch.full((n, max_new_tokens), eos, dtype=torch.long, device=dev)
    nxt = 0  # next prompt to admit
    rows = torch.zeros(0, dtype=torch.long, device=dev)  # original index of each live row
    count = torch.zeros(0, dtype=torch.long, device=dev)  # tokens generated so far by each live row
    cache = mask = next_pos = logits = None

    def admissible(live: int, width: int) -> int:
        k = 0
        while nxt + k < n and live + k < batch_size:
            width = max(width, len(prompts[nxt + k]))
            if live + k > 0 and gen_tokens is not None and (live + k + 1) * (width + max_new_tokens) > gen_tokens:
                break
            k += 1
        return k

    while True:
        live = int(rows.numel())
        width = 0 if cache is None else int(mask.shape[1])
        if nxt < n and (live == 0 or batch_size - live >= min(refill, n - nxt)):
            k = admissible(live, width)
            if k:
                part = prompts[nxt : nxt + k]
                p_ids, p_mask, p_pos = (x.to(dev) for x in _left_pad(part, eos))
                p_cache = _spare_cache(model.config)
                p_logits = run(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, cache=p_cache, use_cache=True,
                                 logits_to_keep=1).logits[:, -1]
                new_rows = torch.arange(nxt, nxt + k, device=dev)
                nxt += k
                if cache is None:
                    cache, mask, next_pos, logits, rows = p_cache, p_mask, p_pos[:, -1] + 1, p_logits, new_rows
                    count = torch.zeros(k, dtype=torch.long, device=dev)
                else:
                    w = max(width, int(p_mask.shape[1]))
                    for a, b in zip(cache.layers, p_cache.layers):
                        a.keys = torch.cat([_pad_left(a.keys, w, 2), _pad_left(b.keys, w, 2)])
                        a.values = torch.cat([_pad_left(a.values, w, 2), _pad_left(b.values, w, 2)])
                    mask = torch.cat([_pad_left(mask, w, 1), _pad_left(p_mask, w, 1)])
                    next_pos = torch.cat([next_pos, p_pos[:, -1] + 1])
                    logits = torch.cat([logits, p_logits])
                    rows = torch.cat([rows, new_rows])
                    count = torch.cat([count, count.new_zeros(k)])
        if rows.numel() == 0:
            return
        tok_t = logits.argmax(-1)  # [live]
        out[rows, count] = tok_t
        count = count + 1
        finished = (tok_t == eos) | (count >= max_new_tokens)
        if finished.any():
            for i, c in zip(rows[finished].tolist(), count[finished].tolist()):
                yield i, out[i, :c].tolist()
            keep = (~finished).nonzero().squeeze(1)
            rows, count, tok_t, mask, next_pos = rows[keep], count[keep], tok_t[keep], mask[keep], next_pos[keep]
            if rows.numel() == 0:
                cache = None
                continue
            cut = int(mask.any(0).int().argmax())  # leading columns no live row attends to
            mask = mask[:, cut:]
            for layer in cache.layers:  # keep only the unfinished rows' cache
                layer.keys, layer.values = layer.keys[keep, :, cut:], layer.values[keep, :, cut:]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        logits = run(input_ids=tok_t.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                       cache=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1


def _spare_cache(config, spare: int = 64):
    """A ``DynamicCache`` whose layers append into buffers with ``spare`` free columns.

    ``DynamicCache`` concatenates every layer's keys and values at every step, copying the whole
    cache: ~38% of a 32-row decode step at 300 tokens of context on 2 cores. Here an update writes
    in place while room is left and copies once per ``spare`` steps; ``keys``/``values`` stay views
    of the buffers, and assigning them (row drops, joins) simply starts a new buffer at the next update.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class SpareLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, m = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
            kb, vb = getattr(self, "_bufs", (None, None))
            if (kb is None or self.keys.data_ptr() != kb.data_ptr() or self.keys.shape[:2] != kb.shape[:2]
                    or n + m > kb.shape[-2]):
                shape = (*key_states.shape[:2], n + m + spare, key_states.shape[-1])
                kb, vb = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    kb[:, :, :n], vb[:, :, :n] = self.keys, self.values
                self._bufs = (kb, vb)
            kb[:, :, n : n + m], vb[:, :, n : n + m] = key_states, value_states
            self.keys, self.values = kb[:, :, : n + m], vb[:, :, : n + m]
            return self.keys, self.values

    cache = DynamicCache(config=config)
    cache.layers = [SpareLayer() for _ in cache.layers]
    return cache


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, attention mask and position ids of a batch of prompts."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # one row per prompt, not per token
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` zero-padded on the left of ``dim`` to ``width``."""
    extra = width - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


# -- batches ---------------------------------------------------------------------------------
@attrs.frozen
class Batch:
    ids: torch.Tensor  # [B, T] int64, right-padded with eos
    lengths: torch.Tensor  # [B] real lengths
    prompt_lens: torch.Tensor  # [B]

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        """The batch on ``device`` (itself when it is there already)."""
        if self.ids.device == torch.device(device):
            return self
        return Batch(self.ids.to(device), self.lengths.to(device), self.prompt_lens.to(device))


def plan_batches(records: list[Record], batch_tokens: int, max_len: int) -> list[list[int]]:
    """Record indices grouped by length so that ``rows * longest <= batch_tokens`` (fixed order).

    A record listed more than once (``--kind-weights``) has its n-th copy planned with the other
    n-th copies, so no batch holds the same record twice.
    """
    seen: dict[str, int] = {}
    copy = []  # copy[i]: how many earlier entries are the same record
    for r in records:
        copy.append(seen.get(r.id, 0))
        seen[r.id] = copy[-1] + 1
    order = sorted(range(len(records)), key=lambda i: (copy[i], min(records[i].length, max_len), records[i].id))
    groups, cur, longest = [], [], 0
    for i in order:
        n = min(records[i].length, max_len)
        if cur and ((len(cur) + 1) * max(longest, n) > batch_tokens or copy[i] != copy[cur[-1]]):
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
