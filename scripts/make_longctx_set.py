"""Build the long-context evaluation set (``adaptivespec bench --dataset longctx``) from training documents.

Source: the Wikipedia articles of ``shared/data/train/long_docs.jsonl`` (LLaMA-Factory's
``wiki_demo.txt``; text CC BY-SA). The draft head's training corpus used at most the first 8,000
characters of any of these documents (``adaptivespec/training/mix.py``: summarization passages
are cut to <= 2,000 tokens x 4 characters), so every passage here starts at character 10,000 of
an article long enough to give 4,096 tokens from there: text no head has seen. Articles alternate
between two splits: ``adaptivespec/evaluation/data/longctx/question.jsonl`` (reported; never
tune on it) and ``runs/longctx/tune.jsonl`` (not shipped: for choosing shapes, thresholds and
cost profiles, with ``bench --dataset specbench --data runs/longctx/tune.jsonl``).

Each article gives, at each length of about 512, 1k, 2k and 4k tokens (the passage cut at the last
sentence end before that many tokens of the embedded tokenizer), one summarization prompt and one
question about a name that recurs in the passage. Categories: ``summarize-<len>``, ``qa-<len>``.

    python scripts/make_longctx_set.py [--docs ../shared/data/train/long_docs.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from adaptivespec.models import EMBEDDED, resolve_target

OFFSET = 10_000  # characters skipped: past anything the head's training corpus took from a document
LENGTHS = {"512": 512, "1k": 1024, "2k": 2048, "4k": 4096}
SUMMARY = "Summarize the following article in one paragraph.\n\n{text}"
QUESTION = "{text}\n\nAnswer using only the article above: what does it say about {entity}?"
OUT = Path(__file__).resolve().parents[1] / "adaptivespec" / "evaluation" / "data" / "longctx"
TUNE = Path(__file__).resolve().parents[1] / "runs" / "longctx" / "tune.jsonl"
STOP = {"The", "This", "In", "It", "He", "She", "They", "His", "Her", "A", "An", "On", "At", "As", "By", "For", "After"}


def cut(text: str, tokenizer, tokens: int) -> str:
    """``text`` up to the last sentence end within its first ``tokens`` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    head = tokenizer.decode(ids)
    end = max(head.rfind(". "), head.rfind(".\n"))
    return head[: end + 1] if end > len(head) // 2 else head


def start(text: str) -> str:
    """``text`` from the first sentence that begins at or after character :data:`OFFSET`."""
    m = re.compile(r"[.!?]\s*(?=[A-Z])").search(text, OFFSET)
    return text[m.end():] if m else ""


def entity(text: str) -> str | None:
    """The most frequent capitalised name (1-3 words) of the passage's second half that also occurs in the first."""
    names = re.findall(r"\b([A-Z][a-z]+(?: [A-Z][a-z]+){0,2})\b", text)
    counts = collections.Counter(n for n in names if n.split()[0] not in STOP)
    half = text[len(text) // 2 :]
    for name, _ in counts.most_common():
        if name in half and len(name) > 3:
            return name
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "long_docs.jsonl"))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve_target(EMBEDDED), local_files_only=True)
    rows = [json.loads(line) for line in open(args.docs, encoding="utf-8")]
    splits: dict[str, list[dict]] = {"question.jsonl": [], "tune.jsonl": []}
    articles = [(i, r["text"]) for i, r in enumerate(rows) if r["source"] == "wikipedia"]
    articles = [(i, start(t)) for i, t in articles]
    articles = [(i, t) for i, t in articles if len(tok(t, add_special_tokens=False)["input_ids"]) >= 4200]
    for k, (doc, text) in enumerate(articles):
        split = "question.jsonl" if k % 2 == 0 else "tune.jsonl"
        for name, n in LENGTHS.items():
            passage = cut(text, tok, n)
            who = entity(passage)
            base = {"source": f"long_docs.jsonl line {doc + 1}, from the first sentence after character {OFFSET}"}
            splits[split].append({"question_id": f"longctx/{doc}/summarize-{name}", "category": f"summarize-{name}",
                                  "turns": [SUMMARY.format(text=passage)], **base})
            if who:
                splits[split].append({"question_id": f"longctx/{doc}/qa-{name}", "category": f"qa-{name}",
                                      "turns": [QUESTION.format(text=passage, entity=who)], "entity": who, **base})
    for name, items in splits.items():
        path = OUT / name if name == "question.jsonl" else TUNE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
        print(f"{path}: {len(items)} prompts from {len({i['question_id'].split('/')[1] for i in items})} articles")


if __name__ == "__main__":
    main()
