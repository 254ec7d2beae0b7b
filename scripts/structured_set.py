"""Build the ``structured`` evaluation set (and a disjoint tuning slice) from training-split passages
the shipped head's corpus never used.

Three categories, each prompt with its own JSON schema (``response_format`` of the record):

* ``extract-bio``: the fact list of a WikiBio infobox (T0's ``wiki_bio`` prompts, train split) ->
  a person record (dates, places, occupation, nationality, a list of what they are known for);
* ``extract-plot``: a DuoRC movie plot (T0's ``duorc`` prompts, train split) and its question ->
  title, genre (enum), setting, the main characters as objects, the answer;
* ``function-call``: an Alpaca instruction -> a call of one of four tools (``anyOf`` over the
  tools, each with its own arguments), the form of OpenAI-style function calling.

Only records whose mix id is neither in the head's corpus (``corpus/*.jsonl.gz``) nor in
``corpus/reserved-ids.txt`` are taken (see ``adaptivespec/training/mix.py`` for the ids); the
first ``--per-category`` of each category in source order go to the evaluation set, the next
``--tuning`` to the tuning slice (never both).

    python scripts/structured_set.py --out adaptivespec/evaluation/data/structured/structured.jsonl \\
        --tuning-out runs/tuning/structured-tuning.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

from adaptivespec.training.data import DATA_ROOT

ROOT = Path(__file__).parents[1]
DATA = DATA_ROOT  # $ADAPTIVESPEC_DATA, else shared/data beside the checkout

BIO_SCHEMA = {
    "type": "object",
    "properties": {
        "birth_date": {"type": "string", "maxLength": 40},
        "birth_place": {"type": "string", "maxLength": 80},
        "death_date": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
        "occupation": {"type": "string", "maxLength": 80},
        "nationality": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
        "known_for": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 3},
    },
    "required": ["birth_date", "birth_place", "death_date", "occupation", "nationality", "known_for"],
}
PLOT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "genre": {"enum": ["action", "comedy", "drama", "horror", "romance", "science fiction", "thriller", "western", "other"]},
        "setting": {"type": "string", "maxLength": 100},
        "main_characters": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "actor": {"type": "string", "maxLength": 40}},
            "required": ["name", "actor"]}},
        "answer": {"type": "string", "maxLength": 120},
    },
    "required": ["title", "genre", "setting", "main_characters", "answer"],
}
TOOLS_SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": {
            "name": {"const": "search_web"},
            "arguments": {"type": "object", "properties": {
                "query": {"type": "string", "maxLength": 100}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["query", "max_results"]}},
         "required": ["name", "arguments"]},
        {"type": "object", "properties": {
            "name": {"const": "write_text"},
            "arguments": {"type": "object", "properties": {
                "topic": {"type": "string", "maxLength": 100},
                "form": {"enum": ["paragraph", "list", "poem", "story", "email", "summary"]},
                "words": {"type": "integer", "minimum": 10, "maximum": 500}},
                "required": ["topic", "form", "words"]}},
         "required": ["name", "arguments"]},
        {"type": "object", "properties": {
            "name": {"const": "calculate"},
            "arguments": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 100}},
                          "required": ["expression"]}},
         "required": ["name", "arguments"]},
        {"type": "object", "properties": {
            "name": {"const": "classify_text"},
            "arguments": {"type": "object", "properties": {
                "text": {"type": "string", "maxLength": 200},
                "labels": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 5}},
                "required": ["text", "labels"]}},
         "required": ["name", "arguments"]},
    ]
}
TOOLS_TEXT = ("search_web(query, max_results): search the internet; write_text(topic, form, words): write a text; "
              "calculate(expression): evaluate arithmetic; classify_text(text, labels): pick labels for a text")


def seen_ids() -> set[str]:
    seen = set()
    for f in sorted((ROOT / "corpus").glob("*.jsonl.gz")):
        with gzip.open(f, "rt") as h:
            seen |= {json.loads(line)["id"] for line in h}
    seen |= set((ROOT / "corpus" / "reserved-ids.txt").read_text().split())
    return seen


def rows(rel: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / rel).read_text().splitlines() if line.strip()]


def bio_facts(prompt: str) -> str:
    facts = [m.strip() for m in re.findall(r"^- (.+?)\s*$", prompt, flags=re.M)]
    facts = [f for f in facts if (" is " in f or ": " in f) and not f.startswith(("image", "caption"))]  # with values
    return "\n".join(f"- {f}" for f in facts)


def build(per_category: int, tuning: int) -> tuple[list[dict], list[dict]]:
    seen = seen_ids()
    t0 = rows("train/t0_context_prompts.jsonl")
    alpaca = rows("train/alpaca_prompts.jsonl")
    cats: dict[str, list[dict]] = {"extract-bio": [], "extract-plot": [], "function-call": []}
    plots: set[str] = set()
    used = lambda d, i: any(f"{k}-t0-{d}-{i}" in seen for k in ("rag", "qa", "summarize"))  # noqa: E731
    for i, r in enumerate(t0):
        if r["dataset"] == "wiki_bio" and not used("wiki_bio", i):
            facts = bio_facts(r["prompt"])
            if facts.count("\n") < 4:
                continue
            cats["extract-bio"].append({
                "id": f"structured/bio-t0-{i}", "category": "extract-bio", "source": f"t0_context_prompts.jsonl:{i + 1} (wiki_bio)",
                "prompt": "Fill in a JSON record about the person these infobox facts describe. Use the facts' own words; "
                          "use null where a fact is missing.\n\n" + facts,
                "response_format": {"type": "json_schema", "schema": BIO_SCHEMA}})
        if r["dataset"] == "duorc" and not used("duorc", i) and "Movie plot:" in r["prompt"]:
            text = r["prompt"]
            q = re.search(r"Question: (.+)", text)
            title = re.search(r"Movie (?:plot )?title: (.+)", text)
            plot = text.split("Movie plot:", 1)[1].strip()
            if not q or not title or title.group(1) in plots:  # one prompt per movie
                continue
            plots.add(title.group(1))
            if len(plot) > 1500:  # the plot's first sentences (prefill stays short)
                plot = plot[:1500].rsplit(". ", 1)[0] + "."
            cats["extract-plot"].append({
                "id": f"structured/plot-t0-{i}", "category": "extract-plot", "source": f"t0_context_prompts.jsonl:{i + 1} (duorc)",
                "prompt": f"Movie title: {title.group(1).strip()}\nMovie plot: {plot}\n\nDescribe this movie as a JSON record "
                          f"(title, genre, setting, up to three main characters with the actors who play them) and answer "
                          f"the question in the 'answer' field: {q.group(1).strip()}",
                "response_format": {"type": "json_schema", "schema": PLOT_SCHEMA}})
    for i, r in enumerate(alpaca):
        if any(f"{k}-alpaca-{i}{t}" in seen for k in ("instruct", "chat2") for t in ("", "-t1")):
            continue
        text = r["instruction"] + (f"\n{r['input']}" if r.get("input") else "")
        if len(text) > 400:
            continue
        cats["function-call"].append({
            "id": f"structured/call-alpaca-{i}", "category": "function-call", "source": f"alpaca_prompts.jsonl:{i + 1}",
            "prompt": f"You can call one of these tools: {TOOLS_TEXT}. Reply with the JSON tool call "
                      f"({{\"name\": ..., \"arguments\": {{...}}}}) that best serves this request:\n\n{text}",
            "response_format": {"type": "json_schema", "schema": TOOLS_SCHEMA}})
    evaluation, tune = [], []
    for name, items in cats.items():
        if len(items) < per_category + tuning:
            raise SystemExit(f"{name}: only {len(items)} unseen records")
        evaluation += items[:per_category]
        tune += items[per_category:per_category + tuning]
    return evaluation, tune


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tuning-out")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--tuning", type=int, default=4)
    a = ap.parse_args()
    ev, tune = build(a.per_category, a.tuning)
    for path, items in ((a.out, ev), (a.tuning_out, tune)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items))
            print(f"{path}: {len(items)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
