"""The processes one `tandem bench report` section starts on 127.0.0.1 — workers pinned to cores, routers — and
their clean stop. Each is a `tandem.common.launcher.children.Child`, as in `tandem up`."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.launcher.children import BOOTSTRAP_LISTENING, Child, stop_all

REPO_ROOT = str(Path(__file__).resolve().parents[2])  # children import the same tree as this process
HOST = "127.0.0.1"
WORKER_LISTENING = r"worker listening on 127\.0\.0\.1:(\d+)"
ROUTER_LISTENING = r"tandem router listening on \S+:(\d+)"
# Engine flags of every worker (docs/performance-history.md, "Machine and method"); later flags override them.
ENGINE_FLAGS = ("--max-total-tokens", "32768", "--max-context-len", "4096")
STOP_TIMEOUT_S = 20.0


def tree_import_path(tree: str, scratch: Path) -> str:
    """A folder to put first on a child's PYTHONPATH so that `tandem.common` / `tandem.services` import from `tree`
    (another checkout), not from the installed copy: `tandem/common` and `tandem/services` linked to its folders
    (`tandem` is a namespace package, so this portion comes before the installed one)."""
    root = scratch / f"import-path-{hashlib.sha1(tree.encode()).hexdigest()[:8]}"
    package = root / "tandem"
    package.mkdir(parents=True, exist_ok=True)
    for part in ("common", "services"):
        link = package / part
        if link.is_symlink():
            link.unlink()
        link.symlink_to(Path(tree).resolve() / part, target_is_directory=True)
    return str(root)


def can_pin(cores: str) -> bool:
    """taskset is installed and this process may run on every listed core (CI runners often have fewer)."""
    wanted = {int(c) for c in cores.split(",")}
    return shutil.which("taskset") is not None and wanted <= os.sched_getaffinity(0)


@dataclass
class PendingPD:
    """A PD set that is starting: its children."""

    prefill: list[Child]
    decode: Child


@dataclass
class PDWorkers:
    """One PD set: the (gRPC port, bootstrap port) of each prefill worker and the decode's gRPC port."""

    prefill: list[tuple[int, int]]
    decode: int

    @property
    def grpc_ports(self) -> list[int]:
        return [port for port, _ in self.prefill] + [self.decode]


