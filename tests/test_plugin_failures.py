"""A broken outside plugin is reported, not fatal; a broken built-in one still stops everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from adaptivespec import plugins
from adaptivespec.config import load_config
from adaptivespec.errors import AdaptiveSpecError, ConfigError
from adaptivespec.plugins import make_plugin_host
from adaptivespec.testing import install_plugin

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    """A distribution 'adaptivespec-broken' whose entry point 'broken' raises on import."""
    return install_plugin(tmp_path_factory.mktemp("site"), "adaptivespec-broken", "broken_plugin",
                          "raise RuntimeError('boom at import')\n")


def cli(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("ADAPTIVESPEC_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run([sys.executable, "-m", "adaptivespec.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def test_plugins_lists_the_failed_one_and_warns(broken_site):
    proc = cli(broken_site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["broken"]["failed"] is True and rows["broken"]["provider"] == "adaptivespec-broken"
    assert "RuntimeError: boom at import" in rows["broken"]["error"]
    assert rows["static"]["provider"] == "adaptivespec"  # everything else still loads
    warning = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1
    assert "'broken'" in warning[0] and "'adaptivespec-broken'" in warning[0] and "boom at import" in warning[0]
    table = cli(broken_site, "plugins")
    assert table.returncode == 0
    assert any("broken" in line and "FAILED" in line for line in table.stdout.splitlines())


def test_a_config_naming_a_strategy_nobody_provides_names_the_failed_plugin(broken_site, tmp_path):
    cfg = tmp_path / "needs-broken.yaml"
    cfg.write_text("model: {drafter: embedded}\npolicy: {name: brokens-policy}\nverifier: {name: strict}\n")
    proc = cli(broken_site, "generate", "--config", str(cfg), "--prompt", "hi")
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("adaptivespec: error:") and "Traceback" not in proc.stderr
    assert "unknown policy 'brokens-policy'" in error and "policy.name" in error
    assert "plugins that failed to load: 'broken' from distribution 'adaptivespec-broken'" in error


@pytest.mark.model
def test_other_configs_still_run(broken_site):
    proc = cli(broken_site, "generate", "--config", "configs/eagle3.yaml", "--prompt", "Say hi.", "--max-new-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["stats"]["new_tokens"] == 3
    assert "plugin 'broken'" in proc.stderr


class _Dist:
    def __init__(self, name: str) -> None:
        self.metadata = {"Name": name}


class _BrokenEntryPoint:
    def __init__(self, name: str, dist: str) -> None:
        self.name, self.value, self.dist = name, f"{name}_module", _Dist(dist)

    def load(self):
        raise ImportError("cannot import name 'gone'")


def test_a_broken_builtin_plugin_is_fatal(monkeypatch):
    monkeypatch.setattr(plugins, "_entry_points", lambda: [_BrokenEntryPoint("static", "adaptivespec")])
    with pytest.raises(AdaptiveSpecError, match="plugin 'static' from distribution 'adaptivespec' failed to load"):
        make_plugin_host()


def test_unknown_names_list_the_failed_plugins_in_process(monkeypatch, capsys):
    real = plugins._entry_points()
    monkeypatch.setattr(plugins, "_entry_points", lambda: [*real, _BrokenEntryPoint("extra", "adaptivespec-extra")])
    host = make_plugin_host()
    assert [f.name for f in host.failed] == ["extra"]
    assert "plugin 'extra' from distribution 'adaptivespec-extra' failed to load" in capsys.readouterr().err
    assert "static" in host.policies  # built-ins are all there
    with pytest.raises(ConfigError, match=r"runtime.name: unknown runtime 'gone'.*failed to load: 'extra'"):
        load_config(None, ["runtime.name=gone"], host=host)
    cfg = load_config(ROOT / "configs" / "eagle3.yaml", host=host)
    assert cfg.policy.name == "static"
