"""Policy ``dcs``: the score, the shape table, the EMA and the circuit breaker (no model)."""

from __future__ import annotations

import math

import attrs
import pytest

from adaptivespec.params import structure
from adaptivespec.errors import ConfigError
from adaptivespec.plugins import Registry
from adaptivespec.policies import dcs
from adaptivespec.policies.dcs import DcsParams, DcsPolicy
from adaptivespec.types import StepRecord, StepSignals, TreeShape

WIDE, MIDDLE, DEEP = TreeShape(3, 4, 4), TreeShape(5, 3, 6), TreeShape(7, 1, 8)
GRID = [i / 20 for i in range(21)]
EMAS = [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 2.9, 3.0, 3.1, 4.0, 7.0, 50.0]


def signals(p1: float, step: int = 1) -> StepSignals:
    return StepSignals(step=step, draft_top1_prob=p1, last_accepted=-1)


def record(accepted: int, shape: TreeShape | None = MIDDLE) -> StepRecord:
    return StepRecord(
        step=0, shape=shape, tree_size=1 if shape is None else shape.ndt, accepted=accepted, promoted=0,
        new_tokens=accepted + 1, draft_ms=0.0, verify_ms=0.0, other_ms=0.0,
    )


def run(policy: DcsPolicy, p1: float, accepted: int) -> TreeShape:
    """One step: choose, then observe."""
    shape = policy.next_shape(signals(p1))
    policy.observe(record(accepted, shape))
    return shape


# -- the score ------------------------------------------------------------------------------------
def test_score_in_unit_interval_and_weighted_sum():
    pol = DcsPolicy()
    for p1 in GRID + [-0.5, 1.5, math.nan, math.inf]:
        for ema in EMAS:
            assert 0.0 <= pol.score(p1, ema) <= 1.0
    assert pol.score(0.8, 1.5) == pytest.approx(0.5 * 0.8 + 0.5 * 1.5 / 3.0)
    w = DcsPolicy(DcsParams(weight=0.2, d=4.0))
    assert w.score(0.8, 1.0) == pytest.approx(0.2 * 0.8 + 0.8 * 0.25)
    assert pol.score(math.nan, 0.0) == 0.0 and pol.score(2.0, 0.0) == 0.5


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.5, 1.0])
def test_score_and_shape_monotone_in_each_signal(weight):
    pol = DcsPolicy(DcsParams(weight=weight))
    depth = lambda s: (s.nsteps, -s.topk)  # noqa: E731 - deeper and narrower = "more confident"
    for ema in EMAS:
        scores = [pol.score(p1, ema) for p1 in GRID]
        assert scores == sorted(scores)
        shapes = [depth(pol.shape_for(s)) for s in scores]
        assert shapes == sorted(shapes)
    for p1 in GRID:
        scores = [pol.score(p1, ema) for ema in EMAS]
        assert scores == sorted(scores)


def test_history_term_saturates_at_d():
    pol = DcsPolicy(DcsParams(d=2.5))
    for p1 in (0.0, 0.4, 1.0):
        at_d = pol.score(p1, 2.5)
        assert all(pol.score(p1, ema) == at_d for ema in (2.5, 2.6, 4.0, 100.0))
        assert pol.score(p1, 2.4) < at_d
        assert at_d == pytest.approx(0.5 * p1 + 0.5)


# -- the shape table ------------------------------------------------------------------------------
def test_default_table_and_endpoints():
    pol = DcsPolicy()
    assert pol.shapes() == (WIDE, TreeShape(4, 3, 5), MIDDLE, TreeShape(6, 2, 7), DEEP)
    assert pol.shape_for(0.0) == WIDE and pol.shape_for(1.0) == DEEP
    assert pol.score(0.0, 0.0) == 0.0 and pol.score(1.0, 3.0) == 1.0
    assert pol.shape_for(0.19) == WIDE and pol.shape_for(0.2) == TreeShape(4, 3, 5)
    assert pol.shape_for(0.79) == TreeShape(6, 2, 7) and pol.shape_for(0.8) == DEEP


def test_endpoints_reached_through_next_shape():
    pol = DcsPolicy(DcsParams(alpha=1.0))  # EMA = last step's accepted
    run(pol, 0.5, 0)  # the forced first step
    assert run(pol, 0.0, 10) == WIDE  # EMA still 0 when this shape is chosen
    assert run(pol, 1.0, 0) == DEEP  # EMA 10 >= d
    assert pol.state()["dcs"] == 1.0


