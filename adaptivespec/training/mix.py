"""The broad training mix: the kinds of prompt users send, built from training splits only.

Each *kind* draws from one or more sources under ``shared/data`` (never an evaluation set)::

    kind        what a prompt looks like                              sources
    math        a word problem                                        gsm8k/train
    code        a coding instruction / a function with its test       train/code_alpaca, train/mbpp_nontest
    instruct    an open instruction (with its input, if any)          train/alpaca_prompts
    qa          a short closed-book or single-passage question        t0 hotpot_qa, duorc (short)
    rag         answer from a passage (reading comprehension, QA)     t0 adversarial_qa, quoref, ropes,
                                                                      cosmos_qa, wiki_bio, wiki_hop; pubmedqa
    summarize   summarize a passage of 500-2,000 tokens               t0 cnn_dailymail; scitldr abstracts and
                                                                      long_docs concatenated / truncated
    translate   translate 1-3 German / French / Czech sentences       train/multi30k_src
    chat2       a second user turn that follows the model's own       alpaca instruction, then one of
                first answer (MT-bench style two-turn chat)           FOLLOW_UPS (written here)

:func:`build_mix` draws ``total`` prompts with the given proportions, deterministically from a
seed. A ``chat2`` prompt carries its first turn; its second turn is generated once the model's
answer to the first turn exists (``training.data.distill`` runs the two passes).

Passage lengths are set in characters (~4 characters per token for English), so building a mix
needs no tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.training.data import DATA_ROOT, Prompt, Record, check_not_eval

#: default proportions of ``train-drafter --mix`` (recorded in run.json and the model card)
DEFAULT_MIX = {"math": 0.12, "code": 0.14, "instruct": 0.18, "qa": 0.08, "rag": 0.16, "summarize": 0.16,
               "translate": 0.08, "chat2": 0.08}
CHARS_PER_TOKEN = 4.0
SUMMARY_TOKENS = (500, 2000)  # prompt length range of built summarization passages
RAG_MAX_CHARS = 7000  # ~1,750 tokens: long wiki_hop passages are cut at a paragraph or sentence

FOLLOW_UPS = [
    "Now rewrite your answer in at most three sentences.",
    "Can you explain that in simpler words, as if to a twelve-year-old?",
    "Please turn your answer into a bulleted list.",
    "Give two more examples.",
    "What is the strongest objection to what you said, and how would you answer it?",
    "Rewrite your previous answer in a more formal tone.",
    "Summarize your answer in one sentence.",
    "Expand on the most important point of your answer.",
    "Which part of your answer are you least sure about, and why?",
    "Now write the same answer for a professional audience.",
]
SUMMARY_TEMPLATES = [
    "Summarize: {text}",
    "Summarize the following text in a few sentences.\n\n{text}",
    "{text}\n\nWrite a short summary of the text above.",
    "Read the passage below and give its main points.\n\n{text}",
]
RAG_TEMPLATES = [
    "{context}\n\nQuestion: {question}\nAnswer the question using the passage above.",
    "Answer the question based on the passage.\n\nPassage: {context}\n\nQuestion: {question}",
]
TRANSLATE_TEMPLATES = [
    "Translate {lang} to English: {text}",
    "Translate the following {lang} text into English.\n\n{text}",
]
LANGS = {"de": "German", "fr": "French", "cs": "Czech"}
T0_KIND = {"hotpot_qa": "qa", "duorc": "qa", "adversarial_qa": "rag", "quoref": "rag", "ropes": "rag",
           "cosmos_qa": "rag", "wiki_bio": "rag", "wiki_hop": "rag", "cnn_dailymail": "summarize"}


def _rows(root: Path, rel: str) -> list[dict]:
    path = root / rel
    if not path.is_file():
        raise AdaptiveSpecError(f"--data-root: {str(path)!r} is missing; expected the shared training prompts "
                                f"(train/*.jsonl, gsm8k/train.jsonl) under {root}")
    check_not_eval(path, "--data-root")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a paragraph or sentence end when there is one."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    for sep in ("\n\n", "\n", ". "):
        at = head.rfind(sep)
        if at > limit // 2:
            return head[: at + (1 if sep == ". " else 0)].rstrip()
    return head.rstrip()


# -- one builder per kind: (root, rng) -> list of prompts, in a fixed order ---------------------------
def _math(root: Path, rng: random.Random) -> list[Prompt]:
    return [Prompt(f"math-gsm8k-train-{i}", r["question"]) for i, r in enumerate(_rows(root, "gsm8k/train.jsonl"))]


def _code(root: Path, rng: random.Random) -> list[Prompt]:
    out = []
    for i, r in enumerate(_rows(root, "train/code_alpaca.jsonl")):
        extra = (r.get("input") or "").strip()
        out.append(Prompt(f"code-alpaca-{i}", r["instruction"] + (f"\n\n{extra}" if extra else "")))
    out += [Prompt(f"code-mbpp-{r['task_id']}", r["text"] + "\n" + r["test_list"][0])
            for r in _rows(root, "train/mbpp_nontest.jsonl")]
    return out


def _alpaca(root: Path) -> list[tuple[int, str]]:
    out = []
    for i, r in enumerate(_rows(root, "train/alpaca_prompts.jsonl")):
        extra = (r.get("input") or "").strip()
        out.append((i, r["instruction"] + (f"\n\n{extra}" if extra else "")))
    return out


def _instruct(root: Path, rng: random.Random) -> list[Prompt]:
    return [Prompt(f"instruct-alpaca-{i}", text) for i, text in _alpaca(root) if i % 5]  # i % 5 == 0: chat2


def _chat2(root: Path, rng: random.Random) -> list[Prompt]:
    return [Prompt(f"chat2-alpaca-{i}", text, follow_up=FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))])
            for i, text in _alpaca(root) if i % 5 == 0 and len(text) < 1500]


def _t0(root: Path, kind: str) -> list[Prompt]:
    out = []
    for i, r in enumerate(_rows(root, "train/t0_context_prompts.jsonl")):
        if T0_KIND.get(r["dataset"]) != kind:
            continue
        text = r["prompt"]
        if kind == "qa" and len(text) > 600:  # long duorc / hotpot prompts read a passage: rag, not qa
            continue
        if kind == "rag" and len(text) > RAG_MAX_CHARS:
            continue
        out.append(Prompt(f"{kind}-t0-{r['dataset']}-{i}", text))
    return out


def _qa(root: Path, rng: random.Random) -> list[Prompt]:
    return _t0(root, "qa")


def _rag(root: Path, rng: random.Random) -> list[Prompt]:
    out = _t0(root, "rag")
    for i, r in enumerate(_rows(root, "train/pubmedqa_nontest.jsonl")):
        template = RAG_TEMPLATES[rng.randrange(len(RAG_TEMPLATES))]
        out.append(Prompt(f"rag-pubmedqa-{r['pubid']}", template.format(context=r["context"], question=r["question"])))
    return out


def _joined(texts: list[str], lo: int, hi: int, rng: random.Random):
    """``(first, last, wanted length, text)``: consecutive ``texts`` joined by blank lines until a length
    drawn in ``[lo, hi]`` (one draw per group, before the group is built) is reached."""
    i = 0
    while i < len(texts):
        want, parts, start = rng.randint(lo, hi), [], i
        while i < len(texts) and sum(map(len, parts)) < want:
            parts.append(texts[i])
            i += 1
        yield start, i - 1, want, "\n\n".join(parts)


def _summarize(root: Path, rng: random.Random) -> list[Prompt]:
    out = _t0(root, "summarize")
    lo, hi = (int(t * CHARS_PER_TOKEN) for t in SUMMARY_TOKENS)
    # scitldr: consecutive abstracts joined until a drawn length in [lo, hi] is reached
    for start, end, want, text in _joined([r["text"] for r in _rows(root, "train/scitldr_abstracts.jsonl")], lo, hi, rng):
        template = SUMMARY_TEMPLATES[rng.randrange(len(SUMMARY_TEMPLATES))]
        out.append(Prompt(f"summarize-scitldr-{start}-{end}", template.format(text=_cut(text, hi))))
    # long_docs: one document (or several short ones) cut to a drawn length
    for start, end, want, text in _joined([r["text"].strip() for r in _rows(root, "train/long_docs.jsonl")], lo, hi, rng):
        text = _cut(text, want)
        if len(text) >= lo // 2:
            template = SUMMARY_TEMPLATES[rng.randrange(len(SUMMARY_TEMPLATES))]
            out.append(Prompt(f"summarize-longdocs-{start}-{end}", template.format(text=text)))
    return out


def _translate(root: Path, rng: random.Random) -> list[Prompt]:
    by_lang: dict[str, list[tuple[int, str]]] = {}
    for i, r in enumerate(_rows(root, "train/multi30k_src.jsonl")):
        by_lang.setdefault(r["lang"], []).append((i, r["text"]))
    out = []
    for lang, rows in by_lang.items():
        j = 0
        while j < len(rows):
            n = rng.choice((1, 1, 2, 3))  # mostly one sentence, as users and Spec-Bench send
            group = rows[j : j + n]
            j += n
            template = TRANSLATE_TEMPLATES[rng.randrange(len(TRANSLATE_TEMPLATES))]
            text = template.format(lang=LANGS.get(lang, lang), text=" ".join(t for _, t in group))
            out.append(Prompt(f"translate-multi30k-{group[0][0]}-{group[-1][0]}", text))
    return out


KINDS: dict[str, Callable[[Path, random.Random], list[Prompt]]] = {
    "math": _math, "code": _code, "instruct": _instruct, "qa": _qa, "rag": _rag, "summarize": _summarize,
    "translate": _translate, "chat2": _chat2,
}


def kind_of(prompt_id: str) -> str:
    """The kind of a mix prompt (or record) from its id; ``other`` for ids from elsewhere."""
    head = prompt_id.split("-", 1)[0]
    return head if head in KINDS else "other"


def parse_mix(text: str | None) -> dict[str, float]:
    """``math=0.2,code=0.1,...`` -> normalised proportions; ``None``/``default`` -> :data:`DEFAULT_MIX`."""
    if text is None or text.strip() in ("", "default"):
        return dict(DEFAULT_MIX)
    out = _kind_pairs(text, "--mix", 1e300, "non-negative weights, e.g. math=0.2,rag=0.3")
    total = sum(out.values())
    if total <= 0:
        raise AdaptiveSpecError(f"--mix: {text!r} has no positive weight; expected at least one kind with weight > 0")
    return {k: v / total for k, v in out.items() if v > 0}


def parse_kind_weights(text: str | None) -> dict[str, float]:
    """``translate=3,rag=2`` -> ``{kind: weight}`` (``train-drafter --kind-weights``); unlisted kinds weigh 1."""
    if text is None or not text.strip():
        return {}
    return _kind_pairs(text, "--kind-weights", 100, "weights from 0 to 100 (times per epoch), e.g. translate=3,rag=2")


def _kind_pairs(text: str, flag: str, most: float, expected: str) -> dict[str, float]:
    """``kind=w,...`` -> ``{kind: w}`` with 0 <= w <= ``most``; a one-line error naming ``flag`` otherwise."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if name not in KINDS or not 0 <= weight <= most:
            raise AdaptiveSpecError(f"{flag}: {part.strip()!r} is not a kind=weight pair; expected kinds from "
                                    f"{', '.join(KINDS)} with {expected}")
        out[name] = weight
    return out


