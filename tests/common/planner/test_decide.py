"""The planner's decision on synthetic windows: it scales prefill on TTFT over the target with requests
queueing and decode on ITL or KV usage, reads a single burst as no reason to scale, waits out its cooldown,
stays within the bounds, and sizes the pools from the capacity it measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.decide import Capacity, Planner
from tandem.common.planner.signals import Signals

SLO = dict(ttft_slo_ms=500.0, itl_slo_ms=50.0)
CALM = Signals(seconds=10, ttft_s=0.1, itl_s=0.01, queue_s=0.0, prompt_tps=1000.0, generation_tps=100.0,
               requests=50, replicas={"prefill": 1, "decode": 1}, kv_usage=0.1)
# TTFT 4x the target, a second of queueing per request: the prefill pool is behind.
PREFILL_BEHIND = replace(CALM, ttft_s=2.0, queue_s=1.0, prompt_tps=2000.0)
DECODE_BEHIND = replace(CALM, itl_s=0.2, generation_tps=300.0)
IDLE = replace(CALM, ttft_s=None, itl_s=None, prompt_tps=0.0, generation_tps=0.0, requests=0, kv_usage=0.0)


def planner(**kw) -> Planner:
    return Planner(PlannerConfig(**{**SLO, "scale_up_windows": 2, "scale_down_windows": 3, "cooldown_s": 30.0,
                                    **kw}).validate())


def run(p: Planner, windows: list[Signals], start: float = 0.0, every: float = 10.0) -> list[tuple[int, int]]:
    """(prefill, decode) desired after each window; each window's replicas are the plan so far (applied)."""
    plan, out = dict(windows[0].replicas), []
    for i, s in enumerate(windows):
        decisions = p.step(replace(s, replicas=dict(plan)), start + i * every)
        plan = {role: d.desired for role, d in decisions.items()}
        out.append((plan["prefill"], plan["decode"]))
    return out


def test_ttft_over_the_target_with_a_queue_adds_prefill_workers_only():
    assert run(planner(), [PREFILL_BEHIND] * 2) == [(1, 1), (2, 1)]


def test_ttft_over_the_target_without_a_queue_is_not_the_prefill_pools_fault():
    """One long prompt makes TTFT high with nobody waiting: more prefill workers would not help."""
    assert run(planner(), [replace(PREFILL_BEHIND, queue_s=0.0)] * 4) == [(1, 1)] * 4


def test_itl_over_the_target_adds_decode_workers():
    assert run(planner(), [DECODE_BEHIND] * 2) == [(1, 1), (1, 2)]


def test_decode_kv_usage_over_kv_high_adds_decode_workers():
    assert run(planner(), [replace(CALM, kv_usage=0.95)] * 2) == [(1, 1), (1, 2)]


def test_a_single_burst_does_not_scale():
    """One window over the target between calm ones: never two in a row, never a change."""
    windows = [CALM, PREFILL_BEHIND, CALM, DECODE_BEHIND, CALM, PREFILL_BEHIND, CALM]
    assert run(planner(), windows) == [(1, 1)] * len(windows)


def test_no_flapping_under_an_alternating_load():
    """Pressure and calm windows alternating for a minute: the plan never moves either way."""
    assert set(run(planner(), [PREFILL_BEHIND, IDLE] * 6)) == {(1, 1)}


def test_the_cooldown_holds_the_next_change():
    p = planner(cooldown_s=35.0)
    plans = run(p, [PREFILL_BEHIND] * 8)
    # up at window 1 (t=10s); streaks restart after a change; the next change needs t >= 45 s: window 5 (t=50)
    assert [x[0] for x in plans] == [1, 2, 2, 2, 2, 3, 3, 3]
    assert p.step(replace(PREFILL_BEHIND, replicas={"prefill": 3, "decode": 1}), 75.0)["prefill"].reason == \
        "cooldown"