def test_shapes_sorted_unique_and_cover_next_shape_over_a_grid():
    for params in (DcsParams(), DcsParams(levels=2), DcsParams(levels=9, weight=0.8, d=1.5),
                   DcsParams(wide=(2, 6, 12), deep=(9, 2, 16), levels=7, start="wide")):
        pol = DcsPolicy(params)
        table = pol.shapes()
        assert list(table) == sorted(set(table))
        assert TreeShape(*params.wide) in table and TreeShape(*params.deep) in table
        assert pol.start_shape in table
        seen = set()
        for accepted in (0, 1, 2, 4, 8):
            for repeats in (1, 3, 10):
                for p1 in GRID:
                    pol.reset()
                    seen.add(pol.next_shape(signals(p1)))
                    for _ in range(repeats):
                        pol.observe(record(accepted))
                    seen.add(pol.next_shape(signals(p1)))
        assert seen <= set(table)
        assert seen == set(table)  # and every prepared shape is reachable


def test_levels_two_gives_only_the_ends():
    assert DcsPolicy(DcsParams(levels=2)).shapes() == (WIDE, DEEP)


def test_ndt_is_clamped_to_what_the_interpolated_tree_can_hold():
    pol = DcsPolicy(DcsParams(wide=(4, 2, 11), deep=(5, 1, 6)))
    # at 3/4: nsteps 4.75 -> 5, topk 1.25 -> 1, ndt 7.25 -> 7 > 5 + 1: clamped to a chain of 5
    assert pol.interpolate(0.75) == TreeShape(5, 1, 6)
    assert all(s.ndt - 1 <= s.max_nodes for s in pol.shapes())


def test_rounding_is_half_up():
    pol = DcsPolicy()
    assert pol.interpolate(0.5) == TreeShape(5, 3, 6)  # topk 2.5 -> 3


# -- per-sequence state ---------------------------------------------------------------------------
@pytest.mark.parametrize(("start", "shape"), [("wide", WIDE), ("middle", MIDDLE), ("deep", DEEP)])
def test_first_step_uses_start_shape_and_history_starts_at_its_level(start, shape):
    pol = DcsPolicy(DcsParams(start=start))
    assert pol.next_shape(signals(1.0, step=0)) == shape
    state = pol.state()
    assert state["dcs"] is None and state["breaker_tripped"] is False
    assert state["ema_accept"] == dcs.START_LEVEL[start] * 3.0


def test_ema_update_with_alpha():
    pol = DcsPolicy()
    ema = 1.5  # middle start: d / 2
    pol.next_shape(signals(0.5))
    for a in (3, 1, 4, 1, 5):
        pol.observe(record(a))
        ema = 0.3 * a + 0.7 * ema
        pol.next_shape(signals(0.5))
        assert pol.state()["ema_accept"] == pytest.approx(ema)
        assert pol.state()["dcs"] == pytest.approx(0.25 + 0.5 * min(ema / 3.0, 1.0))


def test_autoregressive_records_are_ignored():
    pol = DcsPolicy()
    pol.next_shape(signals(0.5))
    for _ in range(7):  # not a multiple of breaker_steps
        pol.observe(record(0, shape=None))
    pol.next_shape(signals(0.5))
    assert pol.state()["ema_accept"] == 1.5 and pol.state()["zero_streak"] == 0


def test_state_keys_and_values():
    pol = DcsPolicy()
    pol.next_shape(signals(0.9))
    pol.observe(record(2))
    pol.next_shape(signals(0.9))
    st = pol.state()
    assert set(st) == {"dcs", "draft_top1_prob", "ema_accept", "breaker_tripped", "zero_streak"}
    assert st["draft_top1_prob"] == 0.9 and st["breaker_tripped"] is False and st["zero_streak"] == 0
    assert st["dcs"] == pytest.approx(0.5 * 0.9 + 0.5 * (0.3 * 2 + 0.7 * 1.5) / 3.0)


# -- circuit breaker ------------------------------------------------------------------------------
def test_breaker_trips_after_exactly_breaker_steps_zero_accepts():
    pol = DcsPolicy()  # start = middle; p1 = 0 with a falling EMA picks the wide end
    run(pol, 0.0, 0)  # forced first step: zero streak 1
    for streak in (2, 3, 4):
        assert run(pol, 0.0, 0) == WIDE
        assert pol.state()["zero_streak"] == streak - 1 and not pol.state()["breaker_tripped"]
    pol.observe(record(0))  # the fifth zero-accept step (observed without a new decision)
    shape = pol.next_shape(signals(0.0))
    assert shape == MIDDLE
    st = pol.state()
    assert st["breaker_tripped"] is True and st["dcs"] is None and st["zero_streak"] == 0
    assert st["ema_accept"] == 1.5  # history back to its initial value
    pol.observe(record(0))
    assert pol.next_shape(signals(0.0)) == pol.shape_for(pol.score(0.0, 0.7 * 1.5)) == WIDE  # DCS again
    assert pol.state()["breaker_tripped"] is False


