"""The router's HTTP listener closes connections that send nothing, dribble their headers (slowloris) or idle
between requests; a client that sends its request normally is served. Raw sockets, 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tandem.common.flags import ConfigError
from tandem.services.router.config import RouterConfig
from tandem.services.router.http_server import HeaderDeadline, bound_port, listen
from tests.services.router.conftest import RouterProcess, wait_until

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow-client-test\r\n\r\n"


class Answer(asyncio.Protocol):
    """Answers 'ok' once a whole request (headers) arrived; stands in for aiohttp's handler."""

    def connection_made(self, transport):
        self.transport, self.seen = transport, b""

    def data_received(self, data):
        self.seen += data
        if self.seen.endswith(b"\r\n\r\n"):
            self.transport.write(b"ok")


async def dribble(port: int, payload: bytes, every_s: float) -> tuple[int, bytes]:
    """Send `payload` a byte at a time; (bytes sent before the peer closed, what it answered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        for byte in payload:
            if reader.at_eof():
                break
            writer.write(bytes([byte]))
            await writer.drain()
            sent += 1
            await asyncio.sleep(every_s)
        answer = await asyncio.wait_for(reader.read(100), 10)
    except (ConnectionError, OSError):
        answer = b""
    writer.close()
    return sent, answer


def test_a_connection_whose_headers_are_not_complete_in_time_is_closed_a_prompt_one_is_served():
    async def scenario():
        server = await listen(Answer, "127.0.0.1", 0, header_timeout_s=0.5)
        port = bound_port(server)
        slow, prompt = await asyncio.gather(dribble(port, REQUEST, every_s=0.1),  # ~7 s for its headers
                                            dribble(port, REQUEST, every_s=0.0))
        # A client that sent its headers at once and then waits past the deadline keeps its connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\n")
        await asyncio.sleep(1.0)
        writer.write(b"body")
        patient = await asyncio.wait_for(reader.read(100), 10)
        writer.close()
        server.close()
        return slow, prompt, patient

    (slow_sent, slow_answer), (_, prompt_answer), patient = asyncio.run(scenario())
    assert slow_answer == b"" and slow_sent < len(REQUEST)  # closed before its headers were done
    assert prompt_answer == b"ok" and patient == b"ok"


def test_the_end_of_headers_split_across_reads_is_seen():
    protocol = HeaderDeadline(Answer(), timeout_s=60)

    class Transport:
        def write(self, data):
            self.written = data

        def is_closing(self):
            return False

    async def scenario():
        protocol.connection_made(Transport())
        for piece in (REQUEST[:-3], REQUEST[-3:-1], REQUEST[-1:]):
            assert protocol.deadline is not None
            protocol.data_received(piece)
        assert protocol.deadline is None
        protocol.connection_lost(None)

    asyncio.run(scenario())


def test_timeouts_must_be_positive():
    with pytest.raises(ConfigError, match="--http-header-timeout-s"):
        RouterConfig(workers=["127.0.0.1:1"], http_header_timeout_s=0).validate()
    with pytest.raises(ConfigError, match="--http-keepalive-timeout-s"):
        RouterConfig(workers=["127.0.0.1:1"], http_keepalive_timeout_s=-1).validate()


@pytest.mark.e2e
def test_the_router_closes_silent_slow_and_idle_connections_and_serves_normal_ones(tiny_llama):
    router = RouterProcess("--worker", "grpc://127.0.0.1:1", "--model-path", tiny_llama,
                           "--http-header-timeout-s", "1", "--http-keepalive-timeout-s", "2")
    try:
        silent = socket.create_connection(("127.0.0.1", router.port), timeout=30)
        assert silent.recv(100) == b""  # nothing sent: closed at the header deadline

        sent, answer = asyncio.run(dribble(router.port, REQUEST, every_s=0.25))  # ~18 s for its headers
        assert answer == b"" and sent < len(REQUEST)

        kept = socket.create_connection(("127.0.0.1", router.port), timeout=30)
        kept.sendall(REQUEST)
        first = wait_until(lambda: kept.recv(4096), 10, "the /health answer")
        assert first.startswith(b"HTTP/1.1 200")
        assert kept.recv(4096) == b""  # idle after its request: closed at the keep-alive timeout (the socket's
        # own 30 s timeout would raise instead)
    finally:
        assert router.stop() == 0
