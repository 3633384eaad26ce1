"""Why a KV transfer failed, as a type set where it fails, and the one table that maps each kind to a gRPC status,
a metric label and the router's decision (retry on another pair, count against a breaker, and whose)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# gRPC trailing-metadata key that carries a failed request's kind from a worker to its caller.
FAILURE_KIND_METADATA = "tandem-failure-kind"


class FailureKind(str, enum.Enum):
    BOOTSTRAP_UNREACHABLE = "bootstrap_unreachable"  # the decode cannot reach the prefill's bootstrap server
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # no pairing (registration or destination) within --bootstrap-timeout
    TRANSFER_TIMEOUT = "transfer_timeout"  # pages not all landed within --transfer-timeout
    PEER_LOST = "peer_lost"  # missed heartbeats, a restarted or vanished peer
    ABORTED = "aborted"  # a client, the router or the other leg aborted the room
    LAYOUT_MISMATCH = "layout_mismatch"  # the two KV pools cannot exchange pages
    ROOM_MISMATCH = "room_mismatch"  # completion metadata for another room: integrity check failed
    REFUSED = "refused"  # the peer refused the pairing (engine id held by another live agent, engine unknown,
    # bad agent metadata)
    ROOM_IN_USE = "room_in_use"  # another live request on this worker already holds the bootstrap_room
    TRANSFER_ERROR = "transfer_error"  # NIXL failed to WRITE or notify
    SHUTDOWN = "shutdown"  # this worker is shutting down

    def __str__(self) -> str:
        return self.value


class Blame(enum.Enum):
    """Whose circuit breaker a failure counts against, seen from the worker that reports it."""

    NOBODY = "nobody"  # overload, a client's abort, a config mismatch of the pair
    REPORTER = "reporter"  # the reporting worker itself
    PEER = "peer"  # the other leg of the pair


@dataclass(frozen=True)
class FailurePolicy:
    grpc_code: str  # grpc.StatusCode name the worker answers with
    metric_label: str  # `reason` label of tandem_kv_transfer_failures_total
    retry: bool  # router: try another pair while no token reached the client
    blame: Blame


FAILURE_POLICY: dict[FailureKind, FailurePolicy] = {
    FailureKind.BOOTSTRAP_UNREACHABLE: FailurePolicy("UNAVAILABLE", "unreachable", True, Blame.PEER),
    FailureKind.BOOTSTRAP_TIMEOUT: FailurePolicy("DEADLINE_EXCEEDED", "bootstrap_timeout", True, Blame.NOBODY),
    FailureKind.TRANSFER_TIMEOUT: FailurePolicy("DEADLINE_EXCEEDED", "transfer_timeout", True, Blame.NOBODY),
    FailureKind.PEER_LOST: FailurePolicy("UNAVAILABLE", "peer_lost", True, Blame.PEER),
    FailureKind.ABORTED: FailurePolicy("ABORTED", "aborted", True, Blame.NOBODY),
    FailureKind.LAYOUT_MISMATCH: FailurePolicy("FAILED_PRECONDITION", "layout_mismatch", True, Blame.NOBODY),
    FailureKind.ROOM_MISMATCH: FailurePolicy("DATA_LOSS", "integrity", True, Blame.PEER),
    FailureKind.REFUSED: FailurePolicy("FAILED_PRECONDITION", "refused", True, Blame.NOBODY),
    # Two live requests drew one room: the second fails at once; a retry draws a new room (dispatch.py).
    FailureKind.ROOM_IN_USE: FailurePolicy("ALREADY_EXISTS", "room_in_use", True, Blame.NOBODY),
    FailureKind.TRANSFER_ERROR: FailurePolicy("UNAVAILABLE", "transfer_error", True, Blame.NOBODY),
    FailureKind.SHUTDOWN: FailurePolicy("UNAVAILABLE", "shutdown", True, Blame.REPORTER),
}

# The setting to raise when a timeout kind fires, for error texts that name it.
TIMEOUT_FLAGS = {FailureKind.BOOTSTRAP_TIMEOUT: "--bootstrap-timeout",
                 FailureKind.TRANSFER_TIMEOUT: "--transfer-timeout"}


@dataclass(frozen=True)
class TransferFailure:
    """One room's failure: its kind (decides what happens next) and a message for people."""

    kind: FailureKind
    message: str

    @property
    def policy(self) -> FailurePolicy:
        return FAILURE_POLICY[self.kind]

    def __str__(self) -> str:
        return self.message


def failure_kind(value: str | None) -> FailureKind | None:
    """The kind a peer named (trailing metadata, a notification), or None for an unknown word."""
    try:
        return FailureKind(value) if value else None
    except ValueError:
        return None
