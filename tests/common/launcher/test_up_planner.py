"""`tandem up --planner`: the flags it refuses, and a real stack under a step load that scales its pools up and
back down without a failed request (the planner's intervals shortened by its flags)."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass

import pytest

from tests.common.launcher.step_load import StepLoad, attainment
from tests.common.launcher.test_up import STACK_FLAGS, UpProcess
from tests.common.rpc.helpers import free_port

TTFT_SLO_MS, ITL_SLO_MS = 300, 50
# Decisions every second over 3 s windows; two windows in a row to scale up, three to scale down.
PLANNER_FLAGS = ["--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", str(ITL_SLO_MS), "--interval-s", "1",
                 "--window-s", "3", "--scale-up-windows", "2", "--scale-down-windows", "3", "--cooldown-s", "2",
                 "--max-prefill", "2", "--max-decode", "2"]
# ~200 prompt tokens + 32 out: 24 clients reserve more than --kv-high of one decode's 4,096-token pool.
PROMPT, MAX_TOKENS, HIGH, LOW = "the quick brown fox " * 40, 32, 24, 1
SETTLE_S = 10.0  # after the last scale-up decision or new worker serving, how long the high step waits for another


def parse(*argv: str):
    from tandem.common.launcher.up import add_up_args, config_from_args

    parser = argparse.ArgumentParser()
    add_up_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("argv, message", [
    (["--ttft-slo-ms", "200"], "--ttft-slo-ms is a planner setting: add --planner"),
    (["--planner", "--unified", "2"], "with --unified there are none"),
    (["--planner", "--decode", "3", "--max-decode", "2"], "--decode 3 is outside the planner's bounds"),
    (["--planner", "--window-s", "1", "--interval-s", "2"], "--window-s (1.0) must be >= --interval-s"),
])
def test_up_refuses_what_the_planner_cannot_do(tiny_llama, argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse("--model", tiny_llama, *argv)


def test_the_planner_gets_an_admin_key_of_its_own_unless_one_is_given(tiny_llama):
    generated = parse("--model", tiny_llama, "--planner", "--api-key", "client")
    assert generated.planner is not None and generated.admin_api_key not in (None, "client")
    assert len(generated.admin_api_key) >= 32
    given = parse("--model", tiny_llama, "--planner", "--admin-api-key", "mine")
    assert given.admin_api_key == "mine" and given.router_flags.count("--admin-api-key") == 1
    assert parse("--model", tiny_llama).admin_api_key is None and parse("--model", tiny_llama).planner is None
    # --metrics-port is the workers' under `tandem up` (the planner's own is for `tandem planner`)
    assert parse("--model", tiny_llama, "--metrics-port", "9400").planner is None
    assert parse("--model", tiny_llama, "--planner", "--metrics-port", "9400").planner.metrics_port is None


def test_keys_that_begin_with_a_dash_reach_the_router(tiny_llama, monkeypatch):
    """A generated key is url-safe base64, which may begin with "-": the router must not read it as a flag."""
    from tandem.common.launcher.up import Stack
    from tandem.services.router.config import add_router_args, config_from_args

    config = parse("--model", tiny_llama, "--planner", "--no-tls")
    config.api_key, config.admin_api_key = "-client", "-Xk3_admin"
    stack = Stack(config, tiny_llama)
    spawned = {}

    def spawn(name, *argv, env=None):
        spawned[name] = list(argv)
        raise InterruptedError  # the argv is all this test needs

    monkeypatch.setattr(stack, "_spawn", spawn)
    with pytest.raises(InterruptedError):
        stack._start_router(["--worker", "grpc://127.0.0.1:1"], time.monotonic() + 5)
    router = argparse.ArgumentParser()
    add_router_args(router)
    parsed = config_from_args(router.parse_args(spawned["router"][1:]))  # after the subcommand's name
    assert (parsed.api_key, parsed.admin_api_key) == ("-client", "-Xk3_admin")


@dataclass
class StepRun:
    results: list  # every request's Result
    decided_s: list[float]  # seconds from the step up to each scale-up decision (the launcher starting a worker)
    scaled_up_s: list[float]  # seconds from the step up to each new worker serving
    scaled_down_s: float  # seconds from the step down to the last scaled worker stopped
    stops: list[str]  # the launcher's "stopped ..." lines
    high: tuple[float, float]  # (start, end) of the high phase, monotonic
    low: tuple[float, float]


def run_step_load(tiny_llama: str, planner: bool, high_s: float = 150.0, low_s: float = 120.0,
                  hold_s: float = 0.0) -> StepRun:
    """LOW clients, then HIGH until the planner's new workers serve (or `high_s`) and `hold_s` more, then LOW
    until they are stopped again (or `low_s`). Without the planner each phase lasts what `high_s` / `low_s`
    say."""
    flags = ["--planner", *PLANNER_FLAGS] if planner else []
    up = UpProcess("--model", tiny_llama, "--prefill", "1", "--decode", "1", "--num-threads", "1", "--port",
                   str(free_port()), *STACK_FLAGS, *flags, timeout=300)
    load = StepLoad(up.url, tiny_llama.rstrip("/").split("/")[-1], HIGH, PROMPT, MAX_TOKENS)
    try:
        load.active = LOW
        time.sleep(5)
        step_up = time.monotonic()
        load.active = HIGH
        serving: list[float] = []
        decided: list[float] = []
        while time.monotonic() - step_up < high_s:
            for pattern, seen in ((r"planner: \S+ serving", serving), (r"planner: starting", decided)):
                count = len(re.findall(pattern, "".join(up.err)))
                seen += [time.monotonic() - step_up] * (count - len(seen))
            # Scaled: every worker it started serves, and either both roles grew or it decided nothing more for
            # SETTLE_S (how many it adds depends on how far this machine misses the SLOs under the step).
            if planner and serving and len(serving) == len(decided) and (
                    len(serving) >= 2 or time.monotonic() - step_up - max(serving + decided) >= SETTLE_S):
                break
            time.sleep(0.2)
        time.sleep(hold_s)
        step_down = time.monotonic()
        load.active = LOW
        stopped = 0.0
        while time.monotonic() - step_down < low_s:
            stops = re.findall(r"planner: stopped .*", "".join(up.err))
            if planner and serving and len(stops) >= len(serving):
                stopped = time.monotonic() - step_down
                break
            time.sleep(0.2)
        end = time.monotonic()
        load.active = 0
    finally:
        load.close()
        up.kill()
    return StepRun(load.results, decided, serving, stopped, re.findall(r"planner: stopped .*", "".join(up.err)),
                   (step_up, step_down), (step_down, end))


@pytest.mark.e2e
def test_up_planner_scales_up_and_back_down_without_a_failed_request(tiny_llama):
    run = run_step_load(tiny_llama, planner=True)
    failed = [r.error for r in run.results if r.error is not None]
    assert not failed, failed[:3]
    assert run.scaled_up_s, "no worker was added under the high step"
    assert run.scaled_down_s > 0 and len(run.stops) == len(run.scaled_up_s), run.stops
    assert all(line.endswith("requests cut off: 0)") for line in run.stops), run.stops
    during_scale_in = [r for r in run.results if run.low[0] <= r.started <= run.low[1]]
    assert during_scale_in and all(r.tokens == MAX_TOKENS for r in during_scale_in)


def _phase_summary(run: StepRun, phase: tuple[float, float]) -> str:
    results = [r for r in run.results if phase[0] <= r.started < phase[1]]
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
    return (f"{len(results)} requests, {sum(r.error is not None for r in results)} failed, TTFT p90 {p90 * 1000:.0f} ms, "
            f"SLO attainment {attainment(results, TTFT_SLO_MS / 1000, ITL_SLO_MS / 1000):.0%}")


@pytest.mark.e2e
@pytest.mark.measure
def test_step_load_with_and_without_the_planner(tiny_llama):
    """The measurement in docs/reliability.md ("Planner"): the same step load on a fixed 1P+1D stack and under
    the planner (its phases as long as the planner's took), printed; both without a failed request."""
    planned = run_step_load(tiny_llama, planner=True, hold_s=30.0)
    high_s, low_s = planned.high[1] - planned.high[0], planned.low[1] - planned.low[0]
    fixed = run_step_load(tiny_llama, planner=False, high_s=high_s, low_s=low_s)
    scaled = planned.scaled_up_s[-1] if planned.scaled_up_s else high_s  # the last 30 s: at the planned size
    print(f"\nstep load: {HIGH} clients for {high_s:.0f} s, then {LOW} for {low_s:.0f} s "
          f"(TTFT <= {TTFT_SLO_MS} ms, ITL <= {ITL_SLO_MS} ms)")
    print(f"planner: scale-ups decided {', '.join(f'{s:.1f}' for s in planned.decided_s)} s and new workers "
          f"serving {', '.join(f'{s:.1f}' for s in planned.scaled_up_s)} s after the step "
          f"up; back to 1P+1D {planned.scaled_down_s:.1f} s after the step down; {planned.stops}")
    for name, run in (("fixed 1P+1D", fixed), ("planner", planned)):
        print(f"{name:12} high: {_phase_summary(run, run.high)}")
        print(f"{name:12} high, from {scaled:.0f} s on: {_phase_summary(run, (run.high[0] + scaled, run.high[1]))}")
        print(f"{name:12} low:  {_phase_summary(run, run.low)}")
    assert not [r for r in planned.results + fixed.results if r.error is not None]
