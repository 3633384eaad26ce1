"""How every worker serves: a grpc.aio server carrying its SchedulerServicer, grpc.health.v1 and server reflection,
its /metrics, and a graceful drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Callable, NoReturn, Optional

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import TlsConfig, WorkerConfig
from tandem.common.gc_heap import freeze_startup_heap
from tandem.common.roles import Role
from tandem.common.rpc import admin_servicer, multiplex
from tandem.common.rpc.servicer import SchedulerServicer, WorkerInfo
from tandem.common.telemetry.metrics import WorkerMetrics, read_scheduler_stats
from tandem.common.telemetry.metrics_server import maybe_start_metrics_server
from tandem.common.telemetry.tracing import shutdown_tracing
from tandem.common.tls import add_port

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # long prompts and full-logprob responses
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class WorkerServer:
    """The worker's gRPC server. With `tls` on, its port is mutual TLS: a caller without a certificate signed by
    the CA (the router, `tandem` tools given the certificates) reaches no RPC at all. `health_port` serves
    grpc.health.v1 alone in plaintext, for probes that cannot present a certificate (the kubelet's)."""

    def __init__(self, servicer: SchedulerServicer, host: str, port: int, tls: Optional[TlsConfig] = None,
                 health_port: Optional[int] = None):
        self.servicer = servicer
        self.host = host
        self.address = f"{host}:{port}"
        self.tls = tls
        self.health_port = health_port
        self.health_server: Optional[grpc.aio.Server] = None
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])
        pb_grpc.add_SglangSchedulerServicer_to_server(servicer, self.server)
        # The runtime control calls SglangScheduler lacks (weights, memory, pause), on the same port and TLS.
        admin_servicer.apb_grpc.add_WorkerAdminServicer_to_server(
            admin_servicer.AdminServicer(servicer.engine, servicer.metrics), self.server)
        multiplex.add_to_server(servicer.Generate, self.server)  # the router's many-requests-per-message stream
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, admin_servicer.SERVICE_NAME, multiplex.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port: Optional[int] = None

    async def start(self) -> int:
        for service in ("", SERVICE_NAME):  # grpc's health servicer says SERVING for "" until told otherwise
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = add_port(self.server, self.address, self.tls)
        if not self.port:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
        if self.health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{self.host}:{self.health_port}")
            if not self.health_port:
                raise OSError(f"cannot listen on {self.host} for --health-port")
            await self.health_server.start()
        self.servicer.kv_events.start()
        return self.port

    async def set_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving %s on %s", self.servicer.info.role, SERVICE_NAME, self.address)

    async def drain(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Stop taking requests (health NOT_SERVING), let in-flight ones finish, then stop the server."""
        self.servicer.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + timeout_s
        while self.servicer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.servicer.in_flight and timeout_s > 0:
            logger.warning("drain timed out; aborting %d request(s)", len(self.servicer.in_flight))
        await self.servicer.kv_events.stop()
        await self.server.stop(grace=1.0)  # cancels what is left; Generate's cleanup aborts it in the engine
        if self.health_server is not None:
            await self.health_server.stop(grace=None)


async def serve(servicer: SchedulerServicer, host: str, port: int,
                drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                stop: Optional[asyncio.Event] = None, tls: Optional[TlsConfig] = None,
                health_port: Optional[int] = None, engine_failed: Callable[[], bool] = lambda: False) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set), then drain gracefully. Health turns SERVING, and the
    'listening' line a launcher waits for is printed, once the servicer's start-up warm-up (if any) has ended.
    When `engine_failed()` says so at the stop, nothing could finish an in-flight request (one waiting for its
    bootstrap, say, would only wait out its timeout): they are cancelled at once instead of drained."""
    server = WorkerServer(servicer, host, port, tls=tls, health_port=health_port)
    bound = await server.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    if servicer.warming is not None:  # a stop meanwhile drains at once instead of waiting for the imports
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([asyncio.wrap_future(servicer.warming), stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    if not stop.is_set():
        await server.set_serving()
        print(f"tandem {servicer.info.role} worker listening on {host}:{bound}", flush=True)
        if server.health_server is not None:
            print(f"tandem {servicer.info.role} worker health (plaintext) on {host}:{server.health_port}", flush=True)
        await stop.wait()
    if engine_failed():
        logger.info("shutting down: the engine failed; cancelling %d request(s)", len(servicer.in_flight))
        await server.drain(0.0)
        return
    logger.info("shutting down: draining %d request(s)", len(servicer.in_flight))
    await server.drain(drain_timeout_s)


def worker_info(args: argparse.Namespace, role: Role, **server_args) -> WorkerInfo:
    """What the worker reports in GetServerInfo: its CLI arguments, SGLang's names for them, and `server_args`."""
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    values = {k: v for k, v in vars(args).items() if k != "func"}
    # SGLang's server-args names, for gateways that read them.
    values.update(served_model_name=name, tp_size=getattr(args, "tp_size", 1), dp_size=1,
                  disaggregation_mode=role.disaggregation_mode, **server_args)
    values["generate_stream"] = True  # serves tandem.worker.v1.GenerateStream (the router uses it when it sees this)
    return WorkerInfo(served_model_name=name, role=role, server_args=values)


def serve_engine(engine, servicer: SchedulerServicer, metrics: WorkerMetrics, worker: WorkerConfig,
                 tls: TlsConfig) -> NoReturn:
    """Serve a loaded engine until signalled (its scheduler gauges on --metrics-port when asked), then close the
    metrics server, the engine and tracing, and exit the process: 0, or 1 after a fatal error."""
    role = servicer.info.role
    if getattr(engine, "grammar", None) is not None:
        # Like SGLang, a server loads its grammar backend at start-up (in the background): a first constrained
        # request must not wait seconds for xgrammar and the tokenizer (smg gives up on a silent prefill after 3 s).
        servicer.warming = engine.grammar.warm_up()
    metrics.watch_scheduler(lambda: engine.call(read_scheduler_stats, 2.0))
    metrics_server = None
    try:
        metrics_server = maybe_start_metrics_server(metrics.exposition(servicer.info.served_model_name),
                                                    worker.host, worker)
        if metrics_server is not None:
            print(f"tandem {role} worker metrics on http://{worker.host}:{metrics_server.port}/metrics", flush=True)
        # loaded: collections while serving, and the last one at exit, skip what start-up built
        logger.info("froze %d start-up objects out of garbage collection", freeze_startup_heap())
        # libuv's loop: less CPU per streamed message on a loop that shares the GIL with the model thread.
        uvloop.run(_serve_until_fatal(engine, servicer, worker, tls))
    finally:
        if metrics_server is not None:
            metrics_server.close()
        engine.shutdown()
        shutdown_tracing()
    code = 0
    if engine.fatal is not None:
        print(f"tandem {role} worker stopped: {engine.fatal}", file=sys.stderr, flush=True)
        code = 1
    # Everything is closed: leave without the interpreter's finalization, where a native library's static
    # destructor meeting a still-joinable thread sometimes aborts ("terminate called without an active exception",
    # exit -6) a worker that stopped cleanly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve_until_fatal(engine, servicer: SchedulerServicer, worker: WorkerConfig, tls: TlsConfig) -> None:
    """Serve until signalled, or until the engine can no longer serve (a tensor-parallel rank died): then health
    turns NOT_SERVING, in-flight requests end (the crashed scheduler already failed them; any still waiting outside
    it are cancelled, not drained) and the worker exits non-zero, so its supervisor restarts it instead of routing
    to a worker that hangs."""
    stop = asyncio.Event()

    async def watch() -> None:
        while engine.fatal is None:
            await asyncio.sleep(0.2)
        logger.error("stopping: %s", engine.fatal)
        stop.set()

    watcher = asyncio.create_task(watch())
    try:
        await serve(servicer, worker.host, worker.port, worker.drain_timeout, stop=stop, tls=tls,
                    health_port=worker.health_port, engine_failed=lambda: engine.fatal is not None)
    finally:
        watcher.cancel()
