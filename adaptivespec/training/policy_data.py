"""Counterfactual labels for a learned tree-shape policy, on training prompts only.

For every prompt the target's greedy output ``Y`` is generated once; then, teacher-forced along
``Y`` (:func:`adaptivespec.analysis.shape_oracle.teacher_forced`), at every position the drafter
drafts the largest tree of each branching and the tokens every smaller shape would accept there are
read off the continuation (a smaller tree is a subtree of the largest one: exactly what strict
verification accepts). Beside them, per position, what a policy can read before it picks the
shape (the draft's top-1 probability and entropy at the root, the context length) and what the
``retrieval`` source proposes there (its suffix match length, trie size, best root score) and
would accept (``src_acc``: a hybrid step accepts ``max(head's, source's)``).

One ``.pt`` file per prompt under the labels folder (resumable: a prompt with a file is skipped)::

    {"id", "kind", "prompt_len", "tokens", "shapes": [[nsteps, topk, ndt], ...],
     "acc": int8 [positions, shapes], "p1", "entropy", "src_match", "src_nodes", "src_top", "src_acc",
     "selfcheck": [steps compared, steps equal]}
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import torch

from adaptivespec.analysis.shape_oracle import teacher_forced
from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT, Prompt, check_not_eval
from adaptivespec.types import CandidateTrie, TreeShape

DEFAULT_DATA = ("train/alpaca_prompts.jsonl", "train/code_alpaca.jsonl", "train/mbpp_nontest.jsonl",
                "train/t0_context_prompts.jsonl")
"""Training prompt files (relative to the data root): instruct, code, code with tests, context QA."""
BRANCHING = (1, 2, 3, 4)
DEPTH = 6
MAX_NDT = 16
RETRIEVAL = {"max_ngram": 8, "min_match": 1, "max_depth": 8, "max_nodes": 16, "max_occurrences": 8, "extra_slots": 8}
"""The retrieval source as configs/hybrid.yaml sets it."""


def label_shapes() -> list[TreeShape]:
    """Every shape labelled: branching in :data:`BRANCHING`, depth <= :data:`DEPTH`, ndt <= :data:`MAX_NDT`."""
    out = []
    for k in BRANCHING:
        for ns in range(1, DEPTH + 1):
            for ndt in range(2, MAX_NDT + 1):
                try:
                    out.append(TreeShape(ns, k, ndt))
                except ValueError:
                    continue
    return out


def _text(row: dict) -> str:
    text = row.get("prompt") or row.get("question") or row.get("instruction") or row.get("text")
    extra = (row.get("input") or "").strip() if "instruction" in row else ""
    if "test_list" in row and row["test_list"]:
        extra = row["test_list"][0]
    return text + (f"\n\n{extra}" if extra else "")


def pick_prompts(files: list[str], per_file: int, root: Path = DATA_ROOT, seed: int = 20261204,
                 max_chars: int = 2400) -> list[Prompt]:
    """``per_file`` prompts drawn (seeded) from each training file, interleaved file by file, so that
    any prefix or tail slice mixes the kinds. Evaluation sets are refused."""
    pools = []
    for spec in files:
        path = Path(spec) if Path(spec).is_file() else root / spec
        if not path.is_file():
            raise AdaptiveSpecError(f"--data: {spec!r} is not a file (nor under {root}); expected a jsonl of training prompts")
        check_not_eval(path)
        rows = [json.loads(line) for line in path.open() if line.strip()]
        idx = [i for i, r in enumerate(rows) if _text(r) and len(_text(r)) <= max_chars]
        random.Random(seed).shuffle(idx)
        pools.append([Prompt(f"{path.stem}-{i}", _text(rows[i])) for i in idx[:per_file]])
    return [p for group in zip(*pools) for p in group]


def kind_of(prompt_id: str) -> str:
    """The training file a prompt id came from (``alpaca_prompts-12`` -> ``alpaca_prompts``)."""
    return prompt_id.rsplit("-", 1)[0]


def trie_accepted(trie: CandidateTrie | None, cont: list[int]) -> int:
    """Tokens of ``cont`` a trie accepts: the longest trie path matching its prefix."""
    if trie is None:
        return 0
    node, n = -1, 0
    for t in cont:
        node = trie.child(node, t)
        if node < 0:
            break
        n += 1
    return n


def labelling_engine(dtype: str = "bfloat16"):
    """The engine labels are made with (the embedded pair, eagle3.yaml's shape for the greedy pass)
    and the full tree of each branching prepared in its bank."""
    from adaptivespec.decode import Engine

    eng = Engine(load_config(None, ["policy.nsteps=3", "policy.topk=4", "policy.ndt=8", f"runtime.dtype={dtype}"]))
    full = {k: TreeShape(DEPTH, k, k + (DEPTH - 1) * k * k + 1) for k in BRANCHING}
    eng.runtime.prepare([*full.values(), *eng.policy.shapes()], capacity=4096)
    return eng, full


def _retrieval_source():
    from adaptivespec.plugins import get_plugin_host

    host = get_plugin_host()
    spec = host.sources.get("retrieval")
    return spec.cls(spec.cls.Params(**RETRIEVAL))


def label_one(eng, full: dict, shapes: list[TreeShape], prompt: Prompt, max_new_tokens: int) -> dict:
    """The labels of one prompt (see the module docstring)."""
    ids = eng.encode(prompt.text)
    with torch.inference_mode():
        res = eng.generate_ids(ids, max_new_tokens=max_new_tokens)
        Y = res.token_ids
        if len(Y) < 3:
            return {"id": prompt.id, "kind": kind_of(prompt.id), "prompt_len": len(ids), "tokens": len(Y), "empty": True}
        tf = teacher_forced(eng, ids, Y, full, shapes)
    acc = torch.tensor([[a[s] for s in shapes] for a in tf["acc"]], dtype=torch.int8)
    src = _retrieval_source()
    src.reset(ids)
    src.extend([Y[0]])
    match, nodes, top, sacc = [], [], [], []
    for j in range(len(Y) - 1):
        trie = src.propose()
        match.append(trie.match_length if trie else 0)
        nodes.append(len(trie) if trie else 0)
        top.append(max((s for s, p in zip(trie.scores, trie.parents) if p < 0), default=0.0) if trie else 0.0)
        sacc.append(trie_accepted(trie, Y[j + 1:]))
        src.extend([Y[j + 1]])
    checked = [0, 0]
    i = 0
    col = {s: c for c, s in enumerate(shapes)}
    for rec in res.records:
        if i >= acc.shape[0] or rec.shape not in col:
            break
        checked[0] += 1
        checked[1] += int(acc[i, col[rec.shape]]) == rec.accepted
        i += rec.accepted + 1
    return {"id": prompt.id, "kind": kind_of(prompt.id), "prompt_len": len(ids), "tokens": len(Y),
            "shapes": [[s.nsteps, s.topk, s.ndt] for s in shapes], "acc": acc,
            "p1": torch.tensor(tf["p1"]), "entropy": torch.tensor(tf["entropy"]),
            "src_match": torch.tensor(match, dtype=torch.int16), "src_nodes": torch.tensor(nodes, dtype=torch.int16),
            "src_top": torch.tensor(top), "src_acc": torch.tensor(sacc, dtype=torch.int8), "selfcheck": checked}


def label_path(folder: Path, prompt: Prompt) -> Path:
    return Path(folder) / f"{prompt.id}.pt"


def build_labels(folder: Path, prompts: list[Prompt], max_new_tokens: int, *, progress: bool = True,
                 deadline: float | None = None, on_done: Callable[[dict], None] | None = None) -> int:
    """Label every prompt of ``prompts`` lacking a file under ``folder`` (resumable); stops early
    (returns) once ``time.time()`` passes ``deadline``. Returns the number of prompts labelled now."""
    import time

    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    todo = [p for p in prompts if not label_path(folder, p).is_file()]
    if not todo:
        return 0
    eng, full = labelling_engine()
    shapes = label_shapes()
    done = 0
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="labels", unit="prompt", disable=not progress)
    for p in todo:
        if deadline is not None and time.time() > deadline:
            break
        lab = label_one(eng, full, shapes, p, max_new_tokens)
        tmp = label_path(folder, p).with_suffix(".tmp")
        torch.save(lab, tmp)
        tmp.rename(label_path(folder, p))
        done += 1
        bar.update(1)
        if on_done is not None:
            on_done(lab)
    bar.close()
    return done


def load_labels(folder: Path, prompts: list[Prompt] | None = None) -> list[dict]:
    """The labels under ``folder`` (of ``prompts`` only, in their order, when given), empty outputs dropped."""
    folder = Path(folder)
    paths = [label_path(folder, p) for p in prompts] if prompts is not None else sorted(folder.glob("*.pt"))
    out = [torch.load(p, weights_only=False) for p in paths if p.is_file()]
    return [x for x in out if not x.get("empty")]
