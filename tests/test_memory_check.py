"""The memory check's trend and plot (the generations themselves run in docs/speed.md's measurement)."""

from __future__ import annotations

import os

import pytest

from adaptivespec.analysis import memory_check
from adaptivespec.analysis.memory_check import figure, rss_mib, slope, slope_stderr


def test_slope_separates_a_leak_from_noise():
    assert slope([100.0 + 2.5 * i for i in range(20)]) == pytest.approx(2.5)
    noise = [100.0, 140.0, 95.0, 138.0, 138.0, 101.0, 141.0, 99.0]  # large jumps, no trend
    assert abs(slope(noise)) < 1.0 and max(b - a for a, b in zip(noise, noise[1:])) > 30
    assert slope([5.0]) == 0.0
    # the error says how much of a slope noise alone explains: none of a clean line, most of the noise's
    assert slope_stderr([100.0 + 2.5 * i for i in range(20)]) == pytest.approx(0.0, abs=1e-9)
    assert slope_stderr(noise) > abs(slope(noise))


def test_rss_reads_this_process_and_another_by_pid():
    mine = rss_mib()
    assert 10 < mine < 64 * 1024
    assert rss_mib("VmHWM") >= mine
    assert rss_mib(pid=os.getpid()) == pytest.approx(mine, rel=0.5)
    with pytest.raises(RuntimeError, match="no VmNothing"):
        rss_mib("VmNothing")


def test_plot_draws_one_line_per_config_with_its_trend(tmp_path):
    series = {"ar": [1000.0, 1001.0, 1000.5], "hybrid": [1500.0, 1520.0, 1490.0, 1530.0]}
    rows = [{"config": f"configs/{n}.yaml", "rss_series_mib": ys, "slope_mib_per_repeat": slope(ys),
             "new_tokens": 256, "peak_tokens": 1024, "prompt_tokens": 4100} for n, ys in series.items()]
    (ax,) = figure(rows).axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["ar (+0.2 MiB/gen)", "hybrid (+6.0 MiB/gen)"]
    for name, ys in series.items():
        line = next(v for k, v in lines.items() if k.startswith(name + " "))
        assert list(line.get_xdata()) == list(range(1, len(ys) + 1)) and list(line.get_ydata()) == ys
    assert "256 new tokens" in ax.get_xlabel() and "4100-token prompt" in ax.get_title()
    memory_check.plot(rows, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000
