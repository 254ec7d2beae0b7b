"""Counterfactual labels for a learned tree-shape policy, on training prompts only.

For every prompt the target's greedy output ``Y`` is generated once; then, teacher-forced along
``Y`` (:func:`adaptivespec.training.counterfactual.teacher_forced`), at every position the drafter
drafts the largest tree of each branching and the tokens every smaller shape would accept there are
read off the continuation (a smaller tree is a subtree of the largest one: exactly what strict
verification accepts). Beside them, per position, what a policy can read before it picks the
shape (the draft's top-1 probability and entropy at the root, the context length) and what the
``retrieval`` source proposes there (its suffix match length, trie size, best root score) and
would accept (``src_acc``: a hybrid step accepts ``max(head's, source's)``).

One ``.pt`` file per prompt under the labels folder (resumable: a prompt with a file is skipped)::

    {"id", "kind", "prompt_len", "tokens", "ids", "output", "shapes": [[nsteps, topk, ndt], ...],
     "acc": int8 [positions, shapes], "p1", "entropy", "top4", "src_match", "src_nodes", "src_top",
     "src_acc", "selfcheck": [steps compared, steps equal]}

Labels written before ``top4`` existed are completed by :func:`backfill` (the greedy output is
regenerated, which bfloat16 decoding with the same engine reproduces, and checked by length).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import torch

from adaptivespec.sampling import root_stats
from adaptivespec.training.counterfactual import teacher_forced
from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT, Prompt, check_not_eval
from adaptivespec.training.mix import KINDS, build_mix, parse_mix
from adaptivespec.training.mix import kind_of as mix_kind
from adaptivespec.types import CandidateTrie, TreeShape

RESERVED = "reserved"
"""``--data reserved``: the broad-mix prompts of ``corpus/reserved-ids.txt``, training-split prompts
of seven kinds (code, instruct, math, qa, rag, summarize, translate) that the shipped head was never
distilled or trained on (its acceptance there is what unseen prompts get); one pool per kind."""
RESERVED_IDS = Path(__file__).resolve().parents[2] / "corpus" / "reserved-ids.txt"
DEFAULT_DATA = (RESERVED,)
"""Default prompts. Files work too (jsonl, relative to the data root), e.g. train/alpaca_prompts.jsonl;
but prompts the head was trained on overstate its acceptance."""
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
                 max_chars: int = 4000) -> list[Prompt]:
    """``per_file`` prompts drawn (seeded) from each training file (``reserved``: the first of each
    kind), interleaved pool by pool, so that any prefix or tail slice mixes the kinds. Evaluation
    sets are refused."""
    pools = []
    for spec in files:
        if spec == RESERVED:
            pools += [[p for p in pool if len(p.text) <= max_chars][:per_file] for pool in reserved_pools(root)]
            continue
        path = Path(spec) if Path(spec).is_file() else root / spec
        if not path.is_file():
            raise AdaptiveSpecError(f"--data: {spec!r} is not a file (nor under {root}); expected a jsonl of training prompts")
        check_not_eval(path)
        rows = [json.loads(line) for line in path.open() if line.strip()]
        idx = [i for i, r in enumerate(rows) if _text(r) and len(_text(r)) <= max_chars]
        random.Random(seed).shuffle(idx)
        pools.append([Prompt(f"{path.stem}-{i}", _text(rows[i])) for i in idx[:per_file]])
    return [p for group in zip(*pools) for p in group]


def reserved_pools(root: Path = DATA_ROOT) -> list[list[Prompt]]:
    """The reserved broad-mix prompts (:data:`RESERVED`), one list per kind, in the ids file's order."""
    if not RESERVED_IDS.is_file():
        raise AdaptiveSpecError(f"--data reserved: {RESERVED_IDS} not found (a source checkout holds it); "
                                "expected it, or give jsonl files of training prompts")
    ids = RESERVED_IDS.read_text().split()
    by_id = {p.id: p for p in build_mix(20000, parse_mix(None), root, seed=20261129)}  # the head's corpus draw
    pools: dict[str, list[Prompt]] = {}
    for i in ids:
        if i in by_id:
            pools.setdefault(mix_kind(i), []).append(by_id[i])
    return [pools[k] for k in sorted(pools)]


