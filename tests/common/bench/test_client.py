"""The bench client's SSE reader and its event loop."""

from __future__ import annotations

import asyncio

import uvloop

from tandem.common.bench import client


class _Content:
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


class _Response:
    def __init__(self, pieces: list[bytes]):
        self.content = _Content(pieces)


async def _events(pieces: list[bytes]) -> list[bytes]:
    return [data async for _, data in client.sse_events(_Response(pieces))]


def test_sse_events_reassembles_lines_split_across_reads_and_stops_at_done():
    stream = (b'data: {"a": 1}\n\n: a comment\n\ndata:{"b":"\xc3\xa9"}\r\n\r\n'
              b"event: x\ndata: [DONE]\n\ndata: {\"after\": 1}\n\n")
    # Cut every few bytes: events, a multi-byte character and [DONE] straddle reads.
    pieces = [stream[i:i + 5] for i in range(0, len(stream), 5)]
    events = client.run_client(_events(pieces))
    assert events == [b'{"a": 1}', b'{"b":"\xc3\xa9"}']
    assert client.orjson.loads(events[1]) == {"b": "é"}


def test_sse_events_ends_when_the_server_closes_without_done():
    assert client.run_client(_events([b'data: {"x": 2}\n\ndata: {"y"'])) == [b'{"x": 2}']


def test_run_client_runs_on_uvloop_and_returns_the_result():
    async def loop_type():
        return type(asyncio.get_running_loop())

    assert client.run_client(loop_type()) is uvloop.Loop
