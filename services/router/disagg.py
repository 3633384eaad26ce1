"""Conditional disaggregation: per request, whether a prefill worker prefills the prompt (a pair) or the decode
worker prefills it itself (local), from signals the router already has.

`decide` is a pure function of `DisaggSignals`; `signals_for` reads them off the registry's workers.
Whatever --disagg-policy says, a request goes local when no prefill worker is available (slower, not failed);
`always` means "always when a prefill worker is available".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tandem.services.router.policies import RouteRequest
PAIR, LOCAL = "pair", "local"


@dataclass(frozen=True)
class DisaggThresholds:
    """`auto`'s thresholds (RouterConfig's --local-prefill-* and --prefill-saturated-queue)."""

    max_local_tokens: int  # uncached prompt tokens at or below which the decode prefills
    saturated_queue: int  # requests waiting on the least-loaded prefill above which the pool counts as saturated
    min_free_kv: float  # fraction of the decode's pool that must stay free after a local prefill
    max_decode_waiting: int  # requests waiting on the decode (its queued local prefills) at which it takes no more


@dataclass(frozen=True)
class DisaggSignals:
    prompt_tokens: int
    uncached_tokens: int  # the prompt less the best local-capable decode's cached prefix (its KV events)
    prefill_available: bool  # a healthy prefill worker (breaker closed) serving the decode's weights
    prefill_waiting: int  # requests waiting on the least-loaded available prefill worker
    decode_free_tokens: Optional[int]  # free KV on that decode; None until it reported its pool
    decode_total_tokens: int
    decode_waiting: int = 0  # requests waiting on that decode: local prefills not yet started, transfers not begun


@dataclass(frozen=True)
class Decision:
    decision: str  # PAIR or LOCAL
    reason: str

    @property
    def local(self) -> bool:
        return self.decision == LOCAL


def decide(policy: str, limits: DisaggThresholds, s: DisaggSignals) -> Decision:
    """Pair or local for one request a local-capable decode could take. Reasons, in the order checked:
    prefill_unavailable, policy_always, policy_never, decode_kv_low, decode_busy, short_prompt, cached_prefix,
    prefill_saturated, long_prompt.

    Under `auto` the decode's room never sends a long prompt local by itself: only a prefill pool that is down or
    saturated does. And the decode takes no local prefill while local prefills already queue on it: each one
    stalls its running streams (ITL), so piling them up costs more than the prefill's queue or the transfer."""
    if not s.prefill_available:
        return Decision(LOCAL, "prefill_unavailable")
    if policy == "always":
        return Decision(PAIR, "policy_always")
    if policy == "never":
        return Decision(LOCAL, "policy_never")
    if s.decode_free_tokens is not None and s.decode_total_tokens:
        free_after = s.decode_free_tokens - s.uncached_tokens
        if free_after < limits.min_free_kv * s.decode_total_tokens:
            return Decision(PAIR, "decode_kv_low")  # the decode's pages are for decoding; a prefill adds load
    if s.decode_waiting >= limits.max_decode_waiting:
        return Decision(PAIR, "decode_busy")
    if s.uncached_tokens <= limits.max_local_tokens:
        return Decision(LOCAL, "short_prompt" if s.prompt_tokens <= limits.max_local_tokens else "cached_prefix")
    if s.prefill_waiting > limits.saturated_queue:
        return Decision(LOCAL, "prefill_saturated")
    return Decision(PAIR, "long_prompt")


def cached_tokens(worker, route: RouteRequest) -> int:
    """Prompt tokens the worker's (or its best DP rank's) HiRadixCache holds, by its KV events, each weighted by
    the fastest tier holding it (kv_index.TIER_WEIGHTS): a prefix the decode must read back from disk saves
    less prefill than one on its device, so it makes a local prefill less attractive."""
    best = 0.0
    for index in worker.kv_indexes():
        if index.page_size:
            best = max(best, index.weighted_pages(route.hashes(index.page_size)) * index.page_size)
    return min(round(best), len(route.input_ids))


def best_cached(decodes: Sequence, route: RouteRequest):
    """The decode with the longest cached prefix of the prompt (the first on a tie), and that length."""
    scored = [(cached_tokens(d, route), i) for i, d in enumerate(decodes)]
    tokens, i = max(scored, key=lambda t: (t[0], -t[1]))
    return decodes[i], tokens


def signals_for(route: RouteRequest, prefills: Sequence, decode, cached: int) -> DisaggSignals:
    """The signals for sending `route` to `decode` (which holds `cached` of its tokens) or a pair with one of
    `prefills` (the available ones)."""
    prompt = len(route.input_ids)
    return DisaggSignals(
        prompt_tokens=prompt, uncached_tokens=prompt - cached, prefill_available=bool(prefills),
        prefill_waiting=min((p.load.waiting for p in prefills), default=0),
        decode_free_tokens=decode.kv.free(), decode_total_tokens=decode.kv.total, decode_waiting=decode.load.waiting)
