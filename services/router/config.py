"""RouterConfig: the router's one typed config object, built from CLI flags (env overrides) and validated."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Optional
from urllib.parse import urlsplit

from tandem.common.config import TlsConfig, add_tls_args, tls_config_from_args
from tandem.common.flags import ConfigError, add_flags, flag, from_flags
from tandem.common.model.config import gguf_file
from tandem.common.roles import Role

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
POLICIES = ("round_robin", "random", "least_load", "power_of_two", "cache_aware")
ADMISSION_RESERVES = ("estimate", "full")


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker's gRPC address; prefill workers also name the port of their bootstrap service."""

    role: Role  # PREFILL, DECODE or UNIFIED
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

    role: Role
    name: str
    port: int
    bootstrap_port: Optional[int] = None


# ---- parsing worker flags ------------------------------------------------------------------------------

def parse_worker_url(value: str, flag: str) -> WorkerEndpoint:
    """grpc://HOST:PORT[,BOOTSTRAP_PORT] (the scheme may be omitted); flag is prefill, decode or worker."""
    role = Role.UNIFIED if flag == "worker" else Role(flag)
    url, _, bootstrap = value.partition(",")
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    if parts.scheme != "grpc" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
        shape = "grpc://HOST:PORT,BOOTSTRAP_PORT" if role is Role.PREFILL else "grpc://HOST:PORT"
        raise ValueError(f"--{flag} {value!r}: expected {shape}")
    bootstrap_port = None
    if bootstrap:
        if not bootstrap.isdigit():
            raise ValueError(f"--{flag} {value!r}: the bootstrap port must be a number")
        bootstrap_port = int(bootstrap)
    elif role is Role.PREFILL:
        raise ValueError(f"--prefill {value!r}: name the bootstrap port too, as grpc://HOST:PORT,BOOTSTRAP_PORT")
    return WorkerEndpoint(role, parts.hostname, parts.port, bootstrap_port)


def parse_dns_target(value: str, role: Role) -> DnsTarget:
    """NAME:PORT (decode, unified) or NAME:PORT:BOOTSTRAP_PORT (prefill)."""
    parts = value.split(":")
    want = 3 if role is Role.PREFILL else 2
    if len(parts) != want or not parts[0] or not all(p.isdigit() for p in parts[1:]):
        shape = "NAME:PORT:BOOTSTRAP_PORT" if role is Role.PREFILL else "NAME:PORT"
        raise ValueError(f"--{role}-dns {value!r}: expected {shape}")
    return DnsTarget(role, parts[0], int(parts[1]), int(parts[2]) if role is Role.PREFILL else None)


_HEALTH = "health and back-pressure"
DISAGG_POLICIES = ("always", "never", "auto")


