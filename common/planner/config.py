"""The planner's one config object: SLO targets, how it smooths the signals, replica bounds, where it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tandem.common.flags import ConfigError, flag

_SLO, _SMOOTH, _BOUNDS, _IO = "SLO targets", "smoothing and hysteresis", "replica bounds", "metrics"


@dataclass
class PlannerConfig:
    ttft_slo_ms: float = flag(1000.0, "time-to-first-token target: the window's quantile (--slo-quantile) above "
                                      "it, with requests queueing, asks for a prefill worker more", group=_SLO)
    itl_slo_ms: float = flag(100.0, "inter-token latency target: the window's quantile above it (or decode KV "
                                    "above --kv-high) asks for a decode worker more", group=_SLO)
    slo_quantile: float = flag(0.9, "which quantile of TTFT and ITL is held to the targets", group=_SLO)
    interval_s: float = flag(5.0, "seconds between two scrapes and decisions", group=_SMOOTH)
    window_s: float = flag(30.0, "seconds of metrics one decision reads (quantiles and rates over it)",
                           group=_SMOOTH)
    scale_up_windows: int = flag(2, "consecutive decisions under pressure before a scale-up (a burst that one "
                                    "window absorbs does not scale)", group=_SMOOTH)
    scale_down_windows: int = flag(6, "consecutive decisions with slack before a scale-down", group=_SMOOTH)
    cooldown_s: float = flag(60.0, "seconds after a role's change before it changes again (a new worker's load "
                                   "shows first)", group=_SMOOTH)
    queue_fraction: float = flag(0.25, "a mean queue time above this fraction of the TTFT target means the "
                                       "prefill pool is behind (not one long prompt)", group=_SMOOTH)
    slack_ratio: float = flag(0.5, "latency below this fraction of its target (and the load fitting one worker "
                                   "fewer) counts as slack: the gap between scaling up and down", group=_SMOOTH)
    target_utilization: float = flag(0.8, "fraction of a worker's measured capacity the plan fills",
                                     group=_SMOOTH)
    kv_high: float = flag(0.85, "decode KV usage (router's view: reservations included) that asks for a decode "
                                "worker more", group=_SMOOTH)
    min_prefill: int = flag(1, "fewest prefill workers", group=_BOUNDS)
    max_prefill: int = flag(8, "most prefill workers", group=_BOUNDS)
    min_decode: int = flag(1, "fewest decode workers", group=_BOUNDS)
    max_decode: int = flag(8, "most decode workers", group=_BOUNDS)
    router_url: str = flag("http://127.0.0.1:8000", "the router whose /metrics the planner reads", group=_IO)
    worker_metrics: list[str] = flag([], "a prefill worker's metrics URL (its queue time); without one the "
                                         "router's admission queue is the queue signal", metavar="URL",
                                     group=_IO)
    metrics_host: str = flag("0.0.0.0", "address the planner's own /metrics listens on", group=_IO)
    metrics_port: Optional[int] = flag(None, "serve tandem_planner_* metrics (desired replicas per role, the "
                                             "capacity model, the signals) on this port (default: off; an "
                                             "autoscaler reads them)", group=_IO)

    def bounds(self, role: str) -> tuple[int, int]:
        return {"prefill": (self.min_prefill, self.max_prefill), "decode": (self.min_decode, self.max_decode)}[role]

    def validate(self) -> "PlannerConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(self.ttft_slo_ms > 0 and self.itl_slo_ms > 0, "--ttft-slo-ms and --itl-slo-ms must be > 0")
        need(0 < self.slo_quantile < 1, f"--slo-quantile must be in (0, 1), got {self.slo_quantile}")
        need(self.interval_s > 0, f"--interval-s must be > 0, got {self.interval_s}")
        need(self.window_s >= self.interval_s, f"--window-s ({self.window_s}) must be >= --interval-s "
                                               f"({self.interval_s}): a window holds at least two scrapes")
        need(self.scale_up_windows >= 1 and self.scale_down_windows >= 1, "--scale-*-windows must be >= 1")
        need(self.cooldown_s >= 0, f"--cooldown-s must be >= 0, got {self.cooldown_s}")
        need(0 < self.queue_fraction, f"--queue-fraction must be > 0, got {self.queue_fraction}")
        need(0 < self.slack_ratio < 1, f"--slack-ratio must be in (0, 1), got {self.slack_ratio}")
        need(0 < self.target_utilization <= 1, f"--target-utilization must be in (0, 1], got "
                                               f"{self.target_utilization}")
        need(0 < self.kv_high <= 1, f"--kv-high must be in (0, 1], got {self.kv_high}")
        for role in ("prefill", "decode"):
            low, high = self.bounds(role)
            need(1 <= low <= high, f"--min-{role} ({low}) must be >= 1 and <= --max-{role} ({high})")
        need(self.metrics_port is None or 0 <= self.metrics_port < 65536, "--metrics-port must be a port number")
        need(self.router_url.startswith(("http://", "https://")), f"--router-url must be http(s)://HOST:PORT, got "
                                                                  f"{self.router_url!r}")
        return self
