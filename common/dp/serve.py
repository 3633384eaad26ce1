"""`tandem worker|prefill|decode --dp-size N`: start the N replica processes, then serve the controller on the
worker's port (and, for a prefill, the bootstrap proxy on its bootstrap port)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time
from typing import Optional

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from google.protobuf import json_format
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.config import ConfigError, EngineConfig, TlsConfig, TransferFlags, WorkerConfig
from tandem.common.dp.admin_proxy import DPAdminProxy
from tandem.common.dp.balance import DPBalancer
from tandem.common.dp.bootstrap_proxy import BootstrapProxy, RoomRanks, start_bootstrap_proxy
from tandem.common.dp.controller import DPControllerServicer
from tandem.common.dp.replicas import ReplicaSet
from tandem.common.flags import to_argv
from tandem.common.roles import Role
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.common.rpc import multiplex
from tandem.common.rpc.admin_servicer import SERVICE_NAME as ADMIN_SERVICE_NAME
from tandem.common.rpc.server import MAX_MESSAGE_BYTES, SERVICE_NAME
from tandem.common.tls import add_port
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
REPLICA_START_TIMEOUT_S = 900.0  # every replica loads the model (and may compile decode graphs) at once
WATCH_INTERVAL_S = 0.2


@dataclasses.dataclass
class DPRole:
    """What a data-parallel worker's role adds: a prefill's or decode's KV-transfer flags, which every replica
    gets with an engine id of its own (`<engine id>-dp<rank>`: a prefill tells decodes apart by engine id, so two
    decode replicas must not share one), and a prefill's bootstrap address, where the proxy listens (the replicas'
    own bootstrap servers take free loopback ports)."""

    role: Role = Role.UNIFIED
    transfer: Optional[TransferFlags] = None
    engine_id: str = ""
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0

    def replica_argv(self, rank: int) -> list[str]:
        """The subcommand and role flags of replica `rank`."""
        if self.role is Role.UNIFIED:
            return ["worker"]
        default_port = TransferFlags().bootstrap_port  # a decode has no --bootstrap-port: leave it unwritten
        flags = dataclasses.replace(self.transfer, engine_id=f"{self.engine_id}-dp{rank}",
                                    bootstrap_port=0 if self.role is Role.PREFILL else default_port)
        return [self.role.value, *to_argv(flags, "TANDEM_")[0]]


def run_data_parallel(config: EngineConfig, worker: WorkerConfig, tls: TlsConfig, server_args: dict,
                      role: DPRole = DPRole()) -> int:
    """Serve until signalled (exit 0) or until a replica dies (health NOT_SERVING, drain, exit 1)."""
    if worker.metrics_port is not None:
        raise ConfigError("--metrics-port with --dp-size > 1 is not implemented yet (each replica keeps its own "
                          "registry); read per-rank load from GetLoads")
    replicas = ReplicaSet(config, worker, tls, role.replica_argv)
    try:
        try:
            replicas.wait_ready(REPLICA_START_TIMEOUT_S)
        except RuntimeError as e:  # its own output, relayed above, says why
            print(f"tandem {role.role} worker: {e}", file=sys.stderr, flush=True)
            return 1
        balancer = DPBalancer(config.dp_size, config.load_balance_method)
        args = {**server_args, "dp_size": config.dp_size, "load_balance_method": config.load_balance_method}
        failed = uvloop.run(_serve(lambda: DPControllerServicer([r.address for r in replicas.replicas], balancer,
                                                                args, tls), replicas, worker, tls, role))
    finally:
        replicas.stop(worker.drain_timeout + 5)
    return 1 if failed else 0


async def _replica_bootstrap_ports(servicer: DPControllerServicer) -> list[int]:
    """Each prefill replica's own bootstrap port, from its server info."""
    infos = await asyncio.gather(*(s.GetServerInfo(pb.GetServerInfoRequest(), timeout=30) for s in servicer.stubs))
    return [int(json.loads(json_format.MessageToJson(i.server_args))["disaggregation_bootstrap_port"])
            for i in infos]