@dataclass
class RouterConfig:
    """What `tandem router` serves on, which workers it routes to and how."""

    host: str = flag("127.0.0.1", "address to listen on", group="serving")
    port: int = flag(8000, "HTTP (OpenAI API) port (0 picks a free one)", group="serving")
    grpc_port: Optional[int] = flag(None, "port of the text-level gRPC API (tandem.router.v1); off when unset, "
                                          "0 picks one", group="serving")
    api_key: Optional[str] = flag(None, "require 'Authorization: Bearer KEY' on /v1", group="serving")
    admin_api_key: Optional[str] = flag(None, "turn on the runtime control routes (/update_weights_*, "
                                              "/release_memory_occupation, /pause_generation, /v1/load_lora_adapter, "
                                              "...) behind 'Authorization: Bearer KEY'; must differ from --api-key "
                                              "(env TANDEM_ADMIN_API_KEY too)", group="serving")
    model_path: Optional[str] = flag(None, "directory with tokenizer.json/tokenizer_config.json (default: fetch "
                                           "from a worker); --tokenizer is vLLM's name for it",
                                     aliases=("--model", "--tokenizer"), metavar="DIR", group="serving")
    served_model_name: Optional[str] = flag(None, "model id clients use (default: what the workers report)",
                                            group="serving")
    chat_template: Optional[str] = flag(None, "a Jinja chat template file used instead of the model's (rendered as "
                                              "transformers renders templates)", metavar="FILE", group="serving")
    tool_call_parser: Optional[str] = flag(None, "parse tool calls out of chat output when tools are given "
                                                 "(tool_choice auto)", choices=TOOL_CALL_PARSERS, group="serving")
    reasoning_parser: Optional[str] = flag(None, "split <think>...</think> reasoning into reasoning_content",
                                           choices=REASONING_PARSERS, group="serving")
    tokenizer_cache_dir: str = flag(os.path.join(os.path.expanduser("~"), ".cache", "tandem", "tokenizers"),
                                    "where tokenizers fetched from workers are kept", metavar="DIR",
                                    group="serving")
    prefill: list[WorkerEndpoint] = flag([], "a prefill worker and its bootstrap port",
                                         metavar="grpc://HOST:PORT,BOOT", group="workers",
                                         parse=partial(parse_worker_url, flag="prefill"))
    decode: list[WorkerEndpoint] = flag([], "a decode worker", metavar="grpc://HOST:PORT", group="workers",
                                        parse=partial(parse_worker_url, flag="decode"))
    workers: list[WorkerEndpoint] = flag([], "a unified (prefill+decode) worker", name="--worker",
                                         metavar="grpc://HOST:PORT", group="workers",
                                         parse=partial(parse_worker_url, flag="worker"))
    prefill_dns: list[DnsTarget] = flag([], "a DNS name (headless Service) whose records are prefill workers",
                                        metavar="NAME:PORT:BOOT", group="workers",
                                        parse=partial(parse_dns_target, role=Role.PREFILL))
    decode_dns: list[DnsTarget] = flag([], "a DNS name (headless Service) whose records are decode workers",
                                       metavar="NAME:PORT", group="workers",
                                       parse=partial(parse_dns_target, role=Role.DECODE))
    worker_dns: list[DnsTarget] = flag([], "a DNS name (headless Service) whose records are unified workers",
                                       metavar="NAME:PORT", group="workers",
                                       parse=partial(parse_dns_target, role=Role.UNIFIED))
    worker_stream: bool = flag(True, "send each request to its worker as a Generate call of its own, instead of "
                                     "on one GenerateStream.Multiplex stream per worker that carries a step's "
                                     "tokens of every request in one message (workers that do not serve that "
                                     "stream always get Generate calls)", group="workers")  # --no-worker-stream
    dns_refresh_s: float = flag(10.0, "seconds between re-resolving the --*-dns names", group="workers")
    policy: str = flag("cache_aware", "policy for unified workers", choices=POLICIES, group="routing")
    prefill_policy: str = flag("cache_aware", "policy that picks the prefill worker of a pair", choices=POLICIES,
                               group="routing")
    decode_policy: str = flag("power_of_two", "policy that picks the decode worker of a pair", choices=POLICIES,
                              group="routing")
    balance_abs_threshold: int = flag(8, "cache_aware: a load gap (requests) above which the least-loaded "
                                         "worker wins", group="routing")
    balance_rel_threshold: float = flag(1.5, "cache_aware: ... and above this ratio of the loads", group="routing")
    kv_events: bool = flag(True, "do not subscribe to the workers' KV events", group="routing")  # --no-kv-events
    disagg_policy: str = flag("always", "whether a request goes through a prefill worker when its decode worker can "
                                        "prefill locally (its server info says local_prefill): 'always' uses a "
                                        "prefill/decode pair whenever a prefill worker is available, 'never' "
                                        "prefills on the decode, 'auto' decides per request (the --local-prefill-* "
                                        "and --prefill-saturated-queue thresholds). With no prefill worker "
                                        "available every policy prefills on the decode", choices=DISAGG_POLICIES,
                              group="routing")
    local_prefill_max_tokens: int = flag(256, "auto: prefill on the decode when at most this many prompt tokens are "
                                              "not in its prefix cache (a short prompt, or a long cached prefix)",
                                         group="routing")
    prefill_saturated_queue: int = flag(8, "auto: prefill on the decode when the least-loaded prefill worker has "
                                           "more than this many requests waiting", group="routing")
    local_prefill_min_free_kv: float = flag(0.1, "auto: use the pair when a local prefill would leave less than "
                                                 "this fraction of the decode's KV pool free", group="routing")
    local_prefill_max_waiting: int = flag(2, "auto: use the pair when this many requests already wait on the decode "
                                             "(local prefills queued behind its running streams)", group="routing")
    health_check_interval_s: float = flag(2.0, "seconds between health checks of each worker", group=_HEALTH)
    health_check_timeout_s: float = flag(5.0, "seconds a health check may take before it counts as failed",
                                         group=_HEALTH)
    load_poll_interval_s: float = flag(1.0, "seconds between polls of the workers' loads", group=_HEALTH)
    breaker_failure_threshold: int = flag(3, "consecutive failures that open a worker's circuit breaker",
                                          group=_HEALTH)
    breaker_cooldown_s: float = flag(5.0, "seconds an open breaker waits before letting one trial request "
                                          "through", group=_HEALTH)
    max_retries: int = flag(2, "new worker (pair) attempts when one fails before any token reached the client",
                            group=_HEALTH)
    max_migrations: int = flag(2, "times a request moves to another worker (pair) when its worker fails after "
                                  "tokens reached the client: the delivered tokens join the prompt and the stream "
                                  "goes on; 0 ends the stream with an error instead", group=_HEALTH)
    max_running_requests: int = flag(1024, "requests in flight at the workers at once; more wait in the queue",
                                     group=_HEALTH)
    max_queued_requests: int = flag(1024, "requests waiting for KV capacity or a running slot; beyond this the "
                                          "router answers 429 with Retry-After", aliases=("--max-queued",),
                                    group=_HEALTH)
    kv_admission: bool = flag(True, "admit requests whatever the workers' KV room (the workers' own queues and "
                                    "bootstrap timeouts then absorb bursts)", group=_HEALTH)  # --no-kv-admission
    admission_reserve: str = flag("estimate", "what KV admission reserves per sequence: 'estimate' (prompt + a "
                                              "learned fraction of max_tokens; the decode retracts or waits when "
                                              "outputs run longer) or 'full' (prompt + max_tokens)",
                                  choices=ADMISSION_RESERVES, group=_HEALTH)
    admission_min_ratio: float = flag(0.1, "estimate: the least fraction of max_tokens reserved", group=_HEALTH)
    queue_timeout_s: float = flag(30.0, "seconds a request may wait in the router's queue for KV capacity "
                                        "before it is answered 429 with Retry-After", group=_HEALTH)
    http_keepalive_timeout_s: float = flag(75.0, "seconds an HTTP connection may stay idle (from its opening, or "
                                                 "between requests) before the router closes it", group=_HEALTH)
    http_header_timeout_s: float = flag(10.0, "seconds a new HTTP connection has to send its first request's "
                                              "headers (slowloris) before the router closes it", group=_HEALTH)
    request_timeout_s: float = flag(600.0, "seconds a request may take end to end (504 beyond)", group=_HEALTH)
    session_timeout_s: float = flag(600.0, "seconds a session (/open_session) may stay idle before the router "
                                           "closes it (its turns' tokens dropped, its workers told)", group=_HEALTH)
    max_request_body_bytes: Optional[int] = flag(
        None, "largest HTTP request body (413 beyond); default: 4 bytes for each character of the longest prompt "
              "that can fit (context length x the tokenizer's longest token in characters), at least 8 MiB. That "
              "holds any prompt that fits, JSON-escaped, with room for the other fields, while bounding what one "
              "request makes the router read and parse", group=_HEALTH)
    tokenize_threads: int = flag(4, "threads that apply chat templates and tokenize prompts off the event loop; "
                                    "at most this many prompts are tokenized at once", group=_HEALTH)
    # Client-facing TLS (vLLM's and SGLang's flag names): HTTPS, and TLS on --grpc-port. Clients prove nothing
    # here but the API key; mutual TLS is for the internal hops (`tls`).
    ssl_certfile: Optional[str] = flag(None, "serve HTTPS (and TLS on --grpc-port) with this certificate chain "
                                             "(PEM)", metavar="PEM", group="serving")
    ssl_keyfile: Optional[str] = flag(None, "the private key (PEM) of --ssl-certfile", metavar="PEM",
                                      group="serving")
    # Mutual TLS to the workers: TlsConfig's flags (env TANDEM_TLS_*, as on the workers), set by config_from_args.
    tls: TlsConfig = field(default_factory=TlsConfig)

    @property
    def dns_targets(self) -> list[DnsTarget]:
        return [*self.prefill_dns, *self.decode_dns, *self.worker_dns]

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        has_pd = bool(self.prefill or self.decode or any(t.role is not Role.UNIFIED for t in self.dns_targets))
        has_unified = bool(self.workers or any(t.role is Role.UNIFIED for t in self.dns_targets))
        need(has_pd or has_unified, "no workers: pass --worker, or --prefill and --decode (or their -dns forms)")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            need(value in POLICIES, f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}, got {value!r}")
        need(self.disagg_policy in DISAGG_POLICIES,
             f"--disagg-policy must be one of {', '.join(DISAGG_POLICIES)}, got {self.disagg_policy!r}")
        need(self.local_prefill_max_tokens >= 0, "--local-prefill-max-tokens must be >= 0")
        need(self.prefill_saturated_queue >= 0, "--prefill-saturated-queue must be >= 0")
        need(0.0 <= self.local_prefill_min_free_kv < 1.0, "--local-prefill-min-free-kv must be in [0, 1)")
        need(self.local_prefill_max_waiting >= 1, "--local-prefill-max-waiting must be >= 1")
        for endpoint in self.prefill:
            need(endpoint.bootstrap_port is not None,
                 f"--prefill {endpoint.address}: name the bootstrap port too, as grpc://HOST:PORT,BOOTSTRAP_PORT")
        for target in self.dns_targets:
            need(target.role is not Role.PREFILL or target.bootstrap_port is not None,
                 f"--prefill-dns {target.name}: use NAME:PORT:BOOTSTRAP_PORT")
        need(0 <= self.port < 65536, f"--port must be in 0..65535 (0 picks a free one), got {self.port}")
        need(self.grpc_port is None or 0 <= self.grpc_port < 65536, "--grpc-port must be in 0..65535")
        need(self.max_retries >= 0, "--max-retries must be >= 0")
        need(self.max_migrations >= 0, f"--max-migrations must be >= 0, got {self.max_migrations}")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.max_queued_requests >= 0, "--max-queued-requests must be >= 0")
        need(self.http_keepalive_timeout_s > 0, f"--http-keepalive-timeout-s must be > 0, got "
                                                f"{self.http_keepalive_timeout_s}")
        need(self.http_header_timeout_s > 0, f"--http-header-timeout-s must be > 0, got {self.http_header_timeout_s}")
        need(self.request_timeout_s > 0, "--request-timeout-s must be > 0")
        need(self.session_timeout_s > 0, f"--session-timeout-s must be > 0, got {self.session_timeout_s}")
        need(self.admission_reserve in ADMISSION_RESERVES, f"--admission-reserve must be one of "
                                                           f"{', '.join(ADMISSION_RESERVES)}, got {self.admission_reserve!r}")
        need(0 < self.admission_min_ratio <= 1, f"--admission-min-ratio must be in (0, 1], got {self.admission_min_ratio}")
        need(self.queue_timeout_s > 0, f"--queue-timeout-s must be > 0, got {self.queue_timeout_s}")
        need(self.max_request_body_bytes is None or self.max_request_body_bytes >= 1024,
             f"--max-request-body-bytes must be >= 1024, got {self.max_request_body_bytes}")
        need(self.tokenize_threads >= 1, "--tokenize-threads must be >= 1")
        need(self.breaker_failure_threshold >= 1, "--breaker-failure-threshold must be >= 1")
        need(self.health_check_interval_s > 0 and self.load_poll_interval_s > 0, "poll intervals must be > 0")
        need(self.model_path is None or os.path.isfile(os.path.join(self.model_path, "tokenizer.json"))
             or gguf_file(self.model_path) is not None,  # its tokenizer is built from the GGUF metadata
             f"--model-path {self.model_path!r} has no tokenizer.json (and is no GGUF model)")
        need(self.chat_template is None or os.path.isfile(self.chat_template),
             f"--chat-template {self.chat_template!r} is not a file")
        need(self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
             f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        need(self.reasoning_parser in (None, *REASONING_PARSERS),
             f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        need(not self.admin_api_key or self.admin_api_key != self.api_key,
             "--admin-api-key must differ from --api-key: a client key must not control the workers")
        need((self.ssl_certfile is None) == (self.ssl_keyfile is None),
             "--ssl-certfile and --ssl-keyfile go together")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RouterConfig field; env TANDEM_ROUTER_<FLAG> (upper case, '-' → '_') overrides each default,
    a whitespace-separated list for the repeatable worker flags. The --tls-* flags are the workers' (env
    TANDEM_TLS_*)."""
    add_flags(parser, RouterConfig, title="router", env_prefix="TANDEM_ROUTER_")
    add_tls_args(parser)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = from_flags(RouterConfig, args, tls=tls_config_from_args(args))
    if config.admin_api_key is None:  # SGLang-style deployments name it without the router prefix
        config.admin_api_key = os.environ.get("TANDEM_ADMIN_API_KEY") or None
    config.validate()
    return config
