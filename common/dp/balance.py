"""The data-parallel controller's choice: which replica takes the next request, from per-replica load."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from tandem.common.config import LOAD_BALANCE_METHODS


def request_tokens(input_len: int, n: int, max_new_tokens: int) -> int:
    """The KV tokens a request will hold at most: its prompt plus every sequence's new tokens."""
    return input_len + n * max_new_tokens


@dataclass
class ReplicaLoad:
    """What the controller knows of one replica (SGLang's DPBalanceMeta): the requests it holds (running and
    waiting sequences) and the KV tokens they will hold (prompt plus max_new_tokens per sequence)."""

    requests: int = 0
    tokens: int = 0
    alive: bool = True


@dataclass
class _InFlight:
    rank: int
    sequences: int
    tokens: int


@dataclass
class DPBalancer:
    """Picks a replica per request and keeps the load each dispatched request adds until it ends.

    The controller counts its own dispatches instead of polling the replicas: it sees every request start and
    end, so its view has no polling lag and two requests dispatched at once never both see an idle replica.
    Thread-safe (the served controller's loop and the offline pool's callers)."""

    dp_size: int
    method: str = "round_robin"
    loads: list[ReplicaLoad] = field(init=False)

    def __post_init__(self):
        if self.method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
                             f"got {self.method!r}")
        self.loads = [ReplicaLoad() for _ in range(self.dp_size)]
        self._next = itertools.count()
        self._rids: dict[str, _InFlight] = {}
        self._lock = threading.Lock()

    def choose(self, loads: list[ReplicaLoad]) -> int:
        """The replica for the next request, among the live ones; ties go to the lowest rank."""
        live = [rank for rank, load in enumerate(loads) if load.alive]
        if not live:
            raise RuntimeError("no data-parallel replica is alive")
        if self.method == "round_robin":
            return live[next(self._next) % len(live)]
        if self.method == "shortest_queue":
            return min(live, key=lambda rank: (loads[rank].requests, loads[rank].tokens, rank))
        return min(live, key=lambda rank: (loads[rank].tokens, loads[rank].requests, rank))

    def dispatch(self, rid: str, sequences: int, tokens: int, rank: int | None = None) -> int:
        """Choose a replica for `rid` (or take the pinned `rank`) and count its load there until `finish(rid)`."""
        with self._lock:
            if rid in self._rids:
                raise ValueError(f"request id {rid!r} is already in flight")
            if rank is None:
                rank = self.choose(self.loads)
            elif not self.loads[rank].alive:
                raise RuntimeError(f"data-parallel replica {rank} is not alive")
            self.loads[rank].requests += sequences
            self.loads[rank].tokens += tokens
            self._rids[rid] = _InFlight(rank, sequences, tokens)
            return rank

    def finish(self, rid: str) -> None:
        with self._lock:
            done = self._rids.pop(rid, None)
            if done is not None:
                self.loads[done.rank].requests -= done.sequences
                self.loads[done.rank].tokens -= done.tokens

    def rank_of(self, rid: str) -> int | None:
        with self._lock:
            done = self._rids.get(rid)
            return None if done is None else done.rank

    def mark_dead(self, rank: int) -> None:
        with self._lock:
            self.loads[rank].alive = False
