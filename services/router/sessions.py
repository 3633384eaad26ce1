"""Sessions (SGLang's session API): a tree of turns whose tokens a new turn continues, and the worker that
holds the session's KV.

A turn's context is its prompt plus its output. A request with `session_params` is appended to a parent
turn's context: `rid` names the parent (default: the session's last turn), `offset` keeps only the
parent context's first tokens, `replace` drops the parent's other children. The router keeps the tokens;
the worker that served the last turn keeps the KV pinned (common/scheduler/sessions.py), so the router
sends the next turn there.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.common.rpc.sessions import session_metadata
from tandem.services.router.errors import ApiError, bad_request

SESSION_FIELDS = ("id", "rid", "offset", "replace")
MAX_SESSION_ID_CHARS = 256


@dataclass(frozen=True)
class SessionParams:
    """A request's `session_params`: which session, and which of its turns it continues and how."""

    id: str
    rid: Optional[str] = None
    offset: int = 0  # 0: the parent's whole context
    replace: bool = False


@dataclass
class Turn:
    rid: str
    parent: Optional["Turn"]
    tokens: list[int]  # the turn's prompt + output: what its children continue
    children: list["Turn"] = field(default_factory=list)


@dataclass
class SessionTurn:
    """One request's place in its session: what the dispatcher tells the worker, and where the turn ran."""

    session_id: str
    capacity: int
    parent: Optional[Turn]
    replace: bool
    home: Optional[Any] = None  # the endpoint that served the session's last turn: it holds the KV to reuse
    worker: Optional[Any] = None  # the endpoint of the worker that holds this turn's KV (set by the dispatcher)

    def metadata(self) -> list[tuple[str, str]]:
        return session_metadata(self.session_id, self.capacity)


class Session:
    """The turns of one session; a turn joins the tree only once it finished."""

    def __init__(self, session_id: str, capacity: int):
        self.id = session_id
        self.capacity = capacity
        self.turns: dict[str, Turn] = {}
        self.last: Optional[Turn] = None
        self.worker: Optional[Any] = None  # endpoint that served the last turn: the next one goes there
        self.workers: set = set()  # every endpoint that may still pin this session's KV
        self.last_used = time.monotonic()

    def begin(self, params: SessionParams, input_ids: list[int], bos_token_id: Optional[int] = None
              ) -> tuple[list[int], SessionTurn]:
        """The turn's whole prompt (the parent's context, cut at `offset`, then `input_ids`, its BOS dropped) and
        its SessionTurn; 400 naming the field on a rid not in the session, an offset past the parent's context or
        a prompt over the session's capacity."""
        self.last_used = time.monotonic()
        parent = self.last
        if params.rid is not None:
            parent = self.turns.get(params.rid)
            if parent is None:
                raise bad_request("session_params.rid", f"{params.rid!r} is not a finished turn of session "
                                                        f"{self.id!r}")
        prompt = list(input_ids)
        if parent is not None:
            context = parent.tokens
            if params.offset > len(context):
                raise bad_request("session_params.offset", f"{params.offset} is past the end of turn "
                                                           f"{parent.rid!r}'s {len(context)} tokens")
            if bos_token_id is not None and prompt[:1] == [bos_token_id]:
                prompt = prompt[1:]  # an appended turn continues a sequence that already began
            prompt = context[: params.offset or len(context)] + prompt
        elif params.offset:
            raise bad_request("session_params.offset", "the session has no turn to continue yet")
        if len(prompt) > self.capacity:
            raise bad_request("session_params.id", f"the turn's prompt ({len(prompt)} tokens with the session's "
                                                   f"context) exceeds session {self.id!r}'s capacity_of_str_len "
                                                   f"({self.capacity})")
        return prompt, SessionTurn(self.id, self.capacity, parent, params.replace, home=self.worker)

    def finish(self, rid: str, turn: SessionTurn, tokens: list[int]) -> None:
        """Record a finished turn (prompt + output `tokens`) as the child of its parent, and where it ran."""
        node = Turn(rid, turn.parent, tokens)
        if turn.parent is not None:
            if turn.replace:
                for child in turn.parent.children:
                    self._drop(child)
                turn.parent.children = []
            turn.parent.children.append(node)
        self.turns[rid] = node
        self.last = node
        self.last_used = time.monotonic()
        if turn.worker is not None:
            self.worker = turn.worker
            self.workers.add(turn.worker)

    def _drop(self, turn: Turn) -> None:
        self.turns.pop(turn.rid, None)
        for child in turn.children:
            self._drop(child)
        if self.last is turn:
            self.last = turn.parent


class SessionRegistry:
    """The router's open sessions, by id; idle ones close after `timeout_s`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.sessions: dict[str, Session] = {}

    def open(self, capacity: int, session_id: Optional[str] = None) -> Session:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise bad_request("session_id", f"session {session_id!r} is already open")
        session = self.sessions[session_id] = Session(session_id, capacity)
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise bad_request("session_params.id", f"no open session {session_id!r}")
        return session

    def close(self, session_id: str) -> Session:
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise bad_request("session_id", f"no open session {session_id!r}")
        return session

    def expire(self, now: Optional[float] = None) -> list[Session]:
        """Close (and return) the sessions idle for longer than the timeout."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self.sessions.values() if now - s.last_used > self.timeout_s]
        for session in idle:
            del self.sessions[session.id]
        return idle


# ---- request bodies ----------------------------------------------------------------------------------------

def parse_session_params(data: dict) -> Optional[SessionParams]:
    """A body's `session_params` (None when absent); 400 naming the field when malformed."""
    raw = data.get("session_params")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("session_params", "expected an object")
    for name in raw:
        if name not in SESSION_FIELDS:
            raise bad_request(f"session_params.{name}", f"unknown field (known: {', '.join(SESSION_FIELDS)})")
    session_id = _session_id(raw.get("id"), "session_params.id")
    if session_id is None:
        raise bad_request("session_params.id", "required")
    rid = raw.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise bad_request("session_params.rid", "expected a string")
    offset = raw.get("offset")
    if offset is None:
        offset = 0
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise bad_request("session_params.offset", f"expected an integer >= 0, got {offset!r}")
    replace = raw.get("replace")
    if replace is not None and not isinstance(replace, bool):
        raise bad_request("session_params.replace", "expected a boolean")
    return SessionParams(session_id, rid, offset, bool(replace))


def parse_open_session(data: Any) -> tuple[int, Optional[str]]:
    """`/open_session`'s body: (capacity_of_str_len, session_id or None)."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in data:
        if name not in ("capacity_of_str_len", "session_id"):
            raise bad_request(name, "unknown field for /open_session")
    capacity = data.get("capacity_of_str_len")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise bad_request("capacity_of_str_len", f"expected an integer >= 1, got {capacity!r}")
    return capacity, _session_id(data.get("session_id"), "session_id")


def parse_close_session(data: Any) -> str:
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    session_id = _session_id(data.get("session_id"), "session_id")
    if session_id is None:
        raise bad_request("session_id", "required")
    return session_id


def _session_id(value: Any, name: str) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID_CHARS or not (value.isascii() and value.isprintable()):
        raise bad_request(name, f"expected a non-empty printable ASCII string of at most {MAX_SESSION_ID_CHARS} "
                                "characters")
    return value