def kind_of(prompt_id: str) -> str:
    """The kind of a prompt: its broad-mix kind (``qa-t0-duorc-2274`` -> ``qa``), else the training
    file it came from (``alpaca_prompts-12`` -> ``alpaca_prompts``)."""
    kind = prompt_id.split("-", 1)[0]
    return kind if kind in KINDS else prompt_id.rsplit("-", 1)[0]


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
    return {"id": prompt.id, "kind": kind_of(prompt.id), "prompt_len": len(ids), "tokens": len(Y), "ids": ids, "output": Y,
            "shapes": [[s.nsteps, s.topk, s.ndt] for s in shapes], "acc": acc,
            "p1": torch.tensor(tf["p1"]), "entropy": torch.tensor(tf["entropy"]), "top4": torch.tensor(tf["top4"]),
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


def root_features(eng, ids: list[int], Y: list[int]) -> torch.Tensor:
    """[len(Y) - 1, 3] top-1 probability, entropy and top-4 probability of the draft at every
    teacher-forced root of ``ids + Y`` (one target forward and one drafter pass, no drafting)."""
    d = eng.runtime.drafter
    seq = torch.tensor([ids + Y])
    with torch.inference_mode():
        out = eng.target(input_ids=seq, output_hidden_states=True, logits_to_keep=1)
        state = d.fuse(out.hidden_states)[0]
        L = seq.shape[1]
        d.reset_cache(capacity=L + 64)
        outs = d.step(seq[0, 1:], state[: L - 1], torch.arange(L - 1), None)
        rows = [root_stats(d.log_probs(outs[len(ids) + j - 1]).float()) for j in range(len(Y) - 1)]
    return torch.tensor(rows)


def backfill(folder: Path, prompts: list[Prompt], max_new_tokens: int, *, progress: bool = True) -> int:
    """Add ``top4`` (and the token ids) to labels written without them; returns how many."""
    from tqdm import tqdm

    old = [p for p in prompts if label_path(folder, p).is_file()
           and "top4" not in (lab := torch.load(label_path(folder, p), weights_only=False)) and not lab.get("empty")]
    if not old:
        return 0
    eng, _ = labelling_engine()
    for p in tqdm(old, desc="backfill", unit="prompt", disable=not progress):
        lab = torch.load(label_path(folder, p), weights_only=False)
        ids = eng.encode(p.text)
        with torch.inference_mode():
            Y = eng.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids
        if len(Y) != lab["tokens"] or len(ids) != lab["prompt_len"]:
            raise AdaptiveSpecError(f"labels {p.id}: the regenerated output differs ({len(Y)} tokens, labelled "
                                    f"{lab['tokens']}); delete {label_path(folder, p)} and relabel it")
        feats = root_features(eng, ids, Y)
        if float((feats[:, 0] - lab["p1"]).abs().max()) > 1e-3:
            raise AdaptiveSpecError(f"labels {p.id}: the regenerated roots differ from the labelled ones; "
                                    f"delete {label_path(folder, p)} and relabel it")
        lab.update(ids=ids, output=Y, top4=feats[:, 2])
        torch.save(lab, label_path(folder, p))
    return len(old)


def load_labels(folder: Path, prompts: list[Prompt] | None = None) -> list[dict]:
    """The labels under ``folder`` (of ``prompts`` only, in their order, when given), empty outputs dropped."""
    folder = Path(folder)
    paths = [label_path(folder, p) for p in prompts] if prompts is not None else sorted(folder.glob("*.pt"))
    out = [torch.load(p, weights_only=False) for p in paths if p.is_file()]
    return [x for x in out if not x.get("empty")]
