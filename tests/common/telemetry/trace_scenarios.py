"""Processes for the tracing tests (a TracerProvider is global per process, so each side runs in its own):
`python -m tests.common.telemetry.trace_scenarios router|prefill|decode|unified [METADATA_JSON]`.

router: a client request with a traceparent → request, tokenize and route spans; prints a JSON line with the
gRPC metadata it would send to the workers and its trace id. A worker role: builds a RequestTrace from that
metadata and records its timeline on a separate "scheduler" thread, as a worker does, then finishes it."""

from __future__ import annotations

import json
import sys
import threading
import time

from tandem.common.telemetry import propagation, tracing

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


def run_router() -> dict:
    headers = {"Traceparent": CLIENT_TRACEPARENT, "Content-Type": "application/json"}
    parent = propagation.extract_http(headers)
    attrs = tracing.request_attributes(model="tiny", max_tokens=8, temperature=0.5, request_id="chatcmpl-1")
    with tracing.router_request_span(parent=parent, attributes=attrs) as span:
        trace_id = propagation.current_trace_id()
        with tracing.router_tokenize_span() as tok:
            tracing.set_attributes(tok, {tracing.ATTR_INPUT_TOKENS: 12})
        with tracing.router_route_span(policy="cache_aware") as route:
            tracing.set_route(route, prefill="10.0.0.1:30000", decode="10.0.0.2:30000", room=42)
        metadata = propagation.inject_grpc([("authorization", "Bearer x")])
        tracing.add_event(span, "first_token")
        tracing.set_attributes(span, tracing.usage_attributes(12, 3, 4, ["stop"]))
    return {"metadata": metadata, "trace_id": trace_id}


def run_worker(role: str, metadata: list) -> dict:
    trace = tracing.start_request_trace(role, [tuple(m) for m in metadata], model="tiny", max_tokens=8,
                                        temperature=0.5, request_id="chatcmpl-1", room=42)

    def scheduler_thread() -> None:  # what the scheduler loop records
        if role == "prefill":
            trace.mark("bootstrap_end")
            time.sleep(0.01)
            trace.mark("queue_wait_end")
            trace.chunk(8)
            trace.mark("transfer_start")
            trace.chunk(4)
            trace.mark("forward_end")
            time.sleep(0.01)
            trace.transfer(4096, 3)
        elif role == "decode":
            time.sleep(0.01)
            trace.mark("prealloc_end")
            trace.transfer(4096, 3, seconds=0.005)
            trace.set(tracing.ATTR_CACHED_TOKENS, 4)
            trace.mark("first_token")
            time.sleep(0.01)
        else:
            trace.mark("queue_wait_end")
            trace.chunk(12)
            trace.mark("forward_end")
            trace.mark("first_token")

    thread = threading.Thread(target=scheduler_thread)
    thread.start()
    thread.join()
    trace.finish(output_tokens=3, finish_reason="stop", input_tokens=12)
    trace.finish(output_tokens=99)  # a second finish does nothing
    return {"recording": trace.recording}


def run_grpc_hop() -> dict:
    """A real gRPC call: the client injects into its metadata, the aio server builds a RequestTrace from
    context.invocation_metadata() — the exact shapes the router and the worker servicer use."""
    import asyncio

    import grpc

    async def handler(request: bytes, context) -> bytes:
        trace = tracing.start_request_trace("decode", context.invocation_metadata(), request_id="hop")
        trace.mark("first_token")
        trace.finish(output_tokens=1, finish_reason="length")
        return b"ok"

    async def hop() -> str:
        server = grpc.aio.server()
        method = grpc.unary_unary_rpc_method_handler(handler)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Hop", {"Call": method})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/test.Hop/Call")
                with tracing.router_request_span():
                    trace_id = propagation.current_trace_id()
                    await call(b"x", metadata=propagation.inject_grpc([]), timeout=10)
            return trace_id
        finally:
            await server.stop(None)

    return {"trace_id": asyncio.run(hop())}


def run_http_router() -> dict:
    """aiohttp_tracing on a real aiohttp app: a streamed reply and an error reply both name their trace."""
    import asyncio

    import aiohttp
    from aiohttp import web

    async def stream(request):
        with tracing.router_tokenize_span():
            pass
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def bad(request):
        return web.json_response({"error": "bad"}, status=400)

    async def serve() -> dict:
        app = web.Application()
        propagation.aiohttp_tracing(app)
        app.router.add_post("/v1/stream", stream)
        app.router.add_post("/v1/bad", bad)
        app.router.add_get("/health", bad)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        out = {}
        async with aiohttp.ClientSession() as session:
            for path, method in (("/v1/stream", "POST"), ("/v1/bad", "POST"), ("/health", "GET")):
                async with session.request(method, base + path, headers={"traceparent": CLIENT_TRACEPARENT}) as r:
                    await r.read()
                    out[path] = [r.status, r.headers.get(propagation.TRACE_ID_HEADER)]
        await runner.cleanup()
        return out

    return asyncio.run(serve())


def main(argv: list[str]) -> int:
    role = argv[0]
    enabled = tracing.setup_tracing(f"tandem-{role}")
    if role == "router":
        out = run_router()
    elif role == "http_router":
        out = run_http_router()
    elif role == "grpc_hop":
        out = run_grpc_hop()
    else:
        out = run_worker(role, json.loads(argv[1]) if len(argv) > 1 else [])
    out["enabled"] = enabled
    out["tracing_enabled"] = tracing.tracing_enabled()
    tracing.shutdown_tracing()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
