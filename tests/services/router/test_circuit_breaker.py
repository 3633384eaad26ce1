"""The circuit breaker opens after N consecutive failures and lets one trial through after its cool-down."""

from __future__ import annotations

from tandem.services.router.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=5, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # resets the streak
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == CLOSED and breaker.allows()
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.allows()


def test_half_open_allows_one_trial_whose_result_decides():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=5, clock=clock)
    breaker.record_failure()
    clock.now += 4.9
    assert not breaker.allows()
    clock.now += 0.2
    assert breaker.state == HALF_OPEN and breaker.allows()
    breaker.begin()
    assert not breaker.allows()  # one trial at a time
    breaker.record_failure()
    assert breaker.state == OPEN  # failed trial: another full cool-down
    clock.now += 5.1
    breaker.begin()
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.allows()
