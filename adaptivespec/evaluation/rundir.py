"""A run folder: ``settings.json`` (what its records were made with) and ``records.jsonl`` (one
:class:`~adaptivespec.evaluation.records.RunRecord` a line, appended as the run goes).

A rerun of the same command resumes the folder; one with other settings is refused, naming what
differs. A last line cut short by a kill is dropped (and removed before appending).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.datasets import Problem
from adaptivespec.evaluation.records import RunRecord
from adaptivespec.evaluation.spec import BenchSpec

SETTINGS, RECORDS = "settings.json", "records.jsonl"


def settings_of(spec: BenchSpec, problems: list[Problem]) -> dict[str, Any]:
    """What a run directory's records were made with (compared on resume)."""
    return json.loads(json.dumps({
        "command": spec.command,
        "dataset": spec.dataset,
        "data": str(Path(spec.data).resolve()) if spec.data else None,
        "limit": spec.limit,
        "max_new_tokens": spec.max_new_tokens,
        "configs": {e.name: e.config.to_dict() for e in spec.entries},
        "peers": list(spec.peers),
        **({"backend": spec.backend} if spec.backend != "torch" else {}),
        **({"served": [e.name for e in spec.entries if e.served]} if any(e.served for e in spec.entries) else {}),
        "reference": spec.reference,
        "problems": [p.id for p in problems],
    }, default=str))


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every differing leaf; a level's own values before nested ones."""
    diffs = []
    keys = sorted(set(old) | set(new), key=lambda k: (isinstance(old.get(k), dict) or isinstance(new.get(k), dict), str(k)))
    for key in keys:
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            show = (lambda v: f"{len(v)} items" if isinstance(v, list) and len(v) > 4 else json.dumps(v))
            diffs.append(f"{prefix}{key}: {show(a)} -> {show(b)}")
    return diffs


def open_run_dir(out: Path, settings: dict[str, Any]) -> None:
    """Create ``out`` with its settings, or check an existing one was made with the same settings."""
    if out.exists() and not out.is_dir():
        raise AdaptiveSpecError(f"--out: {out} exists and is not a folder")
    path = out / SETTINGS
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise AdaptiveSpecError(f"--out: {path} is not valid JSON; delete the folder or use another --out") from None
        diffs = _differences(old, settings)
        if diffs:
            more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
            raise AdaptiveSpecError(
                f"--out: {out} holds a run made with different settings ({'; '.join(diffs[:3])}{more}); "
                "rerun with the same arguments to resume it, or choose another --out"
            )
        return
    if out.is_dir() and (out / RECORDS).is_file():
        raise AdaptiveSpecError(f"--out: {out} has {RECORDS} but no {SETTINGS}; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def read_records(out: Path, repair: bool = False) -> list[RunRecord]:
    """Records of ``out/records.jsonl``; a last line cut short by a kill is dropped (and, with
    ``repair``, removed from the file so appending continues cleanly)."""
    path = out / RECORDS
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(RunRecord.from_json(json.loads(line)))
        except json.JSONDecodeError:
            last = all(not rest.strip() for rest in lines[n:])
            if not last:
                raise AdaptiveSpecError(f"{path}:{n}: invalid JSON; delete that line (or the folder) and rerun") from None
            if repair:
                path.write_text("\n".join(lines[: n - 1]) + ("\n" if n > 1 else ""))
            break
    else:
        if repair and text and not text.endswith("\n"):
            path.write_text(text + "\n")
    return records