@pytest.mark.parametrize("steps", [1, 3, 5, 8])
def test_breaker_steps_parameter(steps):
    pol = DcsPolicy(DcsParams(breaker_steps=steps, start="deep"))
    pol.next_shape(signals(0.0))
    for i in range(steps):
        pol.observe(record(0))
        tripped = pol.next_shape(signals(0.0)) == DEEP and pol.state()["breaker_tripped"]
        assert tripped == (i == steps - 1)


def test_nonzero_accept_resets_the_streak():
    pol = DcsPolicy()
    pol.next_shape(signals(0.0))
    for accepted in [0, 0, 0, 0, 1, 0, 0, 0, 0]:
        pol.observe(record(accepted))
        pol.next_shape(signals(0.0))
        assert not pol.state()["breaker_tripped"]
    assert pol.state()["zero_streak"] == 4
    pol.observe(record(0))
    pol.next_shape(signals(0.0))
    assert pol.state()["breaker_tripped"]


def test_reset_restores_per_sequence_state():
    pol = DcsPolicy()
    fresh = (pol.next_shape(signals(0.7)), pol.state())
    for a in (0, 0, 0, 4, 0, 0):
        pol.observe(record(a))
        pol.next_shape(signals(0.1))
    pol.reset()
    assert (pol.next_shape(signals(0.7)), pol.state()) == fresh


def test_next_shape_returns_the_prepared_objects():
    # no per-step construction: every returned shape is one of the precomputed table entries
    pol = DcsPolicy()
    ids = {id(s) for s in pol.shapes()}
    for p1 in GRID:
        for a in (0, 1, 2, 3, 5):
            assert id(run(pol, p1, a)) in ids


# -- parameters and registration --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"alpha": 0}, "policy.alpha: expected a number in (0, 1], got 0"),
        ({"alpha": 1.5}, "policy.alpha: expected a number in (0, 1], got 1.5"),
        ({"d": 0}, "policy.d: expected a number in (0, inf), got 0"),
        ({"weight": -0.1}, "policy.weight: expected a number in [0, 1], got -0.1"),
        ({"levels": 1}, "policy.levels: expected an integer >= 2, got 1"),
        ({"breaker_steps": 0}, "policy.breaker_steps: expected an integer >= 1, got 0"),
        ({"start": "narrow"}, "policy.start: expected one of wide, middle, deep, got 'narrow'"),
        ({"wide": [3, 4]}, "policy.wide: expected [nsteps, topk, ndt] (three integers), got [3, 4]"),
        ({"deep": [7, 1, 9]}, "policy.deep: expected a valid tree shape [nsteps, topk, ndt], got [7, 1, 9]: "
                              "ndt - 1 = 8 drafted nodes cannot be kept from a tree of nsteps=7, topk=1 "
                              "(at most 7 candidates)"),
        ({"wide": [0, 4, 4]}, "policy.wide: expected a valid tree shape [nsteps, topk, ndt], got [0, 4, 4]: "
                              "nsteps must be a positive integer, got 0"),
        ({"on_cpu": {"arm": {"wide": [2, 4, 6], "deep": [5, 2, 6]}}},
         "policy.on_cpu.arm: unknown key; expected one of: amx, avx512, avx2"),
        ({"on_cpu": {"avx512": {"wide": [2, 4, 6], "deep": [5, 1, 9]}}},
         "policy.on_cpu.avx512.deep: expected a valid tree shape [nsteps, topk, ndt], got [5, 1, 9]: "
         "ndt - 1 = 8 drafted nodes cannot be kept from a tree of nsteps=5, topk=1 (at most 5 candidates)"),
        ({"on_cpu": {"avx512": {"wide": [2, 4, 6]}}}, "policy.on_cpu.avx512.deep: required key missing"),
    ],
)
def test_param_errors_name_key_value_and_expectation(raw, message):
    with pytest.raises(ConfigError) as err:
        structure(DcsParams, raw, "x.yaml", "policy")
    assert str(err.value) == f"x.yaml: {message}"