def test_bounds_cap_the_plan():
    p = planner(max_prefill=2, cooldown_s=0.0)
    assert [x[0] for x in run(p, [PREFILL_BEHIND] * 8)] == [1, 2, 2, 2, 2, 2, 2, 2]
    assert p.step(replace(PREFILL_BEHIND, replicas={"prefill": 2, "decode": 1}), 100.0)["prefill"].reason \
        .endswith("_at_max")
    low = planner(min_prefill=2, min_decode=2)
    assert run(low, [IDLE] * 5) == [(2, 2)] * 5  # starting at one each: the minimum holds from the start


def test_scale_down_waits_for_a_measurement_and_for_slack_in_a_row():
    """Without a capacity measured, an idle pool above the minimum stays (no scale-in on a guess)."""
    p = planner()
    idle_two = replace(IDLE, replicas={"prefill": 2, "decode": 2})
    assert run(p, [idle_two] * 6) == [(2, 2)] * 6
    assert p.step(idle_two, 100.0)["prefill"].reason == "no_capacity_measurement"


def test_after_a_step_up_the_pool_comes_back_down_when_the_load_goes():
    p = planner(cooldown_s=0.0)
    plans = run(p, [PREFILL_BEHIND] * 2 + [DECODE_BEHIND] * 2 + [IDLE] * 6)
    assert plans[1] == (2, 1) and plans[3] == (2, 2)
    # prefill was calm through the decode windows: its third slack window in a row is window 4; decode's is 6
    assert plans[4:] == [(1, 2), (1, 2), (1, 1), (1, 1), (1, 1), (1, 1)]


def test_the_capacity_model_sizes_a_scale_up_beyond_one_step():
    """Saturated at 2,000 prompt tok/s on one worker: 2,000 tok/s per worker. Eight workers later saturated
    serving 16,000 tok/s need 16,000 / (2,000 x 0.8) = 10: one step of two."""
    p = planner(cooldown_s=0.0, max_prefill=16)
    run(p, [PREFILL_BEHIND] * 2)
    assert p.roles["prefill"].capacity.per_worker_tps == pytest.approx(2000.0)
    p.roles["prefill"].desired = 8
    surge = replace(PREFILL_BEHIND, prompt_tps=16000.0, replicas={"prefill": 8, "decode": 1})
    p.step(surge, 100.0)
    assert p.step(surge, 110.0)["prefill"].desired == 10


def test_scale_down_keeps_what_the_measured_load_needs():
    """2,000 tok/s per worker measured; 3,000 tok/s of calm load on 4 workers needs 2 (at 0.8): it steps down
    one at a time and stops at 2."""
    p = planner(cooldown_s=0.0, scale_down_windows=1)
    p.roles["prefill"].capacity = Capacity(2000.0, 1)
    p.roles["prefill"].desired = 4
    calm = replace(CALM, prompt_tps=3000.0, replicas={"prefill": 4, "decode": 1})
    plans = [p.step(replace(calm, replicas={"prefill": n, "decode": 1}), t)["prefill"].desired
             for t, n in ((0, 4), (10, 3), (20, 2), (30, 2))]
    assert plans == [3, 2, 2, 2]


def test_capacity_is_measured_only_when_saturated_but_raised_by_any_window():
    c = Capacity()
    c.observe(500.0, 1, saturated=False)
    assert c.per_worker_tps is None and c.workers_for(100.0, 0.8) is None
    c.observe(1000.0, 2, saturated=True)
    c.observe(3000.0, 2, saturated=True)
    assert c.per_worker_tps == pytest.approx(1000.0) and c.samples == 2  # 500, then halfway to 1,500
    c.observe(2400.0, 1, saturated=False)
    assert c.per_worker_tps == 2400.0
    assert c.workers_for(0.0, 0.8) == 0 and c.workers_for(4000.0, 0.8) == 3


@pytest.mark.parametrize("field, value", [("min_prefill", 0), ("max_decode", 0), ("slo_quantile", 1.0),
                                          ("window_s", 1.0), ("router_url", "127.0.0.1:8000"),
                                          ("target_utilization", 0.0)])
def test_bad_settings_name_their_flag(field, value):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
        PlannerConfig(**{field: value}).validate()
