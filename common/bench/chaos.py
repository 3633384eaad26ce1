"""`tandem bench chaos`: a bounded soak and fault run against a real router + prefill + decode on 127.0.0.1.

Phases, in order: mixed streamed traffic with random client disconnects; the decode SIGKILLed under traffic and
restarted on its port; the prefill SIGSTOPped under traffic, then continued; an overload burst. Each phase
reports requests, errors by kind, and (faults) the time from the fault to the first error and from the
restart to the first success. At the end, every worker must hold 0 KV tokens and 0 requests (leaks), and the
router's RSS before and after is reported. `--write-doc` renders the figures into docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import aiohttp
import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.bench.local_stack import HOST, WORKER_LISTENING, LocalProcesses
from tandem.common.launcher.children import Child, free_port
from tandem.common.model.create import default_model_dir

# Fast failure detection, so each fault shows within seconds (the defaults suit a real cluster).
WORKER_FLAGS = ("--heartbeat-interval", "0.5", "--heartbeat-max-missed", "2", "--bootstrap-timeout", "5",
                "--transfer-timeout", "10")
ROUTER_FLAGS = ("--health-check-interval-s", "0.5", "--request-timeout-s", "30", "--breaker-cooldown-s", "1",
                "--disagg-policy", "always", "--max-migrations", "2")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
ERROR_BACKOFF_S = 0.1  # a client waits this long after a failed request, as real clients back off


@dataclass
class ChaosConfig:
    model: Optional[str] = None
    preset: str = "tiny"
    requests: int = 120  # mixed phase
    concurrency: int = 16
    max_tokens: int = 24
    disconnect_rate: float = 0.3  # share of mixed-phase requests whose client goes away mid-stream
    fault_s: float = 6.0  # traffic before and after each fault
    stop_s: float = 3.0  # how long the prefill stays SIGSTOPped
    burst: int = 96  # concurrent requests of the overload burst
    seed: int = 0
    output_json: Optional[str] = None
    write_doc: Optional[str] = None

    @classmethod
    def short(cls, **overrides) -> "ChaosConfig":
        """The form CI runs: every phase, small counts."""
        return cls(**{"requests": 32, "concurrency": 8, "max_tokens": 12, "fault_s": 3.0, "stop_s": 2.0,
                      "burst": 32, **overrides})


@dataclass
class PhaseResult:
    name: str
    requests: int = 0
    ok: int = 0
    disconnected: int = 0  # by the client, on purpose
    errors: dict = field(default_factory=dict)  # kind -> count
    time_to_error_s: Optional[float] = None  # fault → first failed request
    time_to_recovery_s: Optional[float] = None  # worker back → first successful request
    migrated: int = 0  # requests the router moved to another decode mid-stream
    local_prefill: int = 0  # attempts a decode prefilled itself (no prefill available, or --disagg-policy)

    def count(self, outcome: str) -> None:
        self.requests += 1
        if outcome == "ok":
            self.ok += 1
        elif outcome == "disconnected":
            self.disconnected += 1
        else:
            self.errors[outcome] = self.errors.get(outcome, 0) + 1


# ---- one request ---------------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, base: str, model: str, max_tokens: int,
                      disconnect_after: Optional[int] = None, timeout_s: float = 60.0) -> str:
    """'ok', 'disconnected' (we closed it after `disconnect_after` chunks) or an error kind: 'http_<status>',
    'stream_error' (an error event inside a 200 stream), 'timeout', 'connection'."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    try:
        async with session.post(f"{base}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return f"http_{resp.status}"
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return "ok"
                if b'"error"' in data and "error" in json.loads(data):
                    return "stream_error"
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    return "disconnected"  # leaving the block closes the connection mid-stream
            return "stream_cut"
    except asyncio.TimeoutError:
        return "timeout"
    except aiohttp.ClientError:
        return "connection"


async def traffic(base: str, model: str, cfg: ChaosConfig, phase: PhaseResult, stop: asyncio.Event,
                  rng: random.Random, total: Optional[int] = None, disconnect_rate: float = 0.0,
                  log: Optional[list] = None) -> None:
    """`cfg.concurrency` clients sending requests until `stop` is set (or `total` were sent); each outcome
    is counted and, with `log`, recorded as (finish time, outcome)."""
    sent = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while not stop.is_set() and (total is None or sent < total):
            sent += 1
            cut = rng.randint(1, max(cfg.max_tokens // 2, 1)) if rng.random() < disconnect_rate else None
            outcome = await one_request(session, base, model, cfg.max_tokens, cut)
            phase.count(outcome)
            if log is not None:
                log.append((time.monotonic(), outcome))
            if outcome not in ("ok", "disconnected"):
                await asyncio.sleep(ERROR_BACKOFF_S)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(cfg.concurrency)))


# ---- phases --------------------------------------------------------------------------------------------

async def mixed_phase(stack: "ChaosStack", cfg: ChaosConfig, rng: random.Random) -> PhaseResult:
    phase = PhaseResult("mixed traffic, random disconnects")
    await traffic(stack.base, stack.served_model, cfg, phase, asyncio.Event(), rng, total=cfg.requests, disconnect_rate=cfg.disconnect_rate)
    return phase


async def fault_phase(name: str, stack: "ChaosStack", cfg: ChaosConfig, rng: random.Random, inject,
                      recover) -> PhaseResult:
    """Traffic for fault_s, `await inject()`, traffic, `await recover()` (returns when the worker is back),
    traffic for fault_s more; time-to-error and time-to-recovery read from the outcome log."""
    phase, stop, log = PhaseResult(name), asyncio.Event(), []
    runner = asyncio.create_task(traffic(stack.base, stack.served_model, cfg, phase, stop, rng, log=log))
    await asyncio.sleep(cfg.fault_s)
    fault_at = time.monotonic()
    await inject()
    back_at = await recover()
    await asyncio.sleep(cfg.fault_s)
    stop.set()
    await runner
    failures = [t for t, outcome in log if t >= fault_at and outcome not in ("ok", "disconnected")]
    if failures:
        phase.time_to_error_s = round(failures[0] - fault_at, 3)
    successes = [t for t, outcome in log if t >= back_at and outcome == "ok"]
    if successes:
        phase.time_to_recovery_s = round(successes[0] - back_at, 3)
    return phase


async def burst_phase(stack: "ChaosStack", cfg: ChaosConfig, rng: random.Random) -> PhaseResult:
    phase = PhaseResult(f"overload burst ({cfg.burst} concurrent)")
    burst = ChaosConfig(**{**asdict(cfg), "concurrency": cfg.burst, "max_tokens": cfg.max_tokens * 4})
    await traffic(stack.base, stack.served_model, burst, phase, asyncio.Event(), rng, total=cfg.burst)
    return phase


# ---- the stack -----------------------------------------------------------------------------------------

class ChaosStack:
    """1 prefill + 2 decodes + router. A killed worker is restarted on the ports it had (the router knows it by
    address): they are picked outside the kernel's ephemeral range (`free_port`), where nothing else takes them
    meanwhile."""

    def __init__(self, procs: LocalProcesses, model: str, decodes: int = 2):
        self.procs, self.model = procs, model
        self.prefill_port, self.boot = free_port(HOST), free_port(HOST)
        self.decode_ports = [free_port(HOST) for _ in range(decodes)]
        self.prefill = self._start_prefill()
        self.decodes = [self._worker("decode", port) for port in self.decode_ports]
        self.killed = 0  # the decode kill_decode chose
        for child in (self.prefill, *self.decodes):
            procs.port(child, WORKER_LISTENING)
        self.router = procs.start_router(model, "chaos", extra=ROUTER_FLAGS + self._worker_flags())
        self.base = procs.wait_router(self.router)
        with urllib.request.urlopen(f"{self.base}/v1/models", timeout=10) as resp:
            self.served_model = json.load(resp)["data"][0]["id"]

    def _worker_flags(self) -> tuple:
        flags = ("--prefill", f"grpc://{HOST}:{self.prefill_port},{self.boot}")
        for port in self.decode_ports:
            flags += ("--decode", f"grpc://{HOST}:{port}")
        return flags

    def _start_prefill(self) -> Child:
        return self._worker("prefill", self.prefill_port, ("--bootstrap-port", str(self.boot)))

    def _worker(self, role: str, port: int, extra: tuple = ()) -> Child:
        name = f"chaos-{role}-{len(self.procs.children)}"
        return self.procs.start(name, [role, "--model", self.model, "--host", HOST, "--port", str(port),
                                       "--max-total-tokens", "16384", *WORKER_FLAGS, *extra])

    async def kill_decode(self, within_s: float = 10.0, streaming_s: float = 0.05) -> None:
        """SIGKILL a decode while requests are in its running batch, so their streams are cut mid-flight (the
        router's cache-aware policy may send every request of one prompt to one decode). A request the decode has
        only just admitted has streamed no token yet, and a kill then makes it a retry rather than a migration:
        the decodes' own running counts are polled until one reports running requests on two polls `streaming_s`
        apart (several decode steps: its requests have streamed tokens), or `within_s` passes and the busiest is
        killed."""
        deadline = time.monotonic() + within_s
        seen: list[int] = [0] * len(self.decode_ports)
        while True:
            running = await asyncio.to_thread(lambda: [running_requests(port) for port in self.decode_ports])
            both = [min(a, b) for a, b in zip(seen, running)]
            if max(both) > 0 or time.monotonic() > deadline:
                break
            seen = running
            await asyncio.sleep(streaming_s if max(running) > 0 else 0.01)
        self.killed = both.index(max(both)) if max(both) > 0 else running.index(max(running))
        self.decodes[self.killed].signal_group(signal.SIGKILL)

    async def restart_decode(self) -> float:
        i = self.killed
        await asyncio.to_thread(self.decodes[i].proc.wait)
        self.decodes[i] = self._worker("decode", self.decode_ports[i])
        await asyncio.to_thread(self.procs.port, self.decodes[i], WORKER_LISTENING)
        return time.monotonic()

    async def kill_prefill(self) -> None:
        self.prefill.signal_group(signal.SIGKILL)

    async def restart_prefill(self) -> float:
        await asyncio.to_thread(self.prefill.proc.wait)
        self.prefill = self._start_prefill()
        await asyncio.to_thread(self.procs.port, self.prefill, WORKER_LISTENING)
        return time.monotonic()

    async def stop_prefill(self) -> None:
        self.prefill.signal_group(signal.SIGSTOP)

    async def continue_prefill(self, after_s: float) -> float:
        await asyncio.sleep(after_s)
        self.prefill.signal_group(signal.SIGCONT)
        return time.monotonic()

    def router_rss_mb(self) -> float:
        with open(f"/proc/{self.router.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return round(kb / 1024, 1)

    def router_metrics(self) -> list[str]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as resp:
            return [line for line in resp.read().decode().splitlines() if not line.startswith("#")]

    def router_counts(self) -> dict:
        """The router's migrations and local-prefill decisions so far (from its /metrics)."""
        counts = {"migrated": 0.0, "local_prefill": 0.0}
        for line in self.router_metrics():
            if line.startswith("tandem_router_migrations_total{"):
                counts["migrated"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("tandem_router_disagg_decisions_total{") and 'decision="local"' in line:
                counts["local_prefill"] += float(line.rsplit(" ", 1)[1])
        return counts


def running_requests(port: int) -> int:
    """The requests in a worker's running batch, as its GetLoads reports them."""
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        return pb_grpc.SglangSchedulerStub(channel).GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0].num_running_reqs


def leaked(port: int, settle_s: float = 15.0) -> dict:
    """Requests and KV tokens a worker still holds once traffic is over (both must reach 0)."""
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        deadline = time.monotonic() + settle_s  # failed transfers' pages stay quarantined for 2 s
        while True:
            load = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
            if (load.num_total_reqs == 0 and load.num_used_tokens == 0) or time.monotonic() > deadline:
                return {"requests": load.num_total_reqs, "kv_tokens": load.num_used_tokens}
            time.sleep(0.25)


# ---- the run -------------------------------------------------------------------------------------------

async def counted(stack: ChaosStack, run) -> PhaseResult:
    """Run a phase; its migrations and local prefills are the router's counters' growth meanwhile."""
    before = await asyncio.to_thread(stack.router_counts)
    phase = await run
    after = await asyncio.to_thread(stack.router_counts)
    phase.migrated = int(after["migrated"] - before["migrated"])
    phase.local_prefill = int(after["local_prefill"] - before["local_prefill"])
    return phase


async def run_phases(stack: ChaosStack, cfg: ChaosConfig) -> list[PhaseResult]:
    rng = random.Random(cfg.seed)
    runs = [
        mixed_phase(stack, cfg, rng),
        # Long outputs: at the kill most of the decode's requests are streaming, not waiting for their KV.
        fault_phase(f"decode SIGKILL (1 of 2) mid-stream, restarted ({cfg.max_tokens * 4}-token outputs)", stack,
                    replace(cfg, max_tokens=cfg.max_tokens * 4), rng, stack.kill_decode, stack.restart_decode),
        fault_phase(f"prefill SIGSTOP {cfg.stop_s:g} s, continued", stack, cfg, rng, stack.stop_prefill,
                    lambda: stack.continue_prefill(cfg.stop_s)),
        fault_phase("prefill SIGKILL, restarted", stack, cfg, rng, stack.kill_prefill, stack.restart_prefill),
        burst_phase(stack, cfg, rng),
    ]
    return [await counted(stack, run) for run in runs]


def run_chaos(cfg: ChaosConfig) -> dict:
    model = cfg.model or default_model_dir(cfg.preset)
    with tempfile.TemporaryDirectory(prefix="tandem-chaos-") as logs, LocalProcesses(Path(logs)) as procs:
        started = time.monotonic()
        stack = ChaosStack(procs, model)
        rss_before = stack.router_rss_mb()
        phases = asyncio.run(run_phases(stack, cfg))
        result = {
            "config": asdict(cfg),
            "phases": [asdict(p) for p in phases],
            "leaks": {"prefill": leaked(stack.prefill_port),
                      **{f"decode-{i}": leaked(port) for i, port in enumerate(stack.decode_ports)}},
            "router_rss_mb": {"before": rss_before, "after": stack.router_rss_mb()},
            "seconds": round(time.monotonic() - started, 1),
        }
    return result


def render_doc(result: dict) -> str:
    """docs/reliability.md from one run's figures."""
    cfg = result["config"]
    lines = [
        "# Reliability: `tandem bench chaos`", "",
        "Figures from one run of `tandem bench chaos` on this repository's machine (2 CPU cores), 1 prefill + 2 "
        "decodes + router on 127.0.0.1 (`--disagg-policy always`, `--max-migrations 2`), the built-in model "
        f"(`--preset {cfg['preset']}`), {cfg['concurrency']} concurrent clients that never pause, "
        f"{cfg['max_tokens']} output tokens per request. Reproduce: `tandem bench chaos --write-doc "
        "docs/reliability.md` (CI runs `--short`).", "",
        "| phase | requests | ok | client disconnects | errors by kind | migrated mid-stream | prefilled on a decode "
        "| fault → first error | back → first success |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["phases"]:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(p["errors"].items())) or "—"
        tte = f"{p['time_to_error_s']:.2f} s" if p["time_to_error_s"] is not None else "—"
        ttr = f"{p['time_to_recovery_s']:.2f} s" if p["time_to_recovery_s"] is not None else "—"
        lines.append(f"| {p['name']} | {p['requests']} | {p['ok']} | {p['disconnected']} | {errors} | "
                     f"{p['migrated']} | {p['local_prefill']} | {tte} | {ttr} |")
    leaks, rss = result["leaks"], result["router_rss_mb"]
    held = ", ".join(f"{name} {leak['requests']} requests and {leak['kv_tokens']} KV tokens"
                     for name, leak in leaks.items())
    lines += ["", f"After the run: {held} (all must be 0). Router RSS {rss['before']} MB before, {rss['after']} MB "
                  f"after. The run took {result['seconds']} s.", "",
              "Error kinds: `http_<status>` a refused or failed request; `stream_error` an error event in a started "
              "stream (after tokens reached the client, the request could not migrate: `--max-migrations` spent, or "
              "no other decode); `stream_cut` a stream that ended without [DONE]; `timeout`, `connection` "
              "client-side. A request streaming from the killed decode moves to the other one with the tokens it "
              "already sent (request migration, below), and new requests go to the survivor until the decode is "
              "back. While the prefill is stopped or killed, the decodes prefill requests themselves (local-prefill "
              "fallback, under every `--disagg-policy`); \"back → first success\" then counts from the prefill's "
              "return, though nothing failed meanwhile.", ""]
    return "\n".join(lines)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("chaos", help="soak and fault run on 1 prefill + 2 decodes: disconnects, SIGKILL/SIGSTOP, overload; "
                                                  "reports errors, recovery and leaks",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = ChaosConfig()
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="model dir; unset: the built-in model of --preset, created on first use")
    p.add_argument("--preset", choices=["tiny", "small"], default=d.preset, help="built-in model size")
    p.add_argument("--requests", type=int, default=d.requests, help="requests of the mixed phase")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate,
                   help="share of mixed-phase requests whose client disconnects mid-stream")
    p.add_argument("--fault-s", type=float, default=d.fault_s, help="seconds of traffic before and after each fault")
    p.add_argument("--stop-s", type=float, default=d.stop_s, help="seconds the prefill stays SIGSTOPped")
    p.add_argument("--burst", type=int, default=d.burst, help="concurrent requests of the overload burst")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of disconnect choices")
    p.add_argument("--short", action="store_true", help="every phase with small counts (what CI runs)")
    p.add_argument("--output-json", default=None, help="also write the figures as JSON here")
    p.add_argument("--write-doc", default=None, help="render the figures into this markdown file")
    p.set_defaults(func=run)


def _sections_after(path: str) -> str:
    """The doc's own `## ` sections (e.g. the planner's measurements): kept when the chaos figures are rewritten."""
    text = Path(path).read_text() if Path(path).exists() else ""
    start = text.find("\n## ")
    return "" if start < 0 else text[start:]


def run(args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in ("model", "preset", "seed", "output_json", "write_doc")}
    sizes = {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "disconnect_rate", "fault_s",
                                           "stop_s", "burst")}
    cfg = ChaosConfig.short(**fields) if args.short else ChaosConfig(**fields, **sizes)
    result = run_chaos(cfg)
    text = json.dumps(result, indent=2)
    print(text)
    if cfg.output_json:
        Path(cfg.output_json).write_text(text + "\n")
    if cfg.write_doc:
        Path(cfg.write_doc).write_text(render_doc(result) + _sections_after(cfg.write_doc))
    leaks = result["leaks"]
    return 0 if all(v == 0 for side in leaks.values() for v in side.values()) else 1
