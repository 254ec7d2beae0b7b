"""Results by prompt category: speed depends on the kind of prompt, and users pick a method per workload.

Categories (:func:`category_of`):

* ``specbench``: Spec-Bench's six -- ``translation``, ``summarization``, ``qa``,
  ``math_reasoning``, ``rag`` and ``mt_bench`` (its 80 MT-Bench questions, whatever their
  MT-Bench category); a ``--data`` file in Spec-Bench's format keeps any other category it names
  (e.g. ``adaptivespec/analysis/heldout_mix_set.py``'s ``mix:rag``);
* ``mtbench``: MT-Bench's own eight (``writing``, ``roleplay``, ``reasoning``, ``math``,
  ``coding``, ``extraction``, ``stem``, ``humanities``);
* ``math500``: the MATH subject;
* ``longctx``: task and prompt length (``summarize-4k``, ``qa-512``, ...);
* ``structured``: the record's own (``extract-bio``, ``extract-plot``, ``function-call``);
* other sets have none (no per-category table).

:func:`select` implements ``--categories a,b`` and ``--per-category N`` (the first N of each
category in file order, for balanced small runs). The per-category part of ``results.json``
(:func:`adaptivespec.evaluation.report.by_category`) has for each category the same aggregates as
the overall table, on that category's prompts, so ``speedup_vs_ar`` and ``speedup_vs_eagle3``
divide by the baseline's tokens/s *on the same category*; :func:`markdown` is its section of
``results.md``.
"""

from __future__ import annotations

from typing import Any

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.datasets import Problem

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
"""Spec-Bench's six categories, in its own order."""

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
"""MT-Bench's eight categories: Spec-Bench's ``mt_bench`` questions carry these."""

CATEGORY_FIELDS = ("name", "kind", "lossless", "autoregressive", "prompts", "complete", "new_tokens", "wall_seconds",
                   "tokens_per_second", "speedup_vs_ar", "speedup_vs_eagle3", "speedup_vs_reference",
                   "accept_length_mean", "accuracy", "correct", "graded", "retention", "answer_agreement",
                   "accepted_per_step", "prefill_seconds", "decode_tokens_per_second", "decode_speedup_vs_ar")
"""Per-contender fields kept in each category's table (``sweep`` rows keep their swept values too)."""

DEPTHS = 3
"""Drafted-token depths the per-category table shows the reach of (``accepted >= d`` for d = 1..DEPTHS)."""

CATEGORY_PLOT = "category_speedup.png"


def category_of(problem: Problem) -> str | None:
    """The category a problem is reported under (``None``: the dataset has no categories)."""
    if problem.task == "specbench":
        own = problem.category
        return "mt_bench" if own is None or own in MT_BENCH_CATEGORIES else own
    return problem.category  # MT-Bench's, MATH's subject, longctx's; None for sets without


def categories(problems: list[Problem]) -> list[str]:
    """Categories of ``problems`` in order of first appearance (Spec-Bench's in its own order)."""
    seen = list(dict.fromkeys(c for c in map(category_of, problems) if c is not None))
    if all(c in SPEC_BENCH_CATEGORIES for c in seen):
        seen.sort(key=SPEC_BENCH_CATEGORIES.index)
    return seen


def parse_categories(text: str | None) -> list[str] | None:
    """``"qa, rag"`` -> ``["qa", "rag"]``; ``None`` stays ``None``."""
    if text is None:
        return None
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise AdaptiveSpecError(f"--categories: expected a comma-separated list of categories, got {text!r}")
    return list(dict.fromkeys(names))


