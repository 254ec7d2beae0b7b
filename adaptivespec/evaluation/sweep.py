"""``adaptivespec sweep``: one config over the values of a numeric parameter, as one ``bench`` run.

Every value of ``--param KEY=V1,V2,...`` becomes a ``--set KEY=V`` on the swept config (several
``--param`` make a grid); the points are named ``<stem>[KEY=V]``. A lossless *reference* runs in
the same interleaved run and is the base of retention (and of ``speedup_vs_ar`` when it is the
autoregressive config): ``--reference FILE``, or by default the swept config itself with
``verifier: strict`` (named ``<stem>-strict``), which isolates what the swept parameter costs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml

from adaptivespec.config import apply_override, build_config, read_yaml
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.evaluation.spec import Entry, config_lossless, load_bench_config


def parse_param(text: str) -> tuple[str, list[tuple[str, float | int]]]:
    """``"verifier.kappa=0.1,0.2"`` -> ``("verifier.kappa", [("0.1", 0.1), ("0.2", 0.2)])``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise AdaptiveSpecError(f"--param: expected KEY=V1,V2,... with a dotted key such as verifier.kappa=0.1,0.2, got {text!r}")
    values = []
    for token in (t.strip() for t in raw.split(",")):
        try:
            value = yaml.safe_load(token) if token else None
        except yaml.YAMLError:
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AdaptiveSpecError(f"--param {key}: expected a comma-separated list of numbers, got {token!r} in {raw!r}")
        values.append((token, value))
    if len({v for _, v in values}) != len(values):
        raise AdaptiveSpecError(f"--param {key}: a value is listed twice in {raw!r}")
    return key, values


def sweep_entries(config: str, params: list[str], overrides: list[str], *, skip_invalid: bool = False
                  ) -> tuple[list[Entry], dict[str, list], list[dict[str, str]]]:
    """One :class:`Entry` per point of the grid of ``params`` (each validated as a config).

    With ``skip_invalid``, grid points whose config is invalid (coupled parameters, e.g. a tree
    shape whose ``ndt`` exceeds what ``nsteps`` x ``topk`` can draft) are left out and returned as
    ``{"point": name, "error": message}``; otherwise the first invalid point raises.
    """
    parsed = [parse_param(p) for p in params]
    keys = [k for k, _ in parsed]
    if len(set(keys)) != len(keys):
        raise AdaptiveSpecError(f"--param: a key is swept twice ({', '.join(keys)})")
    stem = Path(config).stem
    entries, skipped = [], []
    for point in itertools.product(*(values for _, values in parsed)):
        sets = [f"{k}={text}" for k, (text, _) in zip(keys, point)]
        name = f"{stem}[{','.join(sets)}]"
        try:
            cfg = load_bench_config(config, [*overrides, *sets])
        except AdaptiveSpecError as exc:
            if not skip_invalid:
                raise
            skipped.append({"point": name, "error": str(exc)})
            continue
        entries.append(Entry(name=name, config=cfg, sweep={k: v for k, (_, v) in zip(keys, point)}))
    if not entries:
        raise AdaptiveSpecError(f"--param: no valid point in the grid of {', '.join(keys)} ({len(skipped)} invalid); "
                                f"first error: {skipped[0]['error'] if skipped else 'none'}")
    return entries, {k: [v for _, v in values] for k, values in parsed}, skipped


def reference_entry(config: str, reference: str | None, overrides: list[str]) -> Entry:
    """The lossless reference: ``reference`` (checked lossless) or ``config`` with ``verifier: strict``."""
    if reference is not None:
        cfg = load_bench_config(reference, overrides)
        if not config_lossless(cfg):
            raise AdaptiveSpecError(f"--reference: {reference} is lossy (verifier {cfg.verifier.name!r}); expected a lossless config such as configs/eagle3.yaml or configs/ar.yaml")
        return Entry(name=Path(reference).stem, config=cfg)
    data: dict[str, Any] = read_yaml(config)
    data["verifier"] = {"name": "strict"}
    for text in overrides:
        if not text.strip().startswith("verifier."):  # the reference's verifier is fixed
            apply_override(data, text)
    return Entry(name=f"{Path(config).stem}-strict", config=build_config(data, f"{config} (verifier: strict)"))
