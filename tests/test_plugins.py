"""Plugins: an outside distribution's entry point appears in `adaptivespec plugins` and works from YAML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import adaptivespec
from adaptivespec.errors import AdaptiveSpecError
from adaptivespec.plugins import BUILTIN_PLUGINS, make_plugin_host
from adaptivespec.strategies import TreePolicy
from adaptivespec.testing import install_plugin

ROOT = Path(__file__).resolve().parents[1]

PLUGIN_SOURCE = '''
import adaptivespec
from adaptivespec.api import TreePolicy, TreeShape


class ShortChain(TreePolicy):
    """A 3-token chain (test plugin)."""

    name = "short-chain"

    def shapes(self):
        return (TreeShape(3, 1, 4),)

    def next_shape(self, signals):
        return TreeShape(3, 1, 4)


@adaptivespec.hookimpl
def adaptivespec_register_policies(registry):
    registry.register(ShortChain)
'''


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """A distribution installed into a site folder: module + dist-info with an entry point."""
    return install_plugin(tmp_path_factory.mktemp("site"), "adaptivespec-shortchain", "shortchain_plugin", PLUGIN_SOURCE,
                          entry="short-chain")


def cli(site: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "adaptivespec.cli", *argv], capture_output=True, text=True, env=environ, timeout=300)


def test_entry_point_plugin_is_listed_with_its_distribution(installed_plugin):
    proc = cli(installed_plugin, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["short-chain"]["provider"] == "adaptivespec-shortchain"
    assert rows["short-chain"]["kind"] == "policy" and rows["short-chain"]["lossless"] is True
    assert rows["static"]["provider"] == "adaptivespec"


def test_autoload_can_be_disabled_and_plugins_named(installed_plugin):
    off = cli(installed_plugin, "plugins", "--json", env={"ADAPTIVESPEC_DISABLE_PLUGIN_AUTOLOAD": "1"})
    names = {r["name"] for r in json.loads(off.stdout)}
    assert "short-chain" not in names and "static" in names  # built-ins still load
    named = cli(installed_plugin, "plugins", "--json", env={"ADAPTIVESPEC_DISABLE_PLUGIN_AUTOLOAD": "1", "ADAPTIVESPEC_PLUGINS": "short-chain"})
    assert "short-chain" in {r["name"] for r in json.loads(named.stdout)}


@pytest.mark.model
def test_entry_point_plugin_is_usable_from_yaml(installed_plugin, random_head_dir, tmp_path):
    cfg = tmp_path / "plugin.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{target: smollm2-135m-instruct, drafter: {random_head_dir}}}
        runtime: {{dtype: float32}}
        policy: {{name: short-chain}}
        verifier: {{name: strict}}
    """))
    proc = cli(installed_plugin, "generate", "--config", str(cfg), "--prompt", "Say hi.", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) == 6


def test_duplicate_names_are_refused():
    class Dup(TreePolicy):
        name = "static"

    class Plugin:
        @staticmethod
        @adaptivespec.hookimpl
        def adaptivespec_register_policies(registry):
            registry.register(Dup)

    with pytest.raises(AdaptiveSpecError, match="policy 'static' is registered twice: by adaptivespec and by"):
        make_plugin_host([Plugin])


def test_misspelled_hook_fails_at_start_up():
    class Typo:
        @staticmethod
        @adaptivespec.hookimpl
        def adaptivespec_register_polices(registry):  # sic
            pass

    with pytest.raises(AdaptiveSpecError, match="unknown hook"):
        make_plugin_host([Typo])


def test_builtin_list_matches_pyproject_entry_points():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["adaptivespec"]
    assert eps == BUILTIN_PLUGINS


def test_every_hook_is_documented():
    from adaptivespec import hookspecs

    for name in dir(hookspecs):
        if name.startswith("adaptivespec_"):
            doc = getattr(hookspecs, name).__doc__ or ""
            assert ":param" in doc and len(doc.strip().splitlines()) >= 3, name
