"""`tandem up`: start N prefill + M decode workers (or K unified ones) and the router on one machine."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from typing import Optional

from tandem.common.config import EngineConfig, add_engine_args, check_quantization_flags
from tandem.common.flags import ConfigError, add_flags, from_flags, to_argv
from tandem.common.cpu_affinity import usable_cpus
from tandem.common.launcher.children import BOOTSTRAP_LISTENING, Child, free_port, stop_all
from tandem.common.launcher.cpu_split import SHARED_ENV, shares_cpus, worker_flags
from tandem.common.launcher.ports import PlannedPort, check_ports
from tandem.common.launcher.scaler import LocalScaler, add_planner_flags, admin_key_for, planner_from_args
from tandem.common.model.builtin import check_model, has_random_weights, resolve_model
from tandem.common.planner.config import PlannerConfig
from tandem.services.router.config import RouterConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_HOST = "127.0.0.1"  # workers only talk to the router on this machine
PROGRESS_S = 10.0  # how often a line says what start-up is still waiting for
EXIT_DRAIN_S = 5.0  # how long the lines a worker printed before it exited may take to be read
# A worker's lines around the first build of the C++ attention ops (common/model/attention/cpu, not imported: torch).
COMPILING_KERNELS, COMPILED_KERNELS = "compiling the CPU attention kernels", "compiled the CPU attention kernels"


@dataclass
class UpConfig:
    model_path: str = ""  # a directory or a built-in name; "" → the default built-in model (made on first use)
    tokenizer_path: Optional[str] = None  # the workers' --tokenizer, and so the router's --model-path
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: Optional[int] = None
    prefill: int = 1
    decode: int = 1
    unified: int = 0  # > 0: unified workers instead of prefill/decode pairs
    engine_flags: list[str] = field(default_factory=list)  # passed verbatim to every worker
    router_flags: list[str] = field(default_factory=list)  # the router flags given to `tandem up` (router_argv)
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    log_dir: Optional[str] = None
    log_level: str = "warning"
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 45.0
    tls: bool = True  # mutual TLS between the children, with throwaway certificates (--no-tls: off)
    metrics_port: Optional[int] = None  # first worker's Prometheus port; the next workers take the next ones
    # Tensor-parallel size of each prefill / decode worker; None: --tp-size (in engine_flags) for both.
    prefill_tp_size: Optional[int] = None
    decode_tp_size: Optional[int] = None
    planner: Optional[PlannerConfig] = None  # --planner: start and stop workers as the load needs
    admin_api_key: Optional[str] = None  # the router's, generated for the planner when none was given
    worker_cpus: dict[str, list[str]] = field(default_factory=dict)  # worker name -> its --cpu-split flags
    worker_env: dict[str, str] = field(default_factory=dict)  # set in every worker's environment (--cpu-split shared)

    @property
    def worker_names(self) -> list[str]:
        """The workers in start order (which is also the order of their metrics ports)."""
        if self.unified:
            return [f"worker-{i}" for i in range(self.unified)]
        return [f"prefill-{i}" for i in range(self.prefill)] + [f"decode-{i}" for i in range(self.decode)]

    def metrics_ports(self) -> dict[str, int]:
        """Worker name -> its --metrics-port (none without --metrics-port)."""
        if self.metrics_port is None:
            return {}
        return {name: self.metrics_port + i for i, name in enumerate(self.worker_names)}

    def planned_ports(self) -> list[PlannedPort]:
        """Every fixed port the stack will bind (workers' gRPC and bootstrap ports are picked free)."""
        ports = [PlannedPort(self.port, self.host, "router HTTP", "--port")]
        if self.grpc_port is not None:
            ports.append(PlannedPort(self.grpc_port, self.host, "router gRPC API", "--grpc-port"))
        flag = f"--metrics-port (the first of {len(self.worker_names)} consecutive ports)"
        ports += [PlannedPort(port, WORKER_HOST, f"metrics of {name}", flag)
                  for name, port in self.metrics_ports().items()]
        return ports

    def validate(self) -> "UpConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.unified >= 0, "--unified must be >= 0")
        if self.unified == 0:
            need(self.prefill >= 1 and self.decode >= 1,
                 "--prefill and --decode must both be >= 1 (or pass --unified K for unified workers)")
        need(0 <= self.port < 65536, f"--port must be in 0..65535, got {self.port}")
        need(self.grpc_port is None or 0 <= self.grpc_port < 65536, "--grpc-port must be in 0..65535")
        check_model(self.model_path)
        need(self.ready_timeout_s > 0 and self.stop_timeout_s > 0, "timeouts must be > 0")
        for flag, size in (("--prefill-tp-size", self.prefill_tp_size), ("--decode-tp-size", self.decode_tp_size)):
            need(size is None or size >= 1, f"{flag} must be >= 1, got {size}")
            need(size is None or not self.unified, f"{flag} sizes prefill/decode workers; unified workers (--unified "
                 f"{self.unified}) take --tp-size")
        need(self.metrics_port is None or 0 < self.metrics_port <= 65536 - len(self.worker_names),
             f"--metrics-port must leave room for {len(self.worker_names)} consecutive ports in 1..65535, got "
             f"{self.metrics_port}")
        return self


class StopRequested(Exception):
    """SIGINT or SIGTERM reached `tandem up`."""


class ChildFailed(Exception):
    def __init__(self, child: Child, reason: str):
        super().__init__(reason)
        self.child = child


# ---- flags -------------------------------------------------------------------------------------------

def add_up_args(p: argparse.ArgumentParser) -> None:
    """The flags of `tandem up`: the stack's shape, what it passes to the router, and the engine flags every
    worker gets."""
    g = p.add_argument_group("stack")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the router listens on; workers use 127.0.0.1 (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="router HTTP port, 0 picks a free one (default: %(default)s)")
    g.add_argument("--grpc-port", type=int, default=None, help="router gRPC API port (default: off)")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    g.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    g.add_argument("--unified", type=int, default=0, metavar="K",
                   help="K unified workers instead of prefill/decode pairs (default: %(default)s)")
    g.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    g.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True,
                   help="mutual TLS between the router and the workers and on the bootstrap hop, with a throwaway "
                        "CA and certificate generated into a temporary directory (removed on exit); on by default, "
                        "--no-tls for plaintext internal hops (default: on)")
    g.add_argument("--metrics-port", type=int, default=None, metavar="BASE",
                   help="serve each worker's Prometheus metrics on BASE, BASE+1, ... (in the order prefill, decode "
                        "or the unified workers; printed at start); the router's are on its HTTP port at /metrics "
                        "(default: workers' metrics off)")
    g.add_argument("--prefill-tp-size", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks of each prefill worker (default: --tp-size)")
    g.add_argument("--decode-tp-size", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks of each decode worker; may differ from the prefill's, whose ranks "
                        "then WRITE head slices into the decode's ranks (default: --tp-size)")
    g.add_argument("--cpu-split", default="auto", metavar="auto|pin|shared|off|P:D",
                   help="share the CPUs among the workers: auto sets each worker's --num-threads to its share (spare "
                        "CPUs to the decode workers), when each worker is one process and neither --cpu-affinity nor "
                        "--num-threads is given, except that a prefill/decode stack with fewer than two CPUs per "
                        "worker runs shared; shared gives every worker every CPU with passive OpenMP waits "
                        "(OMP_WAIT_POLICY=PASSIVE), so an idle worker's threads sleep; pin also pins each to its "
                        "own CPUs (--cpu-affinity); P:D pins each prefill worker to P CPUs and each decode worker to "
                        "D; off sets nothing (default: %(default)s)")
    g.add_argument("--log-dir", default=None, help="write each child's log to DIR/NAME.log (default: stderr)")
    g.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for the stack to be ready (default: %(default)s)")
    g.add_argument("--stop-timeout", type=float, default=45.0,
                   help="seconds after SIGTERM before SIGKILL (default: %(default)s)")
    add_planner_flags(p)
    add_engine_args(p, require_model=False)
    # The router's own declarations (same names, env TANDEM_ROUTER_*), less what `tandem up` sets itself.
    add_flags(p, RouterConfig, title="router", env_prefix="TANDEM_ROUTER_", exclude=ROUTER_FIELDS_SET_BY_UP,
              section_prefix="router: ")


# RouterConfig fields `tandem up` decides (the workers it started, where it listens, the model) or takes under its
# own flags (--api-key, --served-model-name: workers get the name too); max_running_requests would clash with the
# engine's flag of that name, the DNS refresh has no DNS names to refresh here, and HTTPS would need the readiness
# probe and the banner to speak it (not done yet). --session-timeout-s is the engine's flag too: one value for both.
ROUTER_FIELDS_SET_BY_UP = ("host", "port", "grpc_port", "api_key", "model_path", "served_model_name", "prefill",
                           "decode", "workers", "prefill_dns", "decode_dns", "worker_dns", "dns_refresh_s",
                           "max_running_requests", "ssl_certfile", "ssl_keyfile", "session_timeout_s")


def router_argv(args: argparse.Namespace) -> list[str]:
    """The router flags given to `tandem up` that differ from the router's defaults, to pass on to its router."""
    given = {f.name: getattr(args, f.name) for f in fields(RouterConfig)
             if "help" in f.metadata and f.name not in ROUTER_FIELDS_SET_BY_UP}
    return to_argv(RouterConfig(**given, session_timeout_s=args.session_timeout_s), "TANDEM_ROUTER_")[0]


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that differ from the defaults, under their declared names (--tokenizer, not the field's);
    each worker gets --model of its own."""
    return to_argv(from_flags(EngineConfig, args, model_path=""), "TANDEM_")[0]


def _check_parallelism(args: argparse.Namespace) -> None:
    """What `tandem up` can run in parallel: tensor-parallel workers of every role, data-parallel workers of every
    role (each worker --dp-size N), pipeline-parallel unified workers, on this machine."""
    if args.pp_size > 1 and not args.unified:
        raise ConfigError(f"tandem up --pp-size {args.pp_size} needs --unified K: pipeline parallelism on "
                          "prefill/decode workers is not implemented yet")
    if args.dp_size > 1 and args.metrics_port is not None:
        raise ConfigError(f"tandem up --dp-size {args.dp_size} with --metrics-port: per-replica metrics are not "
                          "implemented yet (read per-rank load from GetLoads)")
    if args.nnodes > 1 or args.node_rank or args.dist_init_addr:
        raise ConfigError("tandem up runs every process on this machine: --nnodes, --node-rank and --dist-init-addr "
                          "are for `tandem worker|prefill|decode` on each node")
    check_quantization_flags(args.kv_cache_dtype, args.quantization)  # before the workers start, not in each of them


def config_from_args(args: argparse.Namespace) -> UpConfig:
    _check_parallelism(args)
    # The children run in the repository root: a path relative to where `tandem up` was typed must not move.
    for name in ("tokenizer_path", "chat_template", "hicache_storage_dir"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    config = UpConfig(model_path=args.model_path, tokenizer_path=args.tokenizer_path, host=args.host, port=args.port,
                    grpc_port=args.grpc_port,
                    prefill=args.prefill, decode=args.decode, unified=args.unified,
                    engine_flags=_engine_flags(args), router_flags=router_argv(args),
                    served_model_name=args.served_model_name, prefill_tp_size=args.prefill_tp_size,
                    decode_tp_size=args.decode_tp_size, api_key=args.api_key, log_dir=args.log_dir,
                    log_level=getattr(args, "log_level", "warning"), ready_timeout_s=args.ready_timeout,
                    stop_timeout_s=args.stop_timeout, tls=args.tls, metrics_port=args.metrics_port,
                    planner=planner_from_args(args), admin_api_key=admin_key_for(args)).validate()
    multi_process = (max(args.tp_size, args.pp_size, args.dp_size, args.prefill_tp_size or 1,
                         args.decode_tp_size or 1) > 1 or config.planner is not None)
    sized = args.cpu_affinity is not None or args.num_threads is not None
    config.worker_cpus = worker_flags(args.cpu_split, config.worker_names, usable_cpus(), sized, multi_process)
    if shares_cpus(args.cpu_split, config.worker_names, usable_cpus(), sized, multi_process):
        config.worker_env = dict(SHARED_ENV)
    return config


# ---- the stack ---------------------------------------------------------------------------------------

class Stack:
    """The children of one `tandem up`, started in order (workers, then the router) and stopped together."""

    def __init__(self, config: UpConfig, model_path: str):
        self.config = config
        self.model_path = model_path
        self.children: list[Child] = []
        self.metrics_urls: dict[str, str] = {}  # worker name -> its /metrics
        self.url = ""
        self.tls_dir: Optional[str] = None
        self.tls_flags: list[str] = []
        if config.tls:
            from tandem.common.launcher.certs import make_deployment_certs

            self.tls_dir = tempfile.mkdtemp(prefix="tandem-tls-")
            self.tls_flags = make_deployment_certs(self.tls_dir).flags()
            print(f"tandem up: mutual TLS between the processes; throwaway certificates in {self.tls_dir}",
                  file=sys.stderr, flush=True)

    def _spawn(self, name: str, *argv: str, env: Optional[dict[str, str]] = None) -> Child:
        cmd = [sys.executable, "-m", "tandem.common.cli", "--log-level", self.config.log_level, *argv]
        child = Child(name, cmd, REPO_ROOT, self.config.log_dir, env=env)
        self.children.append(child)
        print(f"tandem up: started {name} (pid {child.pid})", file=sys.stderr, flush=True)
        return child

    def _worker(self, name: str, command: str, *extra: str) -> Child:
        served = ["--served-model-name", self.config.served_model_name] if self.config.served_model_name else []
        metrics_port = self.config.metrics_ports().get(name)
        if metrics_port is None and self.config.planner is not None:  # the planner reads each worker's
            metrics_port = free_port(WORKER_HOST)
        if metrics_port is not None:
            self.metrics_urls[name] = f"http://{WORKER_HOST}:{metrics_port}/metrics"
        metrics = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
        cpus = self.config.worker_cpus.get(name, [])
        return self._spawn(name, command, "--model", self.model_path, "--host", WORKER_HOST, "--port", "0",
                           *served, *metrics, *self.config.engine_flags, *cpus, *self.tls_flags, *extra,
                           env=self.config.worker_env or None)

    def _wait_port(self, child: Child, pattern: str, deadline: float) -> int:
        """The port `child` prints once it listens; a progress line every PROGRESS_S while it loads."""
        started = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            try:
                port = int(child.wait_for(pattern, max(0.1, min(left, PROGRESS_S))).group(1))
            except RuntimeError as e:
                if child.exited() is not None:  # the lines it printed before it exited may still be on their way;
                    try:  # if it listened, its exit is a crash after start-up, found as any other
                        port = int(child.wait_for(pattern, EXIT_DRAIN_S).group(1))
                    except RuntimeError as exited:
                        raise ChildFailed(child, str(exited)) from None
                    break
                if left <= PROGRESS_S:
                    raise ChildFailed(child, str(e)) from None
                _progress(f"still waiting for {child.name} to {self._doing(child)} "
                          f"({time.monotonic() - started:.0f}s)")
                continue
            break
        _progress(f"{child.name} listening on port {port} ({time.monotonic() - started:.1f}s)")
        return port

    def _doing(self, child: Child) -> str:
        """What `child` is busy with; workers wait for the one that compiles the kernels (an flock)."""
        compiling = [c.name for c in self.children if c.said(COMPILING_KERNELS) and not c.said(COMPILED_KERNELS)]
        if child.name in compiling:
            return "compile the CPU attention kernels (once)"
        if compiling:
            return f"load the model; {compiling[0]} compiles the CPU attention kernels (once) and the others wait"
        return "load the model and listen"

    def start(self) -> None:
        c, deadline = self.config, time.monotonic() + self.config.ready_timeout_s
        listening = r"worker listening on 127\.0\.0\.1:(\d+)"
        _progress(f"starting {len(c.worker_names)} workers ({', '.join(c.worker_names)}); each loads the model")
        if c.worker_cpus:
            _progress("CPUs (--cpu-split): " + ", ".join(f"{n} {' '.join(f)}" for n, f in c.worker_cpus.items()))
        elif c.worker_env:
            _progress("CPUs (--cpu-split): every worker on every CPU, "
                      + " ".join(f"{k}={v}" for k, v in c.worker_env.items()))
        for name, port in c.metrics_ports().items():
            _progress(f"{name} metrics: http://{WORKER_HOST}:{port}/metrics")
        worker_flags: list[str] = []
        if c.unified:
            workers = [self._worker(f"worker-{i}", "worker") for i in range(c.unified)]
            for w in workers:
                worker_flags += ["--worker", f"grpc://{WORKER_HOST}:{self._wait_port(w, listening, deadline)}"]
        else:
            # Each prefill binds its bootstrap port itself (0) and prints it: a port picked here could be taken
            # (by a UCX listener, say) before the worker binds it.
            prefills = [self._worker(f"prefill-{i}", "prefill", "--bootstrap-port", "0",
                                     *_tp_flag(c.prefill_tp_size)) for i in range(c.prefill)]
            decodes = [self._worker(f"decode-{i}", "decode", *_tp_flag(c.decode_tp_size)) for i in range(c.decode)]
            for p in prefills:
                p.grpc_url = f"grpc://{WORKER_HOST}:{self._wait_port(p, listening, deadline)}"
                boot = int(p.wait_for(BOOTSTRAP_LISTENING, 1.0).group(1))  # printed before it listens
                worker_flags += ["--prefill", f"{p.grpc_url},{boot}"]
            for d in decodes:
                d.grpc_url = f"grpc://{WORKER_HOST}:{self._wait_port(d, listening, deadline)}"
                worker_flags += ["--decode", d.grpc_url]
        self._start_router(worker_flags, deadline)
        for child in self.children:
            child.started()

    def _start_router(self, worker_flags: list[str], deadline: float) -> None:
        c = self.config
        extra = list(c.router_flags)
        extra += ["--grpc-port", str(c.grpc_port)] if c.grpc_port is not None else []
        # Keys go as --flag=value: a generated one may begin with "-", which argparse would read as a flag.
        extra += [f"--api-key={c.api_key}"] if c.api_key else []
        named = any(f == "--admin-api-key" or f.startswith("--admin-api-key=") for f in extra)
        extra += [f"--admin-api-key={c.admin_api_key}"] if c.admin_api_key and not named else []
        extra += ["--served-model-name", c.served_model_name] if c.served_model_name else []
        _progress("starting the router")
        router = self._spawn("router", "router", "--host", c.host, "--port", str(c.port), "--model-path",
                             c.tokenizer_path or self.model_path, *worker_flags, *self.tls_flags, *extra)
        port = self._wait_port(router, r"tandem router listening on \S+:(\d+)", deadline)
        host = "127.0.0.1" if c.host in ("0.0.0.0", "::", "") else c.host
        self.url = f"http://{host}:{port}"
        while not _ready(self.url):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ChildFailed(router, f"router not ready after {c.ready_timeout_s:.0f}s (GET /readiness)")
            time.sleep(0.2)
        _progress(f"router ready at {self.url} (metrics: {self.url}/metrics)")

    def check_alive(self) -> None:
        for child in self.children:
            code = child.exited()
            if code is not None:
                raise ChildFailed(child, f"{child.name} (pid {child.pid}) exited unexpectedly with code {code}")

    def stop(self) -> dict[str, Optional[int]]:
        # The router first, so nothing new reaches a worker that is draining.
        routers = [ch for ch in self.children if ch.name == "router"]
        workers = [ch for ch in self.children if ch.name != "router"]
        codes = stop_all(routers, self.config.stop_timeout_s)
        codes.update(stop_all(workers, self.config.stop_timeout_s))
        for child in self.children:
            child.close()
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)
        return codes


def _tp_flag(size: Optional[int]) -> list[str]:
    """A role's own --tp-size, after the shared engine flags so that it wins; none: the shared one applies."""
    return ["--tp-size", str(size)] if size is not None else []


def _progress(message: str) -> None:
    print(f"tandem up: {message}", file=sys.stderr, flush=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _banner(url: str, model: str, api_key: Optional[str]) -> str:
    key = api_key or "unused"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return f"""tandem up: serving {model} at {url}/v1  (Ctrl-C stops everything)

  curl {url}/v1/chat/completions -H 'content-type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{key}")
  print(client.chat.completions.create(model="{model}", max_tokens=32,
        messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)
"""


def _raise_stop(signum, frame) -> None:
    # Later signals must not interrupt the shutdown that the first one started.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise StopRequested(signal.Signals(signum).name)


def run_stack(config: UpConfig) -> int:
    """Start the stack, serve until SIGINT/SIGTERM (→ 0) or a child dies (→ 1), stop every child."""
    check_ports(config.planned_ports())  # before minutes of model creation and loading
    model_path = os.path.abspath(resolve_model(config.model_path))  # a built-in one is made here on first use
    if has_random_weights(config.model_path):
        _progress(f"{config.model_path} has random weights: its answers are random text (a test model; without "
                  "--model, a trained one answers)")
    if config.log_dir:
        os.makedirs(config.log_dir, exist_ok=True)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(config, model_path)
    status = 0
    try:
        stack.start()
        name = config.served_model_name or os.path.basename(os.path.normpath(model_path))
        print(_banner(stack.url, name, config.api_key), flush=True)
        scaler = LocalScaler(stack, config.planner, config.admin_api_key) if config.planner else None
        while True:
            stack.check_alive()
            if scaler is not None:
                scaler.poll()
            time.sleep(0.5)
    except StopRequested as stop:
        print(f"tandem up: {stop}, stopping {len(stack.children)} processes", file=sys.stderr, flush=True)
    except ChildFailed as failure:
        status = 1
        print(f"tandem up: {failure}; stopping the rest. Last lines of {failure.child.name}:\n"
              f"{failure.child.last_lines()}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        codes = stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # -SIGTERM is a child stopped before it installed its handler (a stop during start-up): as asked.
    unclean = {name: code for name, code in codes.items() if code not in (0, None, -signal.SIGTERM)}
    if status == 0 and unclean:
        print(f"tandem up: stopped; not cleanly: {unclean}", file=sys.stderr, flush=True)
    return status


def run(args: argparse.Namespace) -> int:
    return run_stack(config_from_args(args))


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="start prefill/decode (or unified) workers and the router on this machine")
    add_up_args(p)
    p.set_defaults(func=run)
