"""RouterConfig: the router's one typed config object, built from CLI flags (env overrides) and validated."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

POLICIES = ("round_robin", "random", "least_load", "power_of_two", "cache_aware")
ROLES = ("prefill", "decode", "unified")


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker's gRPC address; prefill workers also name the port of their bootstrap service."""

    role: str  # prefill | decode | unified
    host: str
    port: int
    bootstrap_port: Optional[int] = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.role}@{self.address}"


@dataclass(frozen=True)
class DnsTarget:
    """A DNS name re-resolved periodically; every A/AAAA record becomes one worker (headless Services)."""

    role: str
    name: str
    port: int
    bootstrap_port: Optional[int] = None


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: Optional[int] = None  # None: no gRPC API; 0: pick a free port
    prefill: list[WorkerEndpoint] = field(default_factory=list)
    decode: list[WorkerEndpoint] = field(default_factory=list)
    workers: list[WorkerEndpoint] = field(default_factory=list)
    dns_targets: list[DnsTarget] = field(default_factory=list)
    dns_refresh_s: float = 10.0
    policy: str = "cache_aware"  # unified workers
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    balance_abs_threshold: int = 8  # load gap (requests) beyond which cache affinity is ignored
    balance_rel_threshold: float = 1.5
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 5.0
    load_poll_interval_s: float = 1.0
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    kv_events: bool = True
    max_retries: int = 2
    max_running_requests: int = 1024
    max_queued_requests: int = 1024
    request_timeout_s: float = 600.0
    model_path: Optional[str] = None
    served_model_name: Optional[str] = None
    tokenizer_cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "tokenizers")
    api_key: Optional[str] = None

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        has_pd = bool(self.prefill or self.decode or any(t.role != "unified" for t in self.dns_targets))
        has_unified = bool(self.workers or any(t.role == "unified" for t in self.dns_targets))
        need(has_pd or has_unified, "no workers: pass --worker, or --prefill and --decode (or their -dns forms)")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            need(value in POLICIES, f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}, got {value!r}")
        for endpoint in self.prefill:
            need(endpoint.bootstrap_port is not None,
                 f"--prefill {endpoint.address}: name the bootstrap port too, as grpc://HOST:PORT,BOOTSTRAP_PORT")
        for target in self.dns_targets:
            need(target.role != "prefill" or target.bootstrap_port is not None,
                 f"--prefill-dns {target.name}: use NAME:PORT:BOOTSTRAP_PORT")
        need(0 <= self.port < 65536, f"--port must be in 0..65535 (0 picks a free one), got {self.port}")
        need(self.grpc_port is None or 0 <= self.grpc_port < 65536, "--grpc-port must be in 0..65535")
        need(self.max_retries >= 0, "--max-retries must be >= 0")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.max_queued_requests >= 0, "--max-queued-requests must be >= 0")
        need(self.request_timeout_s > 0, "--request-timeout-s must be > 0")
        need(self.breaker_failure_threshold >= 1, "--breaker-failure-threshold must be >= 1")
        need(self.health_check_interval_s > 0 and self.load_poll_interval_s > 0, "poll intervals must be > 0")
        need(self.model_path is None or os.path.isfile(os.path.join(self.model_path, "tokenizer.json")),
             f"--model-path {self.model_path!r} has no tokenizer.json")


# ---- parsing flags ----------------------------------------------------------------------------------

def parse_worker_url(value: str, flag: str) -> WorkerEndpoint:
    """grpc://HOST:PORT[,BOOTSTRAP_PORT] (the scheme may be omitted); flag is prefill, decode or worker."""
    role = "unified" if flag == "worker" else flag
    url, _, bootstrap = value.partition(",")
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme != "grpc" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
        shape = "grpc://HOST:PORT,BOOTSTRAP_PORT" if role == "prefill" else "grpc://HOST:PORT"
        raise ValueError(f"--{flag} {value!r}: expected {shape}")
    bootstrap_port = None
    if bootstrap:
        if not bootstrap.isdigit():
            raise ValueError(f"--{flag} {value!r}: the bootstrap port must be a number")
        bootstrap_port = int(bootstrap)
    elif role == "prefill":
        raise ValueError(f"--prefill {value!r}: name the bootstrap port too, as grpc://HOST:PORT,BOOTSTRAP_PORT")
    return WorkerEndpoint(role, parts.hostname, parts.port, bootstrap_port)


def parse_dns_target(value: str, role: str) -> DnsTarget:
    """NAME:PORT (decode, unified) or NAME:PORT:BOOTSTRAP_PORT (prefill)."""
    parts = value.split(":")
    want = 3 if role == "prefill" else 2
    if len(parts) != want or not parts[0] or not all(p.isdigit() for p in parts[1:]):
        shape = "NAME:PORT:BOOTSTRAP_PORT" if role == "prefill" else "NAME:PORT"
        raise ValueError(f"--{role}-dns {value!r}: expected {shape}")
    return DnsTarget(role, parts[0], int(parts[1]), int(parts[2]) if role == "prefill" else None)


def _env(name: str, default: Optional[str] = None) -> Optional[str]:
    return os.environ.get(f"TANDEM_ROUTER_{name}", default)