def test_python_params_errors():
    with pytest.raises(ValueError, match="expected a finite number, got nan"):
        DcsParams(alpha=math.nan)
    with pytest.raises(ValueError, match="expected an integer >= 2, got 2.5"):
        DcsParams(levels=2.5)


def test_params_from_yaml_and_defaults():
    p = structure(DcsParams, {"wide": [2, 3, 5], "deep": [6, 1, 7], "d": 4}, "x.yaml", "policy")
    assert (p.wide, p.deep, p.d) == ((2, 3, 5), (6, 1, 7), 4.0)
    d = DcsParams()
    assert (d.alpha, d.d, d.weight, d.wide, d.deep, d.levels, d.breaker_steps, d.start) == (
        0.3, 3.0, 0.5, (3, 4, 4), (7, 1, 8), 5, 5, "middle"
    )


def test_registers_as_dcs_policy():
    registry = Registry("policy")
    dcs.adaptivespec_register_policies(registry)
    entry = registry.get("dcs")
    assert entry.cls is DcsPolicy and entry.lossless is True and entry.description


# -- ends measured per CPU kind -------------------------------------------------------------------
ON_CPU = {"wide": [3, 4, 8], "deep": [6, 2, 12], "on_cpu": {"avx512": {"wide": [2, 4, 6], "deep": [5, 2, 6]}}}


def test_on_cpu_ends_replace_wide_and_deep_on_a_cpu_of_that_kind(monkeypatch):
    params = structure(DcsParams, ON_CPU, "x.yaml", "policy")
    plain = DcsPolicy(params)
    monkeypatch.setattr(dcs, "cpu_kind", lambda: "avx512")
    pol = DcsPolicy(params)
    assert pol.shapes() == plain.shapes() and pol.cpu is None  # until bound to the machine
    pol.bind_costs(lambda: pytest.fail("the ends do not read the cost table"), "cpu")
    assert pol.cpu == "avx512"
    assert pol.shapes() == DcsPolicy(DcsParams(wide=(2, 4, 6), deep=(5, 2, 6))).shapes() != plain.shapes()
    assert pol.next_shape(signals(0.5)) == pol.start_shape in pol.shapes()  # the start shape is one of them
    shapes = [run(pol, 1.0, 5) for _ in range(3)]
    assert shapes[-1] == TreeShape(5, 2, 6)  # confident and accepting: the kind's deep end


@pytest.mark.parametrize(("kind", "device"), [("amx", "cpu"), ("avx2", "cpu"), (None, "cpu"), ("avx512", "cuda"), ("avx512", "cuda:0")])
def test_ends_stay_where_no_entry_names_the_machine(monkeypatch, kind, device):
    monkeypatch.setattr(dcs, "cpu_kind", lambda: kind)
    params = structure(DcsParams, ON_CPU, "x.yaml", "policy")
    pol = DcsPolicy(params)
    pol.bind_costs(lambda: None, device)
    assert pol.cpu is None and pol.shapes() == DcsPolicy(DcsParams(wide=(3, 4, 8), deep=(6, 2, 12))).shapes()


def test_shipped_dynamic_config_has_ends_for_this_cpu_kind_where_measured():
    from adaptivespec.config import load_config

    cfg = load_config("configs/adaptivespec-dynamic.yaml")
    assert cfg.policy.params.on_cpu.avx512 is not None  # measured on an AVX-512 EPYC (docs/tuning.md)
    assert cfg.policy.params.on_cpu.avx2 is not None  # measured in float32 under the AVX2 cap (docs/tuning.md)
    assert cfg.policy.params.on_cpu.amx is None  # the AMX Xeon runs wide / deep, measured there


def test_a_cpu_capped_to_avx2_runs_the_shipped_avx2_ends(monkeypatch):
    from adaptivespec import hardware
    from adaptivespec.config import load_config

    monkeypatch.setenv(hardware.ISA_ENV, "avx2")  # the capped level is part of hardware's cache key
    cfg = load_config("configs/adaptivespec-dynamic.yaml")
    pol = DcsPolicy(cfg.policy.params)
    pol.bind_costs(lambda: None, "cpu")
    ends = cfg.policy.params.on_cpu.avx2
    assert pol.cpu == "avx2"
    unbound = DcsPolicy(attrs.evolve(cfg.policy.params, wide=ends.wide, deep=ends.deep))
    assert pol.shapes() == unbound.shapes() and TreeShape(*ends.deep) in pol.shapes()
    assert max(s.ndt for s in pol.shapes()) < max(s.ndt for s in DcsPolicy(cfg.policy.params).shapes())