class LocalProcesses:
    """Child processes of one section; stop() ends exactly those (routers first), each by its process group.

    start_* and wait_* are separate so that a section starts everything of one kind before waiting: start-ups
    overlap. port() reads the port a child prints once it listens (they all bind port 0)."""

    def __init__(self, log_dir: Path, ready_timeout_s: float = 300.0):
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.children: list[Child] = []

    def __enter__(self) -> LocalProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, name: str, args: list[str], cores: str | None = None, tree: str = REPO_ROOT) -> Child:
        """`tree`: the source tree the child runs (another checkout, to compare with this one)."""
        pin = ["taskset", "-c", cores] if cores and can_pin(cores) else []
        cmd = [*pin, sys.executable, "-m", "tandem.common.cli", *args]
        print(f"[report] start {name}: {' '.join(cmd)}" + (f" (tree {tree})" if tree != REPO_ROOT else ""),
              file=sys.stderr)
        env = {"PYTHONPATH": tree_import_path(tree, self.log_dir)} if tree != REPO_ROOT else None
        child = Child(name, cmd, tree, str(self.log_dir), env=env)
        self.children.append(child)
        return child

    def port(self, child: Child, pattern: str, ready: bool = True) -> int:
        """The port `child` prints once it listens; RuntimeError (with its last lines) if it dies first.
        `ready`: this is the last line start-up waits for (the child then keeps only its tail)."""
        try:
            port = int(child.wait_for(pattern, self.ready_timeout_s).group(1))
        except RuntimeError as e:
            raise RuntimeError(f"{e}; last lines of {self.log_dir / child.name}.log:\n{child.last_lines()}") from None
        if ready:
            child.started()
        return port

    def worker(self, name: str, role: str, model: str, threads: int, cores: str | None,
               extra: tuple[str, ...] = (), tree: str = REPO_ROOT) -> Child:
        """Start a worker on a port of its own choosing; `port()` reads it once the worker listens."""
        return self.start(name, [role, "--model", model, "--host", HOST, "--port", "0", "--num-threads", str(threads),
                                 *ENGINE_FLAGS, *extra], cores, tree)

    def start_pd(self, model: str, tag: str, n_prefill: int = 1, prefill_cores: tuple[str, ...] = ("0",),
                 decode_cores: str = "1", threads: int = 1, prefill_extra: tuple[str, ...] = (),
                 decode_extra: tuple[str, ...] = ()) -> PendingPD:
        """Start n prefill + 1 decode; `wait_pd` returns their ports once all of them listen."""
        prefills = [self.worker(f"{tag}-prefill{i}", "prefill", model, threads, prefill_cores[i % len(prefill_cores)],
                                (*prefill_extra, "--bootstrap-port", "0")) for i in range(n_prefill)]
        decode = self.worker(f"{tag}-decode", "decode", model, threads, decode_cores, decode_extra)
        return PendingPD(prefills, decode)

    def prefill_ports(self, child: Child) -> tuple[int, int]:
        """A prefill's (gRPC port, bootstrap port), both bound by the worker itself (port 0): a port picked here
        and passed on could be taken, by UCX's listeners say, before the worker binds it."""
        boot = self.port(child, BOOTSTRAP_LISTENING, ready=False)
        return self.port(child, WORKER_LISTENING), boot

    def wait_pd(self, pending: PendingPD) -> PDWorkers:
        return PDWorkers([self.prefill_ports(p) for p in pending.prefill], self.port(pending.decode, WORKER_LISTENING))

    def start_router(self, model: str, tag: str, pd: PDWorkers | None = None, worker: int | None = None,
                     extra: tuple[str, ...] = (), tree: str = REPO_ROOT) -> Child:
        """A router over `pd` (or one unified `worker` port); `wait_router` returns its base URL."""
        args = ["router", "--host", HOST, "--port", "0", "--model-path", model, *extra]
        for port, boot in pd.prefill if pd else ():
            args += ["--prefill", f"grpc://{HOST}:{port},{boot}"]
        if pd:
            args += ["--decode", f"grpc://{HOST}:{pd.decode}"]
        if worker is not None:
            args += ["--worker", f"grpc://{HOST}:{worker}"]
        return self.start(f"{tag}-router", args, tree=tree)

    def wait_router(self, router: Child) -> str:
        """The router's base URL once GET /readiness answers 200 (it has reached its workers)."""
        base = f"http://{HOST}:{self.port(router, ROUTER_LISTENING)}"
        deadline = time.monotonic() + self.ready_timeout_s
        while not _ready(base):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{router.name} not ready after {self.ready_timeout_s:.0f}s (GET /readiness)")
            time.sleep(0.2)
        return base

    def check_alive(self) -> None:
        for child in self.children:
            if child.exited() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.exited()}; last lines:\n"
                                   f"{child.last_lines()}")

    def stop(self) -> None:
        routers = [c for c in self.children if c.name.endswith("-router")]
        workers = [c for c in self.children if c not in routers]
        stop_all(routers, STOP_TIMEOUT_S)  # first, so nothing new reaches a worker that is stopping
        stop_all(workers, STOP_TIMEOUT_S)
        for child in self.children:
            child.close()
        self.children.clear()


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/readiness", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def flush(ports: list[int]) -> None:
    """FlushCache on each worker (retried: a worker refuses while requests are still running)."""
    for port in ports:
        with grpc.insecure_channel(f"{HOST}:{port}") as ch:
            for _ in range(50):
                if pb_grpc.SglangSchedulerStub(ch).FlushCache(common_pb2.FlushCacheRequest()).success:
                    break
                time.sleep(0.1)
