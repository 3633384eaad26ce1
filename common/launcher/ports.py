"""The ports `tandem up` will bind, checked before it creates or loads anything: a clash is an error naming the
port and the flag that sets it, not a crash after minutes of model loading."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedPort:
    port: int  # 0: the OS picks one when the child binds (nothing to check)
    host: str
    what: str  # e.g. "router HTTP", "metrics of decode-0"
    flag: str  # the flag that sets it, e.g. "--port"


def in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails now. SO_REUSEADDR as the servers set it: a port left in TIME_WAIT by a
    stopped stack is free, one that something listens on is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(planned: list[PlannedPort]) -> None:
    """ValueError naming the first port that is out of range, asked for twice, or already in use."""
    seen: dict[int, PlannedPort] = {}
    for p in planned:
        if p.port == 0:
            continue
        if not 0 < p.port < 65536:
            raise ValueError(f"port {p.port} ({p.what}) is not a port number; change {p.flag}")
        if p.port in seen:
            other = seen[p.port]
            raise ValueError(f"port {p.port} is asked for twice: {other.what} ({other.flag}) and {p.what} "
                             f"({p.flag}); change one of them")
        seen[p.port] = p
        if in_use(p.host, p.port):
            raise ValueError(f"port {p.port} ({p.what}) is already in use on {p.host}; stop what holds it or "
                             f"choose another with {p.flag} (0 picks a free one)")