def _env_list(name: str) -> list[str]:
    """Whitespace-separated (a prefill URL carries a comma of its own)."""
    return (_env(name) or "").split()


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags of `tandem router`; env TANDEM_ROUTER_<FLAG> (upper case, '-' → '_') overrides each default."""
    d = RouterConfig()
    g = p.add_argument_group("serving")
    g.add_argument("--host", default=_env("HOST", d.host), help="address to listen on")
    g.add_argument("--port", type=int, default=int(_env("PORT", str(d.port))), help="HTTP (OpenAI API) port")
    g.add_argument("--grpc-port", type=int, default=int(_env("GRPC_PORT")) if _env("GRPC_PORT") else None,
                   help="port of the text-level gRPC API (tandem.router.v1); off when unset, 0 picks one")
    g.add_argument("--api-key", default=_env("API_KEY"), help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument("--model-path", default=_env("MODEL_PATH"),
                   help="directory with tokenizer.json/tokenizer_config.json (default: fetch from a worker)")
    g.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"),
                   help="model id clients use (default: what the workers report)")
    g.add_argument("--tokenizer-cache-dir", default=_env("TOKENIZER_CACHE_DIR", d.tokenizer_cache_dir))
    g = p.add_argument_group("workers")
    g.add_argument("--prefill", action="append", default=_env_list("PREFILL"), metavar="grpc://HOST:PORT,BOOT",
                   help="a prefill worker and its bootstrap port (repeatable)")
    g.add_argument("--decode", action="append", default=_env_list("DECODE"), metavar="grpc://HOST:PORT",
                   help="a decode worker (repeatable)")
    g.add_argument("--worker", action="append", default=_env_list("WORKER"), metavar="grpc://HOST:PORT",
                   help="a unified (prefill+decode) worker (repeatable)")
    g.add_argument("--prefill-dns", action="append", default=_env_list("PREFILL_DNS"), metavar="NAME:PORT:BOOT")
    g.add_argument("--decode-dns", action="append", default=_env_list("DECODE_DNS"), metavar="NAME:PORT")
    g.add_argument("--worker-dns", action="append", default=_env_list("WORKER_DNS"), metavar="NAME:PORT")
    g.add_argument("--dns-refresh-s", type=float, default=d.dns_refresh_s)
    g = p.add_argument_group("routing")
    g.add_argument("--policy", choices=POLICIES, default=_env("POLICY", d.policy), help="for unified workers")
    g.add_argument("--prefill-policy", choices=POLICIES, default=_env("PREFILL_POLICY", d.prefill_policy))
    g.add_argument("--decode-policy", choices=POLICIES, default=_env("DECODE_POLICY", d.decode_policy))
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: a load gap (requests) above which the least-loaded worker wins")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="cache_aware: ... and above this ratio of the loads")
    g.add_argument("--no-kv-events", action="store_true", help="do not subscribe to the workers' KV events")
    g = p.add_argument_group("health and back-pressure")
    g.add_argument("--health-check-interval-s", type=float, default=d.health_check_interval_s)
    g.add_argument("--health-check-timeout-s", type=float, default=d.health_check_timeout_s)
    g.add_argument("--load-poll-interval-s", type=float, default=d.load_poll_interval_s)
    g.add_argument("--breaker-failure-threshold", type=int, default=d.breaker_failure_threshold,
                   help="consecutive failures that open a worker's circuit breaker")
    g.add_argument("--breaker-cooldown-s", type=float, default=d.breaker_cooldown_s,
                   help="seconds an open breaker waits before letting one trial request through")
    g.add_argument("--max-retries", type=int, default=int(_env("MAX_RETRIES", str(d.max_retries))),
                   help="new worker (pair) attempts when one fails before any token reached the client")
    g.add_argument("--max-running-requests", type=int,
                   default=int(_env("MAX_RUNNING_REQUESTS", str(d.max_running_requests))),
                   help="requests in flight at the workers at once; more wait in the queue")
    g.add_argument("--max-queued-requests", type=int,
                   default=int(_env("MAX_QUEUED_REQUESTS", str(d.max_queued_requests))),
                   help="requests waiting for a running slot; beyond this the router answers 429")
    g.add_argument("--request-timeout-s", type=float,
                   default=float(_env("REQUEST_TIMEOUT_S", str(d.request_timeout_s))))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    dns = ([parse_dns_target(v, "prefill") for v in args.prefill_dns]
           + [parse_dns_target(v, "decode") for v in args.decode_dns]
           + [parse_dns_target(v, "unified") for v in args.worker_dns])
    config = RouterConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port,
        prefill=[parse_worker_url(v, "prefill") for v in args.prefill],
        decode=[parse_worker_url(v, "decode") for v in args.decode],
        workers=[parse_worker_url(v, "worker") for v in args.worker],
        dns_targets=dns, dns_refresh_s=args.dns_refresh_s,
        policy=args.policy, prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
        health_check_interval_s=args.health_check_interval_s, health_check_timeout_s=args.health_check_timeout_s,
        load_poll_interval_s=args.load_poll_interval_s, breaker_failure_threshold=args.breaker_failure_threshold,
        breaker_cooldown_s=args.breaker_cooldown_s, kv_events=not args.no_kv_events, max_retries=args.max_retries,
        max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout_s, model_path=args.model_path,
        served_model_name=args.served_model_name, tokenizer_cache_dir=args.tokenizer_cache_dir,
        api_key=args.api_key,
    )
    config.validate()
    return config
