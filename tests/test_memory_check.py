"""``scripts/memory_check.py``'s trend and plot (the generations themselves run in docs/speed.md's measurement)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from test_bench import assert_png

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "memory_check.py"


@pytest.fixture(scope="module")
def memory_check():
    spec = importlib.util.spec_from_file_location("memory_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slope_separates_a_leak_from_noise(memory_check):
    assert memory_check.slope([100.0 + 2.5 * i for i in range(20)]) == pytest.approx(2.5)
    noise = [100.0, 140.0, 95.0, 138.0, 138.0, 101.0, 141.0, 99.0]  # large jumps, no trend
    assert abs(memory_check.slope(noise)) < 1.0 and max(b - a for a, b in zip(noise, noise[1:])) > 30
    assert memory_check.slope([5.0]) == 0.0
    # the error says how much of a slope noise alone explains: none of a clean line, most of the noise's
    assert memory_check.slope_stderr([100.0 + 2.5 * i for i in range(20)]) == pytest.approx(0.0, abs=1e-9)
    assert memory_check.slope_stderr(noise) > abs(memory_check.slope(noise))


def test_plot_writes_a_png(memory_check, tmp_path):
    rows = [{"config": f"configs/{n}.yaml", "rss_series_mib": ys, "slope_mib_per_repeat": memory_check.slope(ys),
             "new_tokens": 256, "peak_tokens": 1024, "prompt_tokens": 4100}
            for n, ys in (("ar", [1000.0, 1001.0, 1000.5]), ("hybrid", [1500.0, 1520.0, 1490.0]))]
    memory_check.plot(rows, tmp_path / "memory.png")
    assert_png(tmp_path / "memory.png")
