"""--prefill-wait-ms: a burst of arrivals is prefilled as one batch (the hold), bounded by --prefill-wait-max-ms and
the free slots; 0 prefills each arrival at once. Greedy outputs do not depend on it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.batcher import Batcher, TokenRatio
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.test_engine_api import assert_no_leak


def _batcher(wait_ms: float, max_ms: float, arrivals: list[float]) -> Batcher:
    config = EngineConfig(model_path="unused", prefill_wait_ms=wait_ms, prefill_wait_max_ms=max_ms)
    batcher = Batcher(config, None, "cpu", None, None, TokenRatio.none())
    batcher.waiting_queue = [SimpleNamespace(arrival_time=t) for t in arrivals]
    return batcher


def test_hold_until_arrivals_pause_then_release():
    now = time.monotonic()
    batcher = _batcher(50.0, 1000.0, [now - 0.01, now])
    assert batcher.hold_prefill(free_slots=8)
    assert now + 0.049 < batcher.hold_until <= now + 0.05 + 1e-6  # the newest arrival + the gap
    assert 0 < batcher.held_wait() <= 0.05
    quiet = _batcher(50.0, 1000.0, [now - 0.2, now - 0.1])  # none arrived for longer than the gap
    assert not quiet.hold_prefill(free_slots=8)


def test_hold_is_bounded_by_the_oldest_wait_and_the_free_slots():
    now = time.monotonic()
    assert not _batcher(50.0, 100.0, [now - 0.15, now]).hold_prefill(free_slots=8)  # the oldest waited > max
    assert not _batcher(50.0, 1000.0, [now, now]).hold_prefill(free_slots=2)  # the burst fills the free slots
    assert not _batcher(0.0, 1000.0, [now]).hold_prefill(free_slots=8)  # off
    assert _batcher(0.0, 1000.0, [now]).held_wait() == 0.0


def test_negative_waits_are_refused():
    with pytest.raises(ConfigError, match="--prefill-wait-ms"):
        EngineConfig(model_path=".", prefill_wait_ms=-1).validate()


def _burst(engine: Engine, gap_s: float) -> list:
    """Two requests, the second submitted `gap_s` after the first, read concurrently."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    handles = [engine.submit(GenerateRequest("a", [5, 6, 7, 8, 9], params))]
    time.sleep(gap_s)
    handles.append(engine.submit(GenerateRequest("b", [10, 11, 12, 13], params)))
    results: list = [None, None]
    readers = [threading.Thread(target=lambda i=i: results.__setitem__(i, handles[i].result())) for i in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(60)
    return results


@pytest.mark.parametrize("wait_ms, extends", [(400.0, 1), (0.0, 2)])
def test_a_burst_is_prefilled_as_one_batch_only_with_the_hold(tiny_llama, wait_ms, extends):
    """The second request arrives 100 ms after the first: held, both are prefilled together; not held, the first
    is prefilled alone at once. The tokens are the same either way."""
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=1024, page_size=4, event_loop="normal",
                          prefill_wait_ms=wait_ms, prefill_wait_max_ms=2000.0, profile_steps=True)
    with Engine(config) as engine:
        results = _burst(engine, 0.1)
        report = engine.step_profiler.report()
        assert_no_leak(engine)
    assert report["extend"]["steps"] == extends
    assert [r.completion_tokens for r in results] == [4, 4]
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, page_size=4, prefill_wait_ms=0)) as ref:
        expected = _burst(ref, 0.0)
    assert [r.sequences[0].output_ids for r in results] == [r.sequences[0].output_ids for r in expected]


def test_off_by_default_a_lone_arrival_is_prefilled_at_once():
    defaults = EngineConfig(model_path="unused")
    assert defaults.prefill_wait_ms == 0.0
    batcher = _batcher(defaults.prefill_wait_ms, defaults.prefill_wait_max_ms, [time.monotonic()])
    assert not batcher.hold_prefill(free_slots=8) and batcher.hold_until is None
