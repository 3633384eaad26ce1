"""Worker selection policies: round_robin, random, least_load, power_of_two, cache_aware.

A policy picks one of the available workers of one side (prefill, decode or unified). Workers need only
`load_score()` and, for cache_aware, `kv_index` (a KvBlockIndex): tests pass stand-ins. A policy that
`sees_dp_ranks` (cache_aware) is given each DP rank of a `--dp-size N` worker as a target of its own (a rank has its
own RadixCache); the others pick whole workers, whose DP controller then balances its ranks.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tandem.common.memory.page_hash import page_hashes


# Tokens of the prompt's start that decide an uncached prompt's home worker under cache_aware.
HOME_PREFIX_TOKENS = 64


@dataclass
class RouteRequest:
    """What policies may look at: the prompt's token ids (page hashes computed once per page size, under its
    adapter: a worker's cached prefixes count only if computed under the same adapter)."""

    input_ids: list[int]
    lora_id: str = ""  # only workers with this LoRA adapter loaded may serve it
    home: Optional[object] = None  # a session's worker endpoint: its KV holder (decode, unified) while available
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def hashes(self, page_size: int) -> list[int]:
        if page_size not in self._hashes:
            self._hashes[page_size] = page_hashes(self.input_ids, page_size, self.lora_id)
        return self._hashes[page_size]


class Policy(ABC):
    name = ""
    sees_dp_ranks = False

    @abstractmethod
    def pick(self, workers: Sequence, request: RouteRequest):
        """One of `workers` (non-empty)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def pick(self, workers, request):
        return workers[next(self._counter) % len(workers)]


class Random(Policy):
    name = "random"

    def __init__(self, rng: Optional[random.Random] = None):
        self.rng = rng or random.Random()

    def pick(self, workers, request):
        return self.rng.choice(list(workers))


def least_loaded(workers: Sequence):
    """The worker with the fewest requests; ties go to the first listed, which keeps tests deterministic."""
    return min(workers, key=lambda w: w.load_score())


class LeastLoad(Policy):
    name = "least_load"

    def pick(self, workers, request):
        return least_loaded(workers)


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded wins: near least-load balance without herding on one worker."""

    name = "power_of_two"

    def __init__(self, rng: Optional[random.Random] = None):
        self.rng = rng or random.Random()

    def pick(self, workers, request):
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(list(workers), 2)
        return a if a.load_score() <= b.load_score() else b


class CacheAware(Policy):
    """The worker holding the most of the prompt's prefix (from its KV events; each page weighted by its fastest
    tier, kv_index.TIER_WEIGHTS, so a prefix on one worker's device beats the same prefix on another's disk),
    unless that would unbalance the fleet: when loads differ by more than `abs_threshold` requests and by more
    than `rel_threshold` times, or the cache holder is that much busier than the least-loaded worker, load wins.
    A prompt no worker holds goes to its stable home among the least-loaded workers (`_home`)."""

    name = "cache_aware"
    sees_dp_ranks = True

    def __init__(self, abs_threshold: int = 8, rel_threshold: float = 1.5, min_match_pages: int = 1):
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.min_match_pages = min_match_pages

    def _imbalanced(self, busy: int, idle: int) -> bool:
        return busy - idle > self.abs_threshold and busy > self.rel_threshold * idle

    def pick(self, workers, request):
        idle = least_loaded(workers)
        if self._imbalanced(max(w.load_score() for w in workers), idle.load_score()):
            return idle
        best, best_score, best_pages = None, 0.0, 0
        for worker in workers:
            index = worker.kv_index
            if index.page_size is None or not index.blocks:
                continue
            hashes = request.hashes(index.page_size)
            score = index.weighted_pages(hashes)
            if score > best_score or (score == best_score and best is not None
                                      and worker.load_score() < best.load_score()):
                best, best_score, best_pages = worker, score, index.cached_pages(hashes)
        if best is None or best_pages < self.min_match_pages:
            return self._home(workers, request)
        return idle if self._imbalanced(best.load_score(), idle.load_score()) else best

    @staticmethod
    def _home(workers, request):
        """No worker holds the prefix: among the least-loaded, pick by a stable hash of the prompt's start, so
        new prefix groups spread over the fleet (instead of all landing on the first idle worker and evicting
        each other there) and an evicted group comes back to the same worker."""
        lowest = min(w.load_score() for w in workers)
        candidates = [w for w in workers if w.load_score() == lowest]  # registry order is stable
        start = repr((request.lora_id, request.input_ids[:HOME_PREFIX_TOKENS])).encode()
        digest = hashlib.blake2b(start, digest_size=8).digest()
        return candidates[int.from_bytes(digest, "little") % len(candidates)]


def make_policy(name: str, abs_threshold: int = 8, rel_threshold: float = 1.5) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "cache_aware":
        return CacheAware(abs_threshold, rel_threshold)
    raise ValueError(f"unknown policy {name!r}")
