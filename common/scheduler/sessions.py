"""Session KV pins (SGLang's sessions, worker side): a finished session turn keeps its KV locked in the RadixCache
so that the session's next turn, which continues it, finds it cached.

The router holds the session's turns and sends each with its session id and capacity (call metadata,
common/rpc/sessions.py). Here each session holds lock refs on tree nodes, one per pinned turn:

- a new pin replaces the pins it covers (its ancestors); turns on other branches stay pinned;
- the tokens a session pins (its pinned paths, shared prefixes once) stay within its capacity: a turn
  longer than the capacity pins its first `capacity` tokens (whole nodes), and older pins go first;
- all sessions together pin at most MAX_PINNED_FRACTION of the KV pool, so that requests always find room:
  past it, the least recently used session's oldest pin goes first;
- pins go on CloseSession, after --session-timeout-s idle, before the tree is reset (flush, weight
  update, memory release), and with the process.

Runs on the scheduler thread only, like the tree it locks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from tandem.common.scheduler.loop import ControlCall

if TYPE_CHECKING:
    from tandem.common.memory.radix_cache import TreeNode
    from tandem.common.scheduler.kv_cache_ops import KVCacheOps
    from tandem.common.scheduler.loop import Inbox
    from tandem.common.scheduler.req import Req


MAX_PINNED_FRACTION = 0.5


@dataclass(frozen=True)
class SessionTag:
    """The session a request is a turn of, as the router sent it."""

    id: str
    capacity: int  # tokens of KV the session may keep pinned


@dataclass
class PinnedSession:
    capacity: int
    last_used: float
    nodes: list["TreeNode"] = field(default_factory=list)  # oldest pin first


def _path(node: "TreeNode") -> Iterable["TreeNode"]:
    while not node.is_root:
        yield node
        node = node.parent


def _depth(node: "TreeNode") -> int:
    return sum(len(n.key) for n in _path(node))


def _is_ancestor(upper: "TreeNode", node: "TreeNode") -> bool:
    return any(n is upper for n in _path(node))


def pinned_tokens(nodes: Iterable["TreeNode"]) -> int:
    """Tokens on the union of the nodes' root paths."""
    seen: dict[int, int] = {}
    for node in nodes:
        for n in _path(node):
            if n.id in seen:
                break  # the rest of this path is counted already
            seen[n.id] = len(n.key)
    return sum(seen.values())


class SessionPins:
    """The sessions whose turns this worker keeps pinned, by id."""

    def __init__(self, ops: "KVCacheOps", timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.ops = ops
        self.timeout_s = timeout_s
        self.clock = clock
        self.max_pinned = int(ops.allocator.size * MAX_PINNED_FRACTION)
        self.sessions: dict[str, PinnedSession] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self.sessions)

    def pin(self, req: "Req") -> None:
        """The turn `req` finished and its KV is in the tree: lock it for its session (nothing without a
        session, or when the request's KV does not go through the tree)."""
        tag: Optional[SessionTag] = req.session
        if tag is None or not self.ops.shares(req):
            return
        session = self.sessions.pop(tag.id, None) or PinnedSession(tag.capacity, self.clock())
        self.sessions[tag.id] = session  # now the most recently used
        session.capacity, session.last_used = tag.capacity, self.clock()
        tokens = req.all_ids()[: req.kv_len]
        tree = self.ops.tree_cache
        node = tree.match_prefix(tokens, record_stats=False, namespace=self.ops.namespace(req)).last_node
        while not node.is_root and _depth(node) > session.capacity:
            node = node.parent  # the turn is longer than the session may pin: its start is what a next turn reuses
        if node.is_root:
            return
        for old in [n for n in session.nodes if _is_ancestor(n, node)]:
            session.nodes.remove(old)
            tree.dec_lock_ref(old)
        tree.inc_lock_ref(node)
        session.nodes.append(node)
        while pinned_tokens(session.nodes) > session.capacity:
            tree.dec_lock_ref(session.nodes.pop(0))
        self._within_pool_share()

    def _within_pool_share(self) -> None:
        """Release the least recently used sessions' oldest pins until all pins fit their share of the pool."""
        for session in list(self.sessions.values()):
            while session.nodes and self.pinned_tokens() > self.max_pinned:
                self.ops.tree_cache.dec_lock_ref(session.nodes.pop(0))

    def close(self, session_id: str) -> int:
        """Release the session's pins; return the tokens they held (0 for a session unknown here)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return 0
        held = pinned_tokens(session.nodes)
        for node in session.nodes:
            self.ops.tree_cache.dec_lock_ref(node)
        return held

    def expire(self) -> list[str]:
        """Close the sessions idle for longer than the timeout; return their ids."""
        now = self.clock()
        idle = [sid for sid, s in self.sessions.items() if now - s.last_used > self.timeout_s]
        for session_id in idle:
            self.close(session_id)
        return idle

    def release_all(self) -> None:
        """Every pin goes (the tree is about to be reset): the sessions' next turns recompute."""
        for session_id in list(self.sessions):
            self.close(session_id)

    def pinned_tokens(self) -> int:
        """Tokens pinned by any session (a prefix shared by several sessions counted once)."""
        return pinned_tokens(n for s in self.sessions.values() for n in s.nodes)


class SessionExpiry:
    """A daemon thread that asks the scheduler, a few times per timeout, to release the idle sessions' pins
    (a control call: the pins are the scheduler thread's)."""

    def __init__(self, inbox: "Inbox", timeout_s: float):
        self.inbox = inbox
        self.period = min(timeout_s / 4, 30.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-expiry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.inbox.put(ControlCall(lambda s: s.sessions.expire()))

    def stop(self) -> None:
        self._stop.set()
