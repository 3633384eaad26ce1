"""The planner's decision: from one window's signals, how many prefill and decode workers the load needs.

Per role, every window is read as pressure (the SLO missed for a reason that role's workers cause), slack
(well within the SLO, and the load fits one worker fewer) or neither. A change needs that reading for several
windows in a row, never comes within a cooldown of the last one, and stays within the bounds:

    prefill pressure: TTFT quantile > --ttft-slo-ms and mean queue time > --queue-fraction x the target
    decode pressure:  ITL quantile > --itl-slo-ms, or decode KV usage > --kv-high
    slack:            latency < --slack-ratio x its target, queue empty, and the measured load would fill
                      one worker fewer below --target-utilization

How many is the capacity model's: tokens/s one worker of the role serves, measured from the deployment's own
metrics in windows where that role was the bottleneck (served tokens/s over its workers). Under pressure the
plan is the larger of one more worker and what the model says the load needs; with slack, one fewer (never
below what the model needs). Without a measurement yet, the planner scales up by one and never scales in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from tandem.common.planner.config import PlannerConfig
from tandem.common.planner.signals import Signals

ROLES = ("prefill", "decode")
CAPACITY_SMOOTHING = 0.5  # weight of a new saturated window in a role's per-worker capacity


@dataclass
class Capacity:
    """Tokens/s one worker of a role serves at saturation: a moving average over saturated windows, raised
    at once by any window that shows a worker serving more."""

    per_worker_tps: Optional[float] = None
    samples: int = 0

    def observe(self, served_tps: float, replicas: int, saturated: bool) -> None:
        if replicas <= 0 or served_tps <= 0:
            return
        per_worker = served_tps / replicas
        if saturated:
            old = self.per_worker_tps
            self.per_worker_tps = per_worker if old is None else (1 - CAPACITY_SMOOTHING) * old + \
                CAPACITY_SMOOTHING * per_worker
            self.samples += 1
        elif self.per_worker_tps is not None and per_worker > self.per_worker_tps:
            self.per_worker_tps = per_worker  # seen serving more without missing the SLO

    def workers_for(self, tps: float, utilization: float) -> Optional[int]:
        """Workers that serve `tps` each below `utilization` of its capacity; None before a measurement."""
        if self.per_worker_tps is None:
            return None
        return math.ceil(tps / (self.per_worker_tps * utilization)) if tps > 0 else 0


@dataclass
class Decision:
    role: str
    current: int
    desired: int
    reason: str  # why (pressure, slack, cooldown, bounds ...), for the log and the metric label

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


@dataclass
class RoleState:
    capacity: Capacity = field(default_factory=Capacity)
    streak: int = 0  # > 0: windows in a row under pressure; < 0: with slack
    changed_at: float = -math.inf
    desired: Optional[int] = None


class Planner:
    """Decides; does not act. `step` is called once per interval with the window that ends then."""

    def __init__(self, config: PlannerConfig):
        self.config = config
        self.roles = {role: RoleState() for role in ROLES}

    def step(self, s: Signals, now: float) -> dict[str, Decision]:
        c = self.config
        ttft_slo, itl_slo = c.ttft_slo_ms / 1000, c.itl_slo_ms / 1000
        queued = s.queue_s > c.queue_fraction * ttft_slo
        prefill_pressure = s.ttft_s is not None and s.ttft_s > ttft_slo and queued
        prefill_calm = (s.ttft_s is None or s.ttft_s < c.slack_ratio * ttft_slo) and not queued
        kv_full = s.kv_usage is not None and s.kv_usage > c.kv_high
        decode_pressure = (s.itl_s is not None and s.itl_s > itl_slo) or kv_full
        kv = s.kv_usage or 0.0
        decode_calm = (s.itl_s is None or s.itl_s < c.slack_ratio * itl_slo) and kv < c.slack_ratio * c.kv_high
        return {
            "prefill": self._decide("prefill", s.replicas.get("prefill", 0), s.prompt_tps, prefill_pressure,
                                    prefill_calm, now),
            "decode": self._decide("decode", s.replicas.get("decode", 0), s.generation_tps, decode_pressure,
                                   decode_calm, now, kv_usage=s.kv_usage),
        }

    def _decide(self, role: str, current: int, tps: float, pressure: bool, calm: bool, now: float,
                kv_usage: Optional[float] = None) -> Decision:
        c, state = self.config, self.roles[role]
        low, high = c.bounds(role)
        state.capacity.observe(tps, current, pressure)
        planned = state.desired if state.desired is not None else current
        needed = state.capacity.workers_for(tps, c.target_utilization)
        if needed is not None and kv_usage is not None and current > 0:  # the KV in use fits below --kv-high
            needed = max(needed, math.ceil(kv_usage * current / c.kv_high))
        fits_fewer = needed is not None and needed <= planned - 1 and \
            (kv_usage is None or kv_usage * current / max(planned - 1, 1) < c.kv_high * c.slack_ratio)
        slack = calm and fits_fewer
        state.streak = (max(state.streak, 0) + 1) if pressure else (min(state.streak, 0) - 1) if slack else 0
        desired, reason = planned, "steady"
        if pressure and state.streak >= c.scale_up_windows:
            desired, reason = max(planned + 1, needed or 0), "slo_pressure"
        elif pressure:
            reason = "pressure_unconfirmed"
        elif slack and -state.streak >= c.scale_down_windows:
            desired, reason = max(planned - 1, needed or 0), "slack"
        elif slack:
            reason = "slack_unconfirmed"
        elif calm and needed is None and planned > low:
            reason = "no_capacity_measurement"  # never scale in on a guess
        clamped = min(max(desired, low), high)
        if clamped != desired:
            reason = f"{reason}_at_{'max' if desired > high else 'min'}"
        desired = clamped
        if desired != planned and now - state.changed_at < c.cooldown_s:
            return Decision(role, planned, planned, "cooldown")
        if desired != planned:
            state.changed_at, state.streak = now, 0
        state.desired = desired
        return Decision(role, planned, desired, reason)