def weight_records(records: list[Record], weights: dict[str, float], seed: int = 0) -> list[Record]:
    """The training records with each record of kind k present ``weights[k]`` times (default 1).

    A fractional weight w keeps floor(w) copies and one more with probability frac(w), drawn per record
    id with ``seed`` (so 0.5 keeps a fixed half, 2.5 every record twice and half of them three times);
    0 drops the kind. Copies are the same record: the feature cache serves them, and
    ``data.plan_batches`` puts each copy in a different batch.
    """
    if not weights:
        return records
    out: list[Record] = []
    for r in records:
        w = weights.get(kind_of(r.id), 1.0)
        n = int(w) + (random.Random(f"{seed}-{r.id}").random() < w - int(w))
        out += [r] * n
    return out


def build_mix(total: int, mix: dict[str, float] | None = None, root: Path = DATA_ROOT, seed: int = 20261130) -> list[Prompt]:
    """``total`` prompts drawn per kind in proportion ``mix``, interleaved in a seeded random order.

    A kind with fewer prompts than its share gives all it has (the shortfall is not refilled, so
    the realised proportions are what :func:`mix_counts` reports). Deterministic in ``seed``.
    """
    mix = parse_mix(None) if mix is None else mix
    chosen: list[Prompt] = []
    for kind, weight in mix.items():
        rng = random.Random(f"{seed}-{kind}")
        pool = KINDS[kind](root, rng)
        rng.shuffle(pool)
        chosen += pool[: round(weight * total)]
    random.Random(seed).shuffle(chosen)
    return chosen


def mix_counts(prompts: list[Prompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in prompts:
        counts[kind_of(p.id)] = counts.get(kind_of(p.id), 0) + 1
    return dict(sorted(counts.items()))
