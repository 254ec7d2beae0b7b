"""Compare two contenders of one bench run on the prompts where they produced the same text.

In bfloat16, greedy decoding is not bit-stable across verify shapes: a tree verify, a chain
verify and a one-token step round the same logits differently, and a near-tie can flip, so two
lossless contenders often generate *different* texts for one prompt (a flip that lands in a
repetition loop drafts at tau > 5, one that ends early at tau ~ 1). Their tokens/s then compare
different work. This script restricts the comparison to the prompts where both texts are
identical, per category, and reports target forwards (work to produce the same tokens) and
tokens/s there, beside the all-prompt figures.

    python -m adaptivespec.analysis.paired_compare runs/q/specbench --a retrieval --b hf-prompt-lookup

Prints a markdown table; ``--json FILE`` also writes the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from adaptivespec.evaluation.categories import category_of
from adaptivespec.evaluation.datasets import load_dataset


def load_run(run: Path) -> tuple[dict[str, dict[str, dict]], dict[str, str]]:
    """``records[config][problem id]`` and ``category[problem id]`` of a bench run folder."""
    settings = json.loads((run / "settings.json").read_text())
    problems = load_dataset(settings["dataset"], settings.get("data"))
    category = {p.id: category_of(p) or "all" for p in problems}
    records: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for line in (run / "records.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            records[r["config"]][str(r["id"])] = r
    return records, category


def compare(records: dict[str, dict[str, dict]], category: dict[str, str], a: str, b: str) -> list[dict]:
    """Per category (then ``overall``): prompts, identical texts, and both sides' figures."""
    rows: dict[str, dict] = {}
    for pid in sorted(set(records[a]) & set(records[b]), key=lambda i: (category.get(i, "all"), i)):
        ra, rb = records[a][pid], records[b][pid]
        for cat in (category.get(pid, "all"), "overall"):
            row = rows.setdefault(cat, {"category": cat, "prompts": 0, "identical": 0, **{
                f"{k}_{s}": 0.0 for k in ("tokens", "wall", "forwards", "same_tokens", "same_wall", "same_forwards")
                for s in ("a", "b")}})
            row["prompts"] += 1
            same = ra["text"] == rb["text"]
            row["identical"] += same
            for s, r in (("a", ra), ("b", rb)):
                row[f"tokens_{s}"] += r["new_tokens"]
                row[f"wall_{s}"] += r["wall_seconds"]
                row[f"forwards_{s}"] += r["target_forwards"] or 0
                if same:
                    row[f"same_tokens_{s}"] += r["new_tokens"]
                    row[f"same_wall_{s}"] += r["wall_seconds"]
                    row[f"same_forwards_{s}"] += r["target_forwards"] or 0
    out = [rows[c] for c in sorted(rows, key=lambda c: (c == "overall", c))]
    for row in out:
        for pre in ("", "same_"):
            for s in ("a", "b"):
                w, f = row[f"{pre}wall_{s}"], row[f"{pre}forwards_{s}"]
                row[f"{pre}tps_{s}"] = row[f"{pre}tokens_{s}"] / w if w else None
                row[f"{pre}tau_{s}"] = row[f"{pre}tokens_{s}"] / f if f else None
    return out


def _f(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict], a: str, b: str) -> str:
    lines = [f"`{a}` (a) vs `{b}` (b). All prompts: tok/s and tau of each. Identical text: the prompts where both "
             "generated the same tokens; there, target forwards and tok/s of each.", "",
             "| category | prompts | tok/s a | tok/s b | tau a | tau b | identical | forwards a | forwards b | tok/s a | tok/s b | a/b |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["same_tps_a"] / r["same_tps_b"] if r["same_tps_a"] and r["same_tps_b"] else None
        lines.append(f"| {r['category']} | {r['prompts']} | {_f(r['tps_a'], '.1f')} | {_f(r['tps_b'], '.1f')} | "
                     f"{_f(r['tau_a'])} | {_f(r['tau_b'])} | {r['identical']} | {int(r['same_forwards_a'])} | "
                     f"{int(r['same_forwards_b'])} | {_f(r['same_tps_a'], '.1f')} | {_f(r['same_tps_b'], '.1f')} | "
                     f"{_f(ratio)}{'x' if ratio else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a bench run folder (settings.json, records.jsonl)")
    ap.add_argument("--a", required=True, help="first contender's name")
    ap.add_argument("--b", required=True, help="second contender's name")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    for name in ("settings.json", "records.jsonl"):
        if not (args.run / name).is_file():
            print(f"error: run: {args.run} has no {name}; expected a bench run folder", file=sys.stderr)
            return 2
    records, category = load_run(args.run)
    for flag, name in (("--a", args.a), ("--b", args.b)):
        if name not in records:
            print(f"error: {flag}: no contender {name!r} in {args.run}; expected one of: {', '.join(sorted(records))}",
                  file=sys.stderr)
            return 2
    rows = compare(records, category, args.a, args.b)
    print(markdown(rows, args.a, args.b))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
