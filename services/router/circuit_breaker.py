"""Per-worker circuit breaker: open after N consecutive failures, one trial request after a cool-down."""

from __future__ import annotations

import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """closed → (N consecutive failures) → open → (cool-down) → half_open: one trial at a time;
    its success closes the breaker, its failure opens it again for another cool-down."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive_failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return HALF_OPEN if self.clock() - self._opened_at >= self.cooldown_s else OPEN

    def allows(self) -> bool:
        """Whether a request may go to this worker now (does not reserve the half-open trial)."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial_in_flight)

    def begin(self) -> None:
        """A request is being sent; in half-open it is the one trial."""
        if self.state == HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        was_trial = self._trial_in_flight or self.state == HALF_OPEN
        self._trial_in_flight = False
        if was_trial or self.consecutive_failures >= self.failure_threshold:
            self._opened_at = self.clock()
