"""A session turn's call metadata (the router's sessions): which session a request continues, and how many
tokens of KV the session may keep pinned on the worker that serves it."""

from __future__ import annotations

from typing import Iterable, Optional

from tandem.common.errors import InvalidRequestError
from tandem.common.scheduler.sessions import SessionTag

SESSION_ID_KEY = "tandem-session-id"
SESSION_CAPACITY_KEY = "tandem-session-capacity"


def session_metadata(session_id: str, capacity: int) -> list[tuple[str, str]]:
    return [(SESSION_ID_KEY, session_id), (SESSION_CAPACITY_KEY, str(capacity))]


def session_tag(metadata: Iterable[tuple[str, str]]) -> Optional[SessionTag]:
    """The call's session (None when it carries none); InvalidRequestError naming the key when the id comes
    without a capacity (a decimal >= 1) or either is given twice."""
    found: dict[str, list[str]] = {SESSION_ID_KEY: [], SESSION_CAPACITY_KEY: []}
    for key, value in metadata:
        if key in found:
            found[key].append(value.decode() if isinstance(value, bytes) else value)
    ids, capacities = found[SESSION_ID_KEY], found[SESSION_CAPACITY_KEY]
    if not ids and not capacities:
        return None
    if len(ids) != 1 or not ids[0]:
        raise InvalidRequestError(f"{SESSION_ID_KEY}: expected one non-empty session id, got {ids!r}",
                                  SESSION_ID_KEY)
    if len(capacities) != 1 or not (capacities[0].isascii() and capacities[0].isdigit()) or int(capacities[0]) < 1:
        raise InvalidRequestError(f"{SESSION_CAPACITY_KEY}: expected one decimal number of tokens >= 1, got "
                                  f"{capacities!r}", SESSION_CAPACITY_KEY)
    return SessionTag(ids[0], int(capacities[0]))
