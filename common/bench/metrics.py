"""Per-request records and the summary math of `tandem bench serve` (TTFT, TPOT, ITL, E2E, goodput)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
CACHE_HIT_METRIC = "tandem_prefix_cache_hit_tokens_total"
CACHE_QUERY_METRIC = "tandem_prefix_cache_query_tokens_total"


@dataclass
class RequestRecord:
    """What one streamed request measured. Times are seconds; `itl` holds the gaps between content chunks."""

    prompt_len: int
    output_len: int  # max_tokens asked for
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens counts content chunks instead
    start: float = 0.0  # seconds since the benchmark began

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


@dataclass
class SLO:
    """Latency targets in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None  # --slo-itl-ms: compared with each request's TPOT (its mean inter-token gap)
    e2e_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and record.ttft * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot
        # A one-token reply has no inter-token gap to miss the target with.
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e * 1e3 <= self.e2e_ms


def latency_stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 / max in milliseconds (numpy's linear interpolation); None when empty.

    max is there for stalls: a prefill that holds up every running stream once is well under 1 % of the gaps."""
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES] + ["max"]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    stats = {"mean": float(ms.mean())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    stats["max"] = float(ms.max())
    return stats


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO,
              cache_hit_rate: float | None = None) -> dict:
    ok = [r for r in records if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    good = sum(slo.met_by(r) for r in ok) if slo.any else None
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "good_requests": good,
        "goodput": None if good is None else good / duration_s,
        "cache_hit_rate": cache_hit_rate,
        "ttft_ms": latency_stats_ms([r.ttft for r in ok]),
        "tpot_ms": latency_stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": latency_stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_stats_ms([r.e2e for r in ok]),
    }


def prometheus_total(text: str, name: str) -> float | None:
    """Sum of every sample of `name` (all label sets) in Prometheus text format; None when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        if not rest or rest[0] not in " {":
            continue  # another metric sharing the prefix
        if rest[0] == "{":
            rest = rest[rest.find("}") + 1:]
        fields = rest.split()
        if not fields:
            continue
        try:
            total += float(fields[0])
            seen = True
        except ValueError:
            continue
    return total if seen else None


def cache_counters(text: str) -> tuple[float, float] | None:
    hit, query = prometheus_total(text, CACHE_HIT_METRIC), prometheus_total(text, CACHE_QUERY_METRIC)
    return None if hit is None or query is None else (hit, query)


def cache_hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Hit tokens / queried tokens over the run; None when the server lacks the counters or saw no query."""
    if before is None or after is None:
        return None
    queried = after[1] - before[1]
    return None if queried <= 0 else (after[0] - before[0]) / queried
