"""The router's HTTP listener: aiohttp's request handler behind a header-read deadline.

aiohttp closes a connection that stays idle --http-keepalive-timeout-s (from its opening, or between requests);
it has no limit on how long a request's headers may take to arrive, so a client dribbling one byte a second
(slowloris) would hold its connection until the keep-alive timeout. HeaderDeadline closes a connection whose
first request's headers are not complete --http-header-timeout-s after it opened; later requests on a kept-alive
connection are bounded by the keep-alive timeout (aiohttp closes it then unless a whole request arrived).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Callable, Optional

logger = logging.getLogger(__name__)

END_OF_HEADERS = b"\r\n\r\n"


class HeaderDeadline(asyncio.Protocol):
    """Forwards every call to aiohttp's protocol; closes the transport when the first request's headers have
    not all arrived within `timeout_s`."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float):
        self.inner = inner
        self.timeout_s = timeout_s
        self.transport: Optional[asyncio.Transport] = None
        self.deadline: Optional[asyncio.TimerHandle] = None
        self.tail = b""  # the last bytes seen, for an end of headers split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.deadline = asyncio.get_running_loop().call_later(self.timeout_s, self._expired)
        self.inner.connection_made(transport)

    def _expired(self) -> None:
        self.deadline = None
        if self.transport is not None and not self.transport.is_closing():
            logger.info("closing a connection whose request headers took over %gs", self.timeout_s)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.deadline is not None:
            seen = self.tail + data
            if END_OF_HEADERS in seen:
                self.deadline.cancel()
                self.deadline = None
            self.tail = seen[-(len(END_OF_HEADERS) - 1):]
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.transport = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def listen(handler_factory: Callable[[], asyncio.Protocol], host: str, port: int, header_timeout_s: float,
                 ssl_context: Optional[ssl.SSLContext] = None) -> asyncio.AbstractServer:
    """Listen on host:port (0: a free port) with aiohttp's handlers (`runner.server`) behind HeaderDeadline."""
    return await asyncio.get_running_loop().create_server(
        lambda: HeaderDeadline(handler_factory(), header_timeout_s), host, port, ssl=ssl_context,
        family=socket.AF_UNSPEC, reuse_address=True)


def bound_port(server: asyncio.AbstractServer) -> int:
    return server.sockets[0].getsockname()[1]
