"""The worker's speculation metrics: the series written per step, read back as Prometheus text."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client comes with sglang (scripts/install_sglang_cpu.sh)")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from adaptivespec.sglang.metrics import SpecMetrics, parse_metrics, shape_label  # noqa: E402
from adaptivespec.types import TreeShape  # noqa: E402


@pytest.fixture
def metrics():
    registry = CollectorRegistry()
    return SpecMetrics(registry), registry


def read(registry) -> dict[str, float]:
    return parse_metrics(generate_latest(registry).decode())


def test_every_series_is_exported_before_traffic(metrics):
    _, registry = metrics
    series = read(registry)
    assert series['adaptivespec_accepted_tokens_total{source="head"}'] == 0.0
    assert series['adaptivespec_undrafted_steps_total{reason="load"}'] == 0.0
    assert series['adaptivespec_undrafted_steps_total{reason="policy"}'] == 0.0
    assert series["adaptivespec_draft_extend_skipped_steps_total"] == 0.0
    assert series["adaptivespec_prefill_draft_extend_skipped_batches_total"] == 0.0
    assert series["adaptivespec_accepted_tokens_per_step_count"] == 0.0


def test_a_step_counts_its_shape_rows_accepted_tokens_and_load_choice(metrics):
    m, registry = metrics
    big, small = TreeShape(3, 4, 8), TreeShape(1, 1, 2)
    m.observe_step(shape=big, accepted_per_request=[2])
    m.observe_step(shape=small, accepted_per_request=[0, 1, 3], policy_shape=big)  # the load model shrank it
    s = read(registry)
    assert s['adaptivespec_steps_total{shape="3,4,8"}'] == 1 and s['adaptivespec_steps_total{shape="1,1,2"}'] == 1
    assert s["adaptivespec_accepted_tokens_per_step_count"] == 4 and s["adaptivespec_accepted_tokens_per_step_sum"] == 6
    assert s['adaptivespec_accepted_tokens_per_step_bucket{le="0.0"}'] == 1
    assert s['adaptivespec_accepted_tokens_total{source="head"}'] == 6
    assert s["adaptivespec_verify_rows_per_step_sum"] == 8 + 3 * 2
    assert s['adaptivespec_load_choice_draft_tokens{batch_size="1"}'] == 8
    assert s['adaptivespec_load_choice_draft_tokens{batch_size="3"}'] == 2
    assert s['adaptivespec_load_capped_steps_total{batch_size="3"}'] == 1
    assert 'adaptivespec_load_capped_steps_total{batch_size="1"}' not in s


def test_sources_undrafted_steps_and_state(metrics):
    m, registry = metrics
    m.observe_step(shape=TreeShape(3, 4, 8), accepted_per_request=[4], accepted_by_source={"head": 1, "retrieval": 3})
    m.observe_undrafted("load")
    m.observe_undrafted("load", extend_skipped=True, rows=8)
    m.observe_state(pending=1, tracked=8)
    with pytest.raises(ValueError, match="undrafted reason: expected one of load, policy, got 'tired'"):
        m.observe_undrafted("tired")
    s = read(registry)
    assert s['adaptivespec_accepted_tokens_total{source="retrieval"}'] == 3
    assert s['adaptivespec_accepted_tokens_total{source="head"}'] == 1
    assert s['adaptivespec_undrafted_steps_total{reason="load"}'] == 2
    assert s["adaptivespec_draft_extend_skipped_steps_total"] == 1
    assert s["adaptivespec_verify_rows_per_step_count"] == 2 and s["adaptivespec_verify_rows_per_step_sum"] == 8 + 8
    assert s["adaptivespec_controller_pending_steps"] == 1 and s["adaptivespec_controller_tracked_requests"] == 8


def test_an_empty_step_records_nothing(metrics):
    m, registry = metrics
    m.observe_step(shape=TreeShape(3, 4, 8), accepted_per_request=[])
    assert read(registry)["adaptivespec_verify_rows_per_step_count"] == 0


def test_metrics_follow_sglangs_switch(tmp_path):
    assert SpecMetrics.from_env({}) is None  # SGLang's metrics off: no multiprocess folder
    assert SpecMetrics.from_env({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "ADAPTIVESPEC_SGLANG_METRICS": "0"}) is None


def test_shape_labels_and_parsing():
    assert shape_label(TreeShape(6, 4, 12)) == "6,4,12"
    text = "# HELP x\nadaptivespec_a_total 3.0\nsglang_b 1\nadaptivespec_c{le=\"+Inf\"} 2\nadaptivespec_bad x\n"
    assert parse_metrics(text) == {"adaptivespec_a_total": 3.0, 'adaptivespec_c{le="+Inf"}': 2.0}


def test_the_controller_counts_prefills_that_skip_the_heads_draft_extend(metrics):
    import torch

    from adaptivespec.costmodel import CostModel
    from adaptivespec.policies.static import StaticParams, StaticPolicy
    from adaptivespec.sglang.controller import TripletController
    from adaptivespec.sglang.load_model import LoadModel
    from adaptivespec.sglang.shapes import NO_DRAFT

    m, registry = metrics
    c = TripletController(StaticPolicy(StaticParams(nsteps=3, topk=4, ndt=8)), undrafted=True, metrics=m,
                          load=LoadModel(CostModel(fixed=20.0, per_verified_token=4.0)))
    c.begin_step(torch.full((1, 4), 0.2))
    c.observe([0])
    assert c.begin_step(torch.full((8, 4), 0.2)) is NO_DRAFT and c.skip_draft_extend
    assert c.skip_prefill_extend(9) and not c.skip_prefill_extend(1)
    assert read(registry)["adaptivespec_prefill_draft_extend_skipped_batches_total"] == 1
