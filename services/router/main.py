"""`tandem router`: the OpenAI-compatible HTTP gateway (and optional gRPC API) over Tandem's workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Optional

import uvloop
from aiohttp import web

from tandem.common.flags import refuse_abbreviations
from tandem.common.telemetry.tracing import setup_tracing, shutdown_tracing
from tandem.common.tls import check_readable, https_context, public_server_credentials
from tandem.services.router.config import RouterConfig, add_router_args, config_from_args
from tandem.services.router.gateway import Gateway
from tandem.services.router.grpc_api import GrpcApi
from tandem.services.router.http_api import build_app
from tandem.services.router.http_server import bound_port, listen

logger = logging.getLogger(__name__)


async def start_grpc_api(gateway: Gateway, config: RouterConfig):
    """The tandem.router.v1 server, on TLS with --ssl-certfile/--ssl-keyfile; returns (api, bound port)."""
    api = GrpcApi(gateway)
    credentials = (public_server_credentials(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile
                   else None)
    return api, await api.start(config.host, config.grpc_port, credentials)


async def serve(config: RouterConfig, stop: Optional[asyncio.Event] = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set)."""
    setup_tracing("tandem-router")
    gateway = Gateway(config)
    await gateway.start()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its worker legs.
    runner = web.AppRunner(build_app(gateway), handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.http_keepalive_timeout_s)
    await runner.setup()
    ssl_context = https_context(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile else None
    listener = await listen(runner.server, config.host, config.port, config.http_header_timeout_s, ssl_context)
    grpc_api = None
    if config.grpc_port is not None:
        grpc_api, grpc_port = await start_grpc_api(gateway, config)
        print(f"tandem router gRPC API listening on {config.host}:{grpc_port}", flush=True)
    http_port = bound_port(listener)
    scheme = "https" if ssl_context is not None else "http"
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    print(f"tandem router listening on {config.host}:{http_port} ({scheme})", flush=True)
    try:
        await stop.wait()
    finally:
        logger.info("router shutting down")
        if grpc_api is not None:
            await grpc_api.stop()
        listener.close()
        await runner.cleanup()
        await gateway.stop()
        shutdown_tracing()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    check_readable(config.tls)
    uvloop.run(serve(config))  # libuv's loop: less CPU per streamed chunk than asyncio's own (docs/performance.md)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="OpenAI-compatible HTTP (and gRPC) gateway over prefill/decode "
                                             "pairs or unified workers")
    add_router_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem-router")
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = refuse_abbreviations(parser).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ValueError as e:
        print(f"tandem router: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m tandem.services.router.main router --worker grpc://HOST:PORT
    sys.exit(main())