async def _start_bootstrap(servicer: DPControllerServicer, role: DPRole, tls: TlsConfig):
    """A prefill's bootstrap proxy on its --bootstrap-port, advertised as the worker's bootstrap port."""
    ports = await _replica_bootstrap_ports(servicer)
    servicer.rooms = RoomRanks(len(ports))
    proxy = BootstrapProxy([f"127.0.0.1:{p}" for p in ports], servicer.rooms, role.engine_id, tls)
    server, bound = await start_bootstrap_proxy(proxy, role.bootstrap_host, role.bootstrap_port, tls)
    servicer.server_args["disaggregation_bootstrap_port"] = bound
    print(f"tandem prefill bootstrap server listening on {role.bootstrap_host}:{bound} (in front of the replicas' "
          f"{', '.join(map(str, ports))})", flush=True)
    return proxy, server


async def _serve(make_servicer, replicas: ReplicaSet, worker: WorkerConfig, tls: TlsConfig, role: DPRole) -> bool:
    """The controller's gRPC server; True when it stopped because a replica died. The servicer is made here:
    its replica channels belong to this event loop."""
    servicer: DPControllerServicer = make_servicer()
    bootstrap = await _start_bootstrap(servicer, role, tls) if role.role is Role.PREFILL else None
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    apb_grpc.add_WorkerAdminServicer_to_server(DPAdminProxy(servicer.channels), server)
    multiplex.add_to_server(servicer.Generate, server)  # the router's stream, over the controller's Generate
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, multiplex.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = add_port(server, f"{worker.host}:{worker.port}", tls)
    if not port:
        raise OSError(f"cannot listen on {worker.host}:{worker.port}")
    await server.start()
    health_server = await _start_health_port(health_servicer, worker)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"tandem {role.role} worker listening on {worker.host}:{port} ({len(replicas.replicas)} data-parallel "
          f"replicas: {', '.join(r.address for r in replicas.replicas)})", flush=True)
    watcher = asyncio.create_task(_watch(servicer, replicas, stop))
    await stop.wait()
    watcher.cancel()
    await _drain(servicer, server, health_servicer, worker.drain_timeout)
    if health_server is not None:
        await health_server.stop(grace=None)
    if bootstrap is not None:  # after the drain: rooms in flight still reach their replica
        proxy, bootstrap_server = bootstrap
        await bootstrap_server.stop(grace=1.0)
        await proxy.close()
    await servicer.close()
    return servicer.dead_rank is not None


async def _watch(servicer: DPControllerServicer, replicas: ReplicaSet, stop: asyncio.Event) -> None:
    """A replica that exits takes the worker out of service: its requests already failed with its connection,
    the others finish, and the worker exits non-zero so its supervisor restarts the whole set."""
    while (dead := replicas.dead()) is None:
        await asyncio.sleep(WATCH_INTERVAL_S)
    servicer.dead_rank = dead.rank
    servicer.balancer.mark_dead(dead.rank)
    logger.error("data-parallel replica %d exited with code %s; stopping", dead.rank, dead.proc.returncode)
    print(f"tandem worker: data-parallel replica {dead.rank} exited with code {dead.proc.returncode}",
          file=sys.stderr, flush=True)
    stop.set()


async def _drain(servicer: DPControllerServicer, server, health_servicer, timeout_s: float) -> None:
    servicer.draining = True
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + timeout_s
    while servicer.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)


async def _set_health(health_servicer, status) -> None:
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, status)


async def _start_health_port(health_servicer, worker: WorkerConfig):
    """--health-port: grpc.health.v1 alone in plaintext, for probes without a client certificate."""
    if worker.health_port is None:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{worker.host}:{worker.health_port}")
    if not port:
        raise OSError(f"cannot listen on {worker.host} for --health-port")
    await server.start()
    print(f"tandem worker health (plaintext) on {worker.host}:{port}", flush=True)
    return server
