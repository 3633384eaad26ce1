"""`tandem bench hicache`: the hierarchical KV cache measured. One unified worker + router on 127.0.0.1 per cache
setup (SETUPS), a small L1 (--max-total-tokens) so the workload's working set is several times the device pool,
and the same multi-turn or shared-prefix workload through each.

Per setup: prefix hit rate (all tiers, from the router's cached-token counters; per tier from the worker's
tandem_hicache_hit_tokens_total), TTFT p50/p99, output tok/s, and the load-back bandwidth (bytes read back from
L2/L3 over the load-back seconds) next to a plain torch memory copy measured in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.bench.chaos import leaked
from tandem.common.bench.client import fetch_cache_counters
from tandem.common.bench.disagg import send
from tandem.common.bench.local_stack import HOST, WORKER_LISTENING, LocalProcesses
from tandem.common.bench.metrics import SLO, cache_hit_rate, summarize
from tandem.common.bench.workloads import (BenchRequest, load_token_counter, multi_turn_requests, random_words,
                                           shared_prefix_requests)
from tandem.common.launcher.children import free_port
from tandem.common.model.create import default_model_dir

ROUTER_FLAGS = ("--health-check-interval-s", "0.5", "--load-poll-interval-s", "0.5")
TIERS = ("device", "host", "disk")
LOADED_TIERS = ("host", "disk")  # the tiers a hit reads back from


@dataclass(frozen=True)
class CacheSetup:
    """One row of the comparison: the worker flags that make it (`{ratio}`, `{backend}` and `{storage_dir}` filled
    from the bench's flags) and whether its L3 directory starts empty."""

    name: str
    worker_flags: tuple[str, ...]
    empty_storage: bool = True

    def flags(self, hicache_ratio: float, backend: str, storage_dir: str,
              prefetch_policy: str = "wait_complete") -> tuple[str, ...]:
        return tuple(f.format(ratio=hicache_ratio, backend=backend, storage_dir=storage_dir, policy=prefetch_policy)
                     for f in self.worker_flags)


L2 = ("--enable-hierarchical-cache", "--hicache-ratio", "{ratio}")
L3 = ("--hicache-storage-backend", "{backend}", "--hicache-storage-dir", "{storage_dir}",
      "--hicache-storage-prefetch-policy", "{policy}")
SETUPS = {s.name: s for s in (
    CacheSetup("l1", ()),
    CacheSetup("l1+l2", L2),
    CacheSetup("l1+l2+l3", L2 + L3),
    # A fresh worker on the L3 directory the previous setup left: every prefix it hits, it reads from storage.
    CacheSetup("l3-second-worker", L2 + L3, empty_storage=False),
)}


@dataclass
class HiCacheBenchConfig:
    model: Optional[str] = None
    preset: str = "tiny"
    setups: tuple[str, ...] = tuple(SETUPS)
    workload: str = "multi-turn"
    conversations: int = 16
    turns: int = 4
    turn_words: int = 96
    reply_words: int = 32
    documents: int = 16
    questions: int = 4
    document_words: int = 400
    question_words: int = 16
    output_len: int = 16
    concurrency: int = 4
    l1_tokens: int = 2048
    page_size: int = 16
    hicache_ratio: float = 2.0
    storage_backend: str = "file"
    # Not the worker's best_effort: at the bench's concurrency a request is scheduled the moment it arrives, before
    # any L3 read could land, so best_effort would measure recompute; a local file read is far cheaper than that.
    prefetch_policy: str = "wait_complete"
    storage_dir: Optional[str] = None
    min_working_set_ratio: float = 4.0
    threads: int = 2
    memcpy_mib: int = 256
    seed: int = 0
    output_json: Optional[str] = None

    def validate(self) -> None:
        unknown = [s for s in self.setups if s not in SETUPS]
        if unknown or not self.setups:
            raise ValueError(f"--setups: unknown {unknown}; choose from {', '.join(SETUPS)}")
        if "l3-second-worker" in self.setups and "l1+l2+l3" not in self.setups[:self.setups.index("l3-second-worker")]:
            raise ValueError("--setups: l3-second-worker reads the L3 that l1+l2+l3 writes; list l1+l2+l3 before it")
        if self.workload == "multi-turn" and self.concurrency > self.conversations:
            raise ValueError("--concurrency must be <= --conversations: a turn must start after its previous one ended")
        for name in ("conversations", "turns", "turn_words", "documents", "questions", "document_words",
                     "output_len", "concurrency", "l1_tokens", "page_size", "threads", "memcpy_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def workload(cfg: HiCacheBenchConfig) -> list[BenchRequest]:
    if cfg.workload == "multi-turn":
        return multi_turn_requests(cfg.conversations, cfg.turns, cfg.turn_words, cfg.reply_words, cfg.output_len,
                                   cfg.seed)
    return shared_prefix_requests(cfg.documents * cfg.questions, cfg.documents, cfg.document_words,
                                  cfg.question_words, cfg.output_len, cfg.seed)


def working_set_tokens(requests: list[BenchRequest], count_tokens) -> tuple[int, int]:
    """(tokens the cache must hold for every reuse to hit, the longest request's prompt + output tokens): per
    conversation or document group, its longest prompt (the others are its prefixes or share its document)."""
    longest: dict[int, int] = {}
    for req in requests:
        longest[req.group] = max(longest.get(req.group, 0), count_tokens(req.full_prompt()))
    return sum(longest.values()), max(longest.values()) + max(r.output_len for r in requests)


def check_sizes(cfg: HiCacheBenchConfig, working_set: int, largest: int) -> None:
    if largest > cfg.l1_tokens:
        raise ValueError(f"the longest request needs {largest} tokens, more than --l1-tokens {cfg.l1_tokens}")
    if working_set < cfg.min_working_set_ratio * cfg.l1_tokens:
        raise ValueError(f"the working set ({working_set} tokens) is under --min-working-set-ratio "
                         f"{cfg.min_working_set_ratio:g} x --l1-tokens {cfg.l1_tokens}: more conversations or "
                         "documents, or a smaller L1")


def memcpy_bandwidth(mib: int, repeats: int = 5) -> dict[str, float]:
    """GB/s of a plain torch copy of `mib` MiB, best of `repeats`: host to host, and pinned host to device on CUDA."""
    import torch

    nbytes = mib << 20
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    out = {"host_to_host_gbps": nbytes / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9}
    if torch.cuda.is_available():
        pinned, device = src.pin_memory(), torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def to_device():
            device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
        out["host_to_device_gbps"] = nbytes / _best_seconds(to_device, repeats) / 1e9
    return out


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first touch of fresh pages is not the copy
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class WorkerCounters:
    """The worker's HiCache series (contract metrics); empty where the worker does not export them."""

    hit_tokens: dict[str, float] = field(default_factory=dict)  # tier -> tokens
    read_bytes: dict[str, float] = field(default_factory=dict)  # tier -> bytes read back
    load_back_seconds: Optional[float] = None

    @classmethod
    def read(cls, metrics_base: str) -> WorkerCounters:
        with urllib.request.urlopen(metrics_base + "/metrics", timeout=10) as resp:
            return cls.parse(resp.read().decode())

    @classmethod
    def parse(cls, text: str) -> WorkerCounters:
        c = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "tandem_hicache_hit_tokens_total":
                    c.hit_tokens[s.labels["tier"]] = c.hit_tokens.get(s.labels["tier"], 0.0) + s.value
                elif s.name == "tandem_hicache_bytes_total" and s.labels.get("direction") == "read":
                    c.read_bytes[s.labels["tier"]] = c.read_bytes.get(s.labels["tier"], 0.0) + s.value
                elif s.name == "tandem_hicache_load_back_seconds_sum":
                    c.load_back_seconds = (c.load_back_seconds or 0.0) + s.value
        return c

    def since(self, before: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            {k: v - before.hit_tokens.get(k, 0.0) for k, v in self.hit_tokens.items()},
            {k: v - before.read_bytes.get(k, 0.0) for k, v in self.read_bytes.items()},
            None if self.load_back_seconds is None else self.load_back_seconds - (before.load_back_seconds or 0.0))


def tier_figures(delta: WorkerCounters, queried_tokens: Optional[float]) -> dict:
    """Hit rate per tier and the load-back bandwidth, or None for what the worker does not export."""
    rates = None
    if delta.hit_tokens and queried_tokens:
        rates = {t: delta.hit_tokens.get(t, 0.0) / queried_tokens for t in TIERS}
    read = sum(delta.read_bytes.get(t, 0.0) for t in LOADED_TIERS)
    gbps = read / delta.load_back_seconds / 1e9 if delta.load_back_seconds and read else None
    return {"hit_rate_by_tier": rates, "read_bytes_by_tier": delta.read_bytes or None,
            "load_back_seconds": delta.load_back_seconds, "load_back_gbps": gbps}


async def router_counters(base: str) -> Optional[tuple[float, float]]:
    """The router's (hit, queried) prompt-token counters: responses' cached_tokens, whatever tier served them."""
    async with aiohttp.ClientSession() as session:
        return await fetch_cache_counters(session, base)


def run_setup(cfg: HiCacheBenchConfig, setup: CacheSetup, model: str, requests: list[BenchRequest],
              storage_dir: Path, logs: Path) -> dict:
    """Start the setup's worker and router, warm up off the workload, send the workload, read the counters."""
    if setup.empty_storage and storage_dir.exists():
        shutil.rmtree(storage_dir)
    storage_dir.mkdir(parents=True, exist_ok=True)
    (logs / setup.name).mkdir(parents=True, exist_ok=True)
    metrics_port = free_port()
    extra = ("--max-total-tokens", str(cfg.l1_tokens), "--max-context-len", str(cfg.l1_tokens),
             "--page-size", str(cfg.page_size), "--metrics-port", str(metrics_port),
             *setup.flags(cfg.hicache_ratio, cfg.storage_backend, str(storage_dir), cfg.prefetch_policy))
    tag = f"hicache-{setup.name.replace('+', '-')}"
    with LocalProcesses(logs / setup.name) as procs:
        worker = procs.worker(f"{tag}-worker", "worker", model, cfg.threads, None, extra)
        port = procs.port(worker, WORKER_LISTENING)
        base = procs.wait_router(procs.start_router(model, tag, worker=port, extra=ROUTER_FLAGS))
        served = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
        warm = [BenchRequest(random_words(random.Random(-1), 32), 32, cfg.output_len)]
        asyncio.run(send(base, served, warm, 1))  # not measured, and shares no prefix with the workload
        metrics_base = f"http://{HOST}:{metrics_port}"
        worker_before, counters_before = WorkerCounters.read(metrics_base), asyncio.run(router_counters(base))
        records, seconds = asyncio.run(send(base, served, requests, cfg.concurrency))
        worker_after, counters_after = WorkerCounters.read(metrics_base), asyncio.run(router_counters(base))
        leaks = leaked(port)
    figures = summarize(records, seconds, SLO(), cache_hit_rate(counters_before, counters_after))
    queried = None if counters_before is None or counters_after is None else counters_after[1] - counters_before[1]
    return {"setup": setup.name, "worker_flags": list(extra), "completed": figures["completed"],
            "failed": figures["failed"], "errors": figures["errors"], "cache_hit_rate": figures["cache_hit_rate"],
            "ttft_ms": {k: figures["ttft_ms"][k] for k in ("p50", "p99")},
            "output_throughput": figures["output_throughput"], "duration_s": figures["duration_s"],
            **tier_figures(worker_after.since(worker_before), queried), "leaks": leaks}


def run_bench(cfg: HiCacheBenchConfig) -> dict:
    cfg.validate()
    model = cfg.model or default_model_dir(cfg.preset)
    requests = workload(cfg)
    working_set, largest = working_set_tokens(requests, load_token_counter(model))
    check_sizes(cfg, working_set, largest)
    result = {"config": asdict(cfg), "working_set_tokens": working_set, "l1_tokens": cfg.l1_tokens,
              "memcpy": memcpy_bandwidth(cfg.memcpy_mib), "setups": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-hicache-") as scratch:
        storage_dir = Path(cfg.storage_dir or Path(scratch) / "l3")
        for name in cfg.setups:
            try:
                result["setups"][name] = run_setup(cfg, SETUPS[name], model, requests, storage_dir, Path(scratch))
            except RuntimeError as e:  # a worker that refused its flags or died: the next setup still runs
                result["setups"][name] = {"setup": name, "error": str(e)[-2000:]}
    return result


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_markdown(result: dict) -> str:
    copy = result["memcpy"]
    rows = [f"working set {result['working_set_tokens']} tokens, L1 {result['l1_tokens']} tokens "
            f"({result['working_set_tokens'] / result['l1_tokens']:.1f}x); torch memcpy host->host "
            f"{copy['host_to_host_gbps']:.1f} GB/s" + (f", host->device {copy['host_to_device_gbps']:.1f} GB/s"
                                                       if "host_to_device_gbps" in copy else ""), "",
            "| setup | ok / failed | hit rate | device / host / disk | TTFT p50 / p99 ms | output tok/s | "
            "load-back GB/s |", "|---|---|---|---|---|---|---|"]
    for name, s in result["setups"].items():
        if "error" in s:
            last_line = s["error"].strip().splitlines()[-1]  # the worker's own complaint, e.g. an unknown flag
            rows.append(f"| {name} | failed to run: {last_line[:100]} | | | | | |")
            continue
        tiers = s["hit_rate_by_tier"]
        by_tier = " / ".join(f"{tiers[t]:.0%}" for t in TIERS) if tiers else "—"
        rows.append(f"| {name} | {s['completed']} / {s['failed']} | {_fmt(s['cache_hit_rate'], '.0%')} | {by_tier} | "
                    f"{_fmt(s['ttft_ms']['p50'], '.0f')} / {_fmt(s['ttft_ms']['p99'], '.0f')} | "
                    f"{s['output_throughput']:.1f} | {_fmt(s['load_back_gbps'], '.2f')} |")
    return "\n".join(rows) + "\n"


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("hicache", help="the hierarchical KV cache: one workload through a worker with "
                                                    "L1 only, L1+L2, L1+L2+L3 and a second worker on the first's L3",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = HiCacheBenchConfig()
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="model dir; unset: the built-in model of --preset, created on first use")
    p.add_argument("--preset", choices=["tiny", "small"], default=d.preset, help="built-in model size")
    p.add_argument("--setups", default=",".join(d.setups), help=f"comma list, in run order, of {', '.join(SETUPS)}")
    p.add_argument("--workload", choices=["multi-turn", "shared-prefix"], default=d.workload,
                   help="conversations re-sending their history, or documents each asked several questions")
    p.add_argument("--conversations", type=int, default=d.conversations, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=d.turns, help="multi-turn: turns per conversation")
    p.add_argument("--turn-words", type=int, default=d.turn_words, help="multi-turn: words of a user turn")
    p.add_argument("--reply-words", type=int, default=d.reply_words, help="multi-turn: words of a reply in the history")
    p.add_argument("--documents", type=int, default=d.documents, help="shared-prefix: documents")
    p.add_argument("--questions", type=int, default=d.questions, help="shared-prefix: questions per document")
    p.add_argument("--document-words", type=int, default=d.document_words, help="shared-prefix: words of a document")
    p.add_argument("--question-words", type=int, default=d.question_words, help="shared-prefix: words of a question")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    p.add_argument("--l1-tokens", type=int, default=d.l1_tokens, help="the worker's --max-total-tokens (L1)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="the worker's --page-size")
    p.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio, help="the L2 setups' --hicache-ratio")
    p.add_argument("--storage-backend", choices=["file", "nixl"], default=d.storage_backend,
                   help="the L3 setups' --hicache-storage-backend")
    p.add_argument("--prefetch-policy", choices=["best_effort", "wait_complete", "timeout"],
                   default=d.prefetch_policy, help="the L3 setups' --hicache-storage-prefetch-policy")
    p.add_argument("--storage-dir", default=None, help="the L3 setups' --hicache-storage-dir (default: a temporary "
                                                       "directory); emptied before l1+l2+l3")
    p.add_argument("--min-working-set-ratio", type=float, default=d.min_working_set_ratio,
                   help="refuse a workload whose working set is under this many L1s")
    p.add_argument("--threads", type=int, default=d.threads, help="the worker's --num-threads")
    p.add_argument("--memcpy-mib", type=int, default=d.memcpy_mib, help="size of the reference torch copy")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--output-json", default=None, help="also write the figures as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    values = {k: getattr(args, k) for k in asdict(HiCacheBenchConfig())}
    values["setups"] = tuple(s.strip() for s in args.setups.split(",") if s.strip())
    result = run_bench(HiCacheBenchConfig(**values))
    text = json.dumps(result, indent=2)
    print(text)
    print(render_markdown(result))
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    ok = all("error" not in s and s["failed"] == 0 and not any(s["leaks"].values()) for s in result["setups"].values())
    return 0 if ok else 1
