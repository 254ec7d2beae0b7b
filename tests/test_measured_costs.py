"""One request's policies priced with this machine's measured cost table (``policy.costs``):
``CostModel.from_table`` on a hand-made table, the ``auto`` / ``measured`` / ``profile`` choice of
``cost_aware``, ``post_draft`` and ``learned``, the fallback to the file, and the config error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from adaptivespec import costmodel, runtime
from adaptivespec.config import load_config
from adaptivespec.costmodel import MEASURED_SOURCE, PROFILE_DIR, CostModel, cpu_name
from adaptivespec.errors import ConfigError
from adaptivespec.fastpath.costs import CostTable
from adaptivespec.learned_model import resolve
from adaptivespec.params import structure
from adaptivespec.policies.cost_aware import CostAwareParams, CostAwarePolicy
from adaptivespec.policies.learned import LearnedParams, LearnedPolicy
from adaptivespec.policies.post_draft import PostDraftParams, PostDraftPolicy

ROOT = Path(__file__).resolve().parents[1]
# verify: 10 ms + 0.5 ms a row at 100 keys, 20 + 1.0 at 1100 (lines through rows 1 and 101); draft: 2 ms a row, + 0.5 a row
TABLE = CostTable(rows=(1, 101), verify_short=(10.0, 60.0), verify_long=(20.0, 120.0), contexts=(100, 1100),
                  per_request=0.3, draft_rows=(1, 5), draft=(2.0, 4.0), machine={"cpu": "Test CPU", "target": "t"})
POLICIES = [(CostAwarePolicy, CostAwareParams), (PostDraftPolicy, PostDraftParams)]


def refit(path: Path, out: Path, cpu: str) -> str:
    """``path`` (a shipped fitted file) written to ``out`` as if fitted on ``cpu``."""
    data = json.loads(path.read_text())
    data["machine"] = {**data.get("machine", {}), "cpu": cpu}
    out.write_text(json.dumps(data))
    return str(out)


class Measure:
    def __init__(self, table=TABLE) -> None:
        self.table, self.calls = table, 0

    def __call__(self):
        self.calls += 1
        return self.table


def test_from_table_gives_the_tables_line_at_every_context():
    m = CostModel.from_table(TABLE, topk=4, rows=64, context_ref=300.0)
    # at 0 rows: 9.5 ms at 100 keys, 19 at 1100; per row 0.5 and 1.0; the root's draft forward: 2 ms
    assert m.per_context == pytest.approx(0.0095)
    assert m.per_verified_token_context == pytest.approx(0.0005)
    assert m.per_verified_token == pytest.approx(0.45)
    assert m.fixed == pytest.approx(9.5 - 100 * 0.0095 + 2.0)
    assert m.per_draft_node == pytest.approx(0.5) and m.per_draft_level == pytest.approx(1.5)  # 1.5 + 4 x 0.5 = draft(4)
    assert m.context_ref == 300.0
    for P in (100, 600, 1100):
        for n in (1, 64):
            assert m.step_ms(n, context=P) == pytest.approx(TABLE.verify(n, P) + TABLE.draft_level(1))
    assert m.step_ms(1, levels=2, nodes=8, context=100) == pytest.approx(10.0 + 2.0 + 2 * TABLE.draft_level(4))
    assert m.meta["source"] == MEASURED_SOURCE and m.meta["machine"]["cpu"] == "Test CPU"


def test_from_table_without_a_head_and_with_negative_terms():
    flat = CostTable(rows=(1, 11), verify_short=(10.0, 20.0), verify_long=(10.0, 20.0), contexts=(0, 1000),
                     per_request=0.0, draft_rows=(), draft=())
    m = CostModel.from_table(flat, topk=4, rows=11)
    assert (m.fixed, m.per_verified_token, m.per_context, m.per_draft_level) == pytest.approx((9.0, 1.0, 0.0, 0.0))
    odd = CostTable(rows=(1, 11), verify_short=(10.0, 10.0), verify_long=(10.0, 30.0), contexts=(0, 1000),
                    per_request=0.0, draft_rows=(), draft=())
    m = CostModel.from_table(odd, topk=1, rows=11)  # the slope grows with context more than the 1-row price
    assert m.per_context == 0.0 and m.fixed > 0 and m.per_verified_token_context == pytest.approx(0.002)


@pytest.mark.parametrize("policy,params", POLICIES)
def test_auto_measures_where_the_profile_was_fitted_on_another_cpu(policy, params, tmp_path):
    other = refit(PROFILE_DIR / costmodel.DEFAULT_COST_PROFILE, tmp_path / "p.json", "Some Other CPU 9000")
    pol = policy(params(profile=other))
    measure = Measure()
    pol.bind_costs(measure, "cpu")
    assert measure.calls == 1 and pol.cost.meta["source"] == MEASURED_SOURCE
    assert pol.cost == CostModel.from_table(TABLE, topk=pol.params.topk, rows=max(pol.params.buckets),
                                            context_ref=pol.cost.context_ref)
    assert "policy.profile" not in [o.key for o in pol.fitted_on()]  # no stale-profile warning: the file is unused

    here = refit(PROFILE_DIR / costmodel.DEFAULT_COST_PROFILE, tmp_path / "q.json", cpu_name())
    for kw, device in (({"profile": here}, "cpu"), ({"profile": other, "costs": "profile"}, "cpu"),
                       ({"profile": other}, "cuda")):
        pol, measure = policy(params(**kw)), Measure()
        pol.bind_costs(measure, device)
        assert measure.calls == 0 and pol.cost == CostModel.load(kw["profile"]), (kw, device)
        assert "policy.profile" in [o.key for o in pol.fitted_on()]
    pol = policy(params(profile=here, costs="measured"))
    pol.bind_costs(Measure(), "cpu")
    assert pol.cost.meta["source"] == MEASURED_SOURCE


def test_no_table_keeps_the_profile_said_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(costmodel, "_warned", set())
    other = refit(PROFILE_DIR / costmodel.DEFAULT_COST_PROFILE, tmp_path / "p.json", "Some Other CPU 9000")
    with caplog.at_level(logging.WARNING, logger="adaptivespec.profiles"):
        for _ in range(2):
            pol = CostAwarePolicy(CostAwareParams(profile=other))
            pol.bind_costs(Measure(None), "cpu")
            assert pol.cost == CostModel.load(other)
    lines = [r.getMessage() for r in caplog.records if "measures no cost table" in r.getMessage()]
    assert len(lines) == 1 and "policy.profile (p.json)" in lines[0]


def test_learned_reprices_its_shapes_with_the_table(tmp_path):
    other = refit(resolve(None), tmp_path / "m.json", "Some Other CPU 9000")
    pol = LearnedPolicy(LearnedParams(model=other))
    before = pol.model.step_ms(300).copy()
    pol.bind_costs(Measure(), "cpu")
    shapes = pol.model.shapes
    assert pol.model.cost.meta["source"] == MEASURED_SOURCE and (pol.model.step_ms(300) != before).all()
    assert pol.model.cost.per_draft_level + max(s.topk for s in shapes) * pol.model.cost.per_draft_node == \
        pytest.approx(TABLE.draft_level(max(s.topk for s in shapes)))
    assert [o.timed for o in pol.fitted_on()] == [False]
    here = LearnedPolicy(LearnedParams(model=refit(resolve(None), tmp_path / "h.json", cpu_name())))
    here.bind_costs(Measure(), "cpu")
    assert here.model.cost.meta.get("source") != MEASURED_SOURCE and [o.timed for o in here.fitted_on()] == [True]


def test_a_wrong_costs_value_is_one_line_naming_key_value_and_choices():
    for params in (CostAwareParams, PostDraftParams, LearnedParams):
        with pytest.raises(ConfigError) as err:
            structure(params, {"costs": "fast"}, "f.yaml", "policy")
        assert str(err.value) == "f.yaml: policy.costs: expected one of auto, measured, profile, got 'fast'"
    with pytest.raises(ConfigError, match=r"learned\.yaml: policy\.costs: expected one of auto, measured, profile, got 'fast'$"):
        load_config(ROOT / "configs" / "learned.yaml", ["policy.costs=fast"])


def test_a_runtime_that_cannot_measure_gives_no_table(monkeypatch, caplog):
    """``TorchRuntime.cost_table`` on a target the packed forward cannot run: None, said once, then remembered."""
    monkeypatch.setattr(runtime, "_COST_TABLES", {})
    monkeypatch.delenv("ADAPTIVESPEC_BATCH_COSTS", raising=False)
    monkeypatch.setenv("ADAPTIVESPEC_CACHE", "/nonexistent-adaptivespec-cache")
    rt = object.__new__(runtime.TorchRuntime)
    rt.target, rt.drafter, rt.device, rt.dtype, rt._names = object(), None, "cpu", None, ("no-such-target", "float32")
    with caplog.at_level(logging.WARNING, logger="adaptivespec.costs"):
        assert rt.cost_table() is None and rt.cost_table() is None
    assert sum("no measured cost table for no-such-target" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.model
def test_the_engine_hands_the_runtimes_table_to_the_policy(tmp_path, monkeypatch):
    from adaptivespec.decode import Engine

    path = tmp_path / "table.json"
    path.write_text(json.dumps(TABLE.to_dict()))
    monkeypatch.setenv("ADAPTIVESPEC_BATCH_COSTS", str(path))  # the table load_or_measure reads instead of measuring
    monkeypatch.setattr(runtime, "_COST_TABLES", {})
    other = refit(PROFILE_DIR / costmodel.DEFAULT_COST_PROFILE, tmp_path / "p.json", "Some Other CPU 9000")
    engine = Engine(load_config(ROOT / "configs" / "cost-aware.yaml", ["runtime.dtype=float32", f"policy.profile={other}"]))
    assert engine.policy.cost == CostModel.from_table(TABLE, topk=4, rows=12, context_ref=engine.policy.cost.context_ref)
    assert engine.generate("Say hi.", max_new_tokens=8).stats["new_tokens"] > 0


def test_auto_measures_where_the_files_timings_are_another_runtimes_dtypes_or_isas(tmp_path):
    """Two CPUs with one name (an "AMD EPYC" with AVX-512, one without), float32 where the file timed
    bf16, or llama.cpp where it timed torch: ``costs: auto`` prices with this machine's table."""
    from adaptivespec.costmodel import CostSource, ProfileOrigin, RunningSetup, measured_costs

    data = json.loads((PROFILE_DIR / costmodel.DEFAULT_COST_PROFILE).read_text())
    data["machine"] = {**data["machine"], "cpu": cpu_name(), "isa": "avx512_bf16"}  # this CPU's name, bf16 on torch
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    origin = ProfileOrigin.read("policy.profile", path, timed=True)
    assert (origin.runtime, origin.dtype) == (None, "bfloat16")

    def priced(running):
        return measured_costs("cost_aware", "auto", origin, CostSource(Measure(), running), "cpu", topk=4, rows=12)

    assert priced(RunningSetup("torch", "bfloat16", "avx512_bf16")) is None  # the file's own setup: the file
    assert measured_costs("cost_aware", "auto", origin, Measure(), "cpu", topk=4, rows=12) is None  # no setup said
    for running in (RunningSetup("torch", "float32", "avx512_bf16"), RunningSetup("torch", "bfloat16", "avx2"),
                    RunningSetup("llamacpp", None, "avx512_bf16")):
        assert priced(running) == CostModel.from_table(TABLE, topk=4, rows=12), running
    assert origin.timed_elsewhere(RunningSetup("llamacpp", None, "avx2")) == [
        "runtime torch (running llamacpp)", "ISA avx512_bf16 (running avx2)"]
