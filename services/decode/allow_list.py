"""The decode's --allowed-bootstrap list: which prefill bootstrap servers a Generate may make this decode connect
to (and hand its NIXL metadata and pool addresses to)."""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Iterable

RESOLVE_EVERY_S = 10.0  # a name's addresses are looked up again after this long (pods come and go)


def _network(host: str):
    try:
        return ipaddress.ip_network(host.strip("[]"), strict=False)
    except ValueError:
        return None


class BootstrapAllowList:
    """HOST:PORT entries. HOST is an address (matches itself), a CIDR network (matches the addresses in it) or a
    DNS name (matches itself and the addresses it resolves to, e.g. a headless Service's pods: the router names
    prefills by IP)."""

    def __init__(self, entries: Iterable[str]):
        self.entries = tuple(entries)
        self._networks: list[tuple[object, int]] = []
        self._names: list[tuple[str, int]] = []
        for entry in self.entries:
            host, _, port = entry.rpartition(":")
            network = _network(host)
            if network is not None:
                self._networks.append((network, int(port)))
            else:
                self._names.append((host.lower(), int(port)))
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}  # name -> (when, addresses)

    def allows(self, host: str, port: int) -> bool:
        address = _network(host)
        if address is not None and address.num_addresses == 1:
            ip = address.network_address
            if any(port == p and ip in net for net, p in self._networks if net.version == ip.version):
                return True
        host = host.strip("[]").lower()
        for name, p in self._names:
            if p == port and (host == name or host in self._addresses(name)):
                return True
        return False

    def _addresses(self, name: str) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolved.get(name)
        if cached is None or now - cached[0] > RESOLVE_EVERY_S:
            try:
                found = frozenset(info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))
            except OSError:
                found = cached[1] if cached else frozenset()  # a DNS blip keeps what we knew
            cached = self._resolved[name] = (now, found)
        return cached[1]

    def __str__(self) -> str:
        return ",".join(self.entries)