def select(problems: list[Problem], wanted: list[str] | None = None, per_category: int | None = None,
           dataset: str = "") -> list[Problem]:
    """The problems of the ``wanted`` categories (all when ``None``), at most ``per_category`` of
    each (the first ones in file order), kept in file order."""
    if wanted is None and per_category is None:
        return list(problems)
    known = categories(problems)
    option = "--categories" if wanted is not None else "--per-category"
    if not known:
        name = dataset or (problems[0].task if problems else "?")
        raise AdaptiveSpecError(f"{option}: dataset {name!r} has no categories; "
                                "categories exist for specbench, mtbench, math500 and longctx")
    unknown = [c for c in wanted or () if c not in known]
    if unknown:
        raise AdaptiveSpecError(f"--categories: unknown category {unknown[0]!r} for {dataset or 'this dataset'}; "
                                f"expected some of: {', '.join(known)}")
    keep = set(wanted or known)
    taken: dict[str, int] = {}
    out = []
    for p in problems:
        c = category_of(p)
        if c not in keep or (per_category is not None and taken.get(c, 0) >= per_category):
            continue
        taken[c] = taken.get(c, 0) + 1
        out.append(p)
    return out


def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    """A table cell: ``value`` formatted with ``spec`` and ``suffix``, or a dash for None."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _reach_cell(accepted_per_step: dict[str, Any] | None) -> str:
    shares = reach(accepted_per_step)
    return "–" if shares is None else " / ".join(f"{x:.2f}" for x in shares)


def reach(accepted_per_step: dict[str, Any] | None, depths: int = DEPTHS) -> list[float] | None:
    """Share of speculative steps that accepted at least d drafted tokens, d = 1..depths (None: no steps).

    tau - 1 is the sum of these shares over every depth, so the list shows where a tree loses its tokens."""
    if not accepted_per_step or not accepted_per_step.get("steps"):
        return None
    n, hist = accepted_per_step["steps"], accepted_per_step["histogram"]
    return [sum(v for k, v in hist.items() if int(k) >= d) / n for d in range(1, depths + 1)]


def markdown(results: dict[str, Any]) -> str:
    """The per-category section of ``results.md``: a speedup-vs-AR overview (contenders x
    categories, τ in brackets), then one table per category (empty string without categories)."""
    cats: dict[str, Any] = results.get("categories") or {}
    if not cats:
        return ""
    names = [r["name"] for r in results["configs"]]
    key, base = ("speedup_vs_ar", "AR") if results.get("ar") else ("speedup_vs_reference", f"`{results.get('reference')}`")
    lines = ["", "## By category", "",
             f"Speedup vs {base} (tokens/s ratio on that category's prompts), accept length τ in brackets; "
             "prompts per category: " + ", ".join(f"{c} {v['prompts']}" for c, v in cats.items()) + ".", "",
             "| config | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for name in names:
        cells = []
        for c in cats.values():
            r = next((x for x in c["configs"] if x["name"] == name), None)
            if r is None or not r["prompts"]:
                cells.append("–")
                continue
            tau = "" if r["accept_length_mean"] is None else f" ({r['accept_length_mean']:.2f})"
            cells.append(format_value(r[key], ".2f", "×") + tau + ("" if r["complete"] else "*"))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    if any(r["prompts"] and not r["complete"] for c in cats.values() for r in c["configs"]):
        lines += ["", "\\* incomplete: the contender has not run every prompt of that category."]
    graded = any(r["graded"] for c in cats.values() for r in c["configs"])
    decode = any(r.get("decode_speedup_vs_ar") is not None for c in cats.values() for r in c["configs"])
    head = ["category", "config", "prompts", "tok/s", "speedup vs AR", *(["decode speedup vs AR"] if decode else []),
            "speedup vs EAGLE-3", "accept length τ",
            "steps accepting ≥" + "/≥".join(map(str, range(1, DEPTHS + 1))), *(["accuracy"] if graded else [])]
    lines += ["", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for cat, c in cats.items():
        for r in c["configs"]:
            acc = ("–" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}% ({r['correct']}/{r['graded']})")
            cells = [cat, f"`{r['name']}`", f"{r['prompts']}/{c['prompts']}", format_value(r["tokens_per_second"], ".2f"),
                     format_value(r["speedup_vs_ar"], ".2f", "×"),
                     *([format_value(r.get("decode_speedup_vs_ar"), ".2f", "×")] if decode else []),
                     format_value(r["speedup_vs_eagle3"], ".2f", "×"),
                     format_value(r["accept_length_mean"], ".2f"), _reach_cell(r.get("accepted_per_step")), *([acc] if graded else [])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
