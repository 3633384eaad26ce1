"""The served worker's data-parallel replicas: one `tandem worker` process per DP rank on 127.0.0.1.

One process per replica, as SGLang does: each has its own GIL (two replicas really run at once), and a replica
that dies takes only itself down, which the controller sees (`ReplicaSet.dead`) and reports as NOT_SERVING.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from tandem.common.config import ConfigError, EngineConfig, TlsConfig, TransferFlags, WorkerConfig
from tandem.common.flags import to_argv

_LISTENING = re.compile(r"worker listening on 127\.0\.0\.1:(\d+)")


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One replica's engine: the same flags at --dp-size 1, a seed of its own so replicas do not sample alike."""
    return dataclasses.replace(config, dp_size=1, seed=config.seed + rank)


def replica_gpus(config: EngineConfig, rank: int, visible: Optional[str]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES of replica `rank` on CUDA: its own tp_size x pp_size GPUs, the next ones after the
    previous replica's (counted from --device cuda:N's N, within the worker's own CUDA_VISIBLE_DEVICES); None on
    CPU. Each replica then numbers its GPUs from 0, as a worker alone on them would."""
    if not config.device.startswith("cuda"):
        return None
    per_replica = config.tp_size * config.pp_size
    base = int(config.device.split(":", 1)[1]) if ":" in config.device else 0
    first = base + rank * per_replica
    ids = visible.split(",") if visible else [str(i) for i in range(first + per_replica)]
    mine = ids[first:first + per_replica]
    if len(mine) < per_replica:
        raise ConfigError(f"--dp-size {config.dp_size} x --tp-size {config.tp_size} x --pp-size {config.pp_size} "
                          f"needs {config.dp_size * per_replica} GPUs from {config.device}; CUDA_VISIBLE_DEVICES "
                          f"shows {len(ids)}")
    return ",".join(mine)


def unified_command(rank: int) -> list[str]:
    return ["worker"]


def replica_command(config: EngineConfig, worker: WorkerConfig, rank: int, tls: Optional[TlsConfig] = None,
                    role_argv: Callable[[int], list[str]] = unified_command) -> tuple[list[str], dict]:
    """The command and environment of DP rank `rank`: the same engine flags at --dp-size 1, gRPC on a free
    loopback port (metrics stay on the controller's port). With mutual TLS the replica demands it too: loopback is
    reachable by any local process, and nothing internal serves a peer it has not authenticated. `role_argv(rank)`:
    the subcommand and its role's own flags (a prefill's or decode's KV-transfer flags)."""
    gpus = replica_gpus(config, rank, os.environ.get("CUDA_VISIBLE_DEVICES"))
    replica = replica_config(config, rank)
    if gpus is not None:
        replica = dataclasses.replace(replica, device="cuda")
    engine_argv, engine_env = to_argv(replica, "TANDEM_")
    if tls is not None and tls.enabled:
        engine_argv += ["--tls-ca-file", tls.tls_ca_file, "--tls-cert-file", tls.tls_cert_file,
                        "--tls-key-file", tls.tls_key_file]
        if tls.tls_server_name:
            engine_argv += ["--tls-server-name", tls.tls_server_name]
    served = ["--served-model-name", worker.served_model_name] if worker.served_model_name else []
    argv = [sys.executable, "-m", "tandem.common.cli", *role_argv(rank), *engine_argv, "--dp-size", "1",
            "--host", "127.0.0.1", "--port", "0", "--drain-timeout", str(worker.drain_timeout),
            "--profile-dir", worker.profile_dir, *served]
    # The replica's flags are the whole truth: no engine or KV-transfer variable of the controller's overrides them.
    _, transfer_env = to_argv(TransferFlags(), "TANDEM_")
    env = {k: v for k, v in os.environ.items()
           if k not in engine_env and k not in transfer_env and not k.startswith("TANDEM_TLS")}
    env["PYTHONUNBUFFERED"] = "1"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return argv, env


@dataclasses.dataclass
class Replica:
    rank: int
    proc: subprocess.Popen
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class ReplicaSet:
    """Starts the replicas, relays their output with a `[dp N]` prefix, and stops them."""

    def __init__(self, config: EngineConfig, worker: WorkerConfig, tls: Optional[TlsConfig] = None,
                 role_argv: Callable[[int], list[str]] = unified_command):
        self.replicas: list[Replica] = []
        self._ready = [threading.Event() for _ in range(config.dp_size)]
        for rank in range(config.dp_size):
            argv, env = replica_command(config, worker, rank, tls, role_argv)
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.replicas.append(Replica(rank, proc))
            threading.Thread(target=self._relay, args=(rank,), name=f"dp-{rank}-log", daemon=True).start()

    def _relay(self, rank: int) -> None:
        replica = self.replicas[rank]
        for line in replica.proc.stdout:
            match = _LISTENING.search(line)
            if match and not replica.port:
                replica.port = int(match.group(1))
                self._ready[rank].set()
                continue  # the controller's own line names every replica; this one would look like the worker's
            sys.stderr.write(f"[dp {rank}] {line}")
        self._ready[rank].set()  # exited: wait_ready sees it

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every replica listens; raises RuntimeError naming the first that exited or timed out."""
        deadline = time.monotonic() + timeout_s
        for replica, ready in zip(self.replicas, self._ready):
            if not ready.wait(max(deadline - time.monotonic(), 0)) or not replica.port:
                code = replica.proc.poll()
                why = f"exited with code {code}" if code is not None else f"did not listen within {timeout_s:.0f} s"
                raise RuntimeError(f"data-parallel replica {replica.rank} {why}")

    def dead(self) -> Optional[Replica]:
        """The first replica whose process has exited, if any."""
        return next((r for r in self.replicas if r.proc.poll() is not None), None)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every replica (each drains), then kill what is left after `timeout_s`."""
        for replica in self.replicas:
            if replica.proc.poll() is None:
                replica.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            try:
                replica.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait()
