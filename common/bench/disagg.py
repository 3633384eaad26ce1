"""`tandem bench disagg`: conditional disaggregation measured. One prefill + one decode on 127.0.0.1 behind two
routers over the same workers, `--disagg-policy auto` and `always`; after a warm-up through each, a mixed workload (short chat turns and long
documents) sent through each in turn, rounds interleaved (the order alternates, caches flushed before each), then
the prefill SIGKILLed and the workload sent once more through each (local prefill only).

Per policy: TTFT p50/p99 of each kind, output throughput, decode ITL p99, and the router's pair/local decisions.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from tandem.common.bench.chaos import leaked
from tandem.common.bench.client import Target, open_session, run_load
from tandem.common.bench.local_stack import LocalProcesses, flush
from tandem.common.bench.metrics import SLO, latency_stats_ms, summarize
from tandem.common.bench.workloads import BenchRequest, random_words
from tandem.common.model.create import default_model_dir

POLICIES = ("always", "auto")
ROUTER_FLAGS = ("--health-check-interval-s", "0.5", "--load-poll-interval-s", "0.5")


@dataclass
class DisaggBenchConfig:
    model: Optional[str] = None
    preset: str = "tiny"
    rounds: int = 2
    chat_turns: int = 24  # short prompts per round
    documents: int = 6  # long prompts per round
    chat_words: int = 12
    document_words: int = 600
    output_len: int = 32
    concurrency: int = 8
    local_prefill_max_tokens: int = 256
    seed: int = 0
    output_json: Optional[str] = None


def workload(cfg: DisaggBenchConfig, seed: int) -> list[BenchRequest]:
    """Chat turns and documents, shuffled: the same list for both policies of a round."""
    rng = random.Random(seed)
    chats = [BenchRequest(random_words(rng, cfg.chat_words), cfg.chat_words, cfg.output_len, group=0)
             for _ in range(cfg.chat_turns)]
    documents = [BenchRequest(random_words(rng, cfg.document_words), cfg.document_words, cfg.output_len, group=1)
                 for _ in range(cfg.documents)]
    requests = chats + documents
    rng.shuffle(requests)
    return requests


def scrape(base: str, name: str) -> list:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def flush_and_forget(ports: list[int], bases: list[str], timeout_s: float = 15.0) -> None:
    """Flush the workers' caches and wait until the routers' index of the decode's cache saw it (KV events), so
    that no decision counts on a prefix gone since."""
    flush(ports)
    deadline = time.monotonic() + timeout_s
    while any(s.value for base in bases for s in scrape(base, "tandem_router_worker_cached_blocks")
              if s.labels.get("role") == "decode"):
        if time.monotonic() > deadline:
            raise RuntimeError("the routers still count cached blocks after a flush")
        time.sleep(0.1)


def decisions(base: str, since: Optional[dict] = None) -> dict[str, float]:
    """The router's tandem_router_disagg_decisions_total (attempts, retries included) as {"decision/reason":
    count}, less the counts in `since`."""
    since = since or {}
    counts = {f"{s.labels['decision']}/{s.labels['reason']}": s.value
              for s in scrape(base, "tandem_router_disagg_decisions_total")}
    return {k: v - since.get(k, 0.0) for k, v in counts.items() if v != since.get(k, 0.0)}


async def send(base: str, model: str, requests: list[BenchRequest], concurrency: int) -> tuple[list, float]:
    target = Target(base, "completions", model)
    async with open_session(target, concurrency) as session:
        return await run_load(session, target, requests, float("inf"), concurrency, seed=0)


def summary(records: list, duration_s: float) -> dict:
    """The figures this bench reports, overall and per kind (group 0: chat turns, 1: documents)."""
    figures = summarize(records, duration_s, SLO())
    out = {key: figures[key] for key in ("completed", "failed", "errors", "output_throughput")}
    out["ttft_ms"] = {k: figures["ttft_ms"][k] for k in ("p50", "p99")}
    out["itl_ms"] = {k: figures["itl_ms"][k] for k in ("p50", "p99")}
    for name, group in (("chat", 0), ("document", 1)):
        ttft = latency_stats_ms([r.ttft for r in records if r.success and r.group == group])
        out[f"{name}_ttft_ms"] = {k: ttft[k] for k in ("p50", "p99")}
    return out


def tag(requests: list[BenchRequest], records: list) -> list:
    for req, record in zip(requests, records):
        record.group = req.group
    return records


def run_bench(cfg: DisaggBenchConfig) -> dict:
    model = cfg.model or default_model_dir(cfg.preset)
    with tempfile.TemporaryDirectory(prefix="tandem-disagg-") as logs, LocalProcesses(Path(logs)) as procs:
        pd = procs.wait_pd(procs.start_pd(model, "disagg"))
        routers = {p: procs.start_router(model, p, pd, extra=(*ROUTER_FLAGS, "--disagg-policy", p,
                                                              "--local-prefill-max-tokens",
                                                              str(cfg.local_prefill_max_tokens)))
                   for p in POLICIES}
        bases = {p: procs.wait_router(r) for p, r in routers.items()}
        served = json.load(urllib.request.urlopen(bases["auto"] + "/v1/models", timeout=10))["data"][0]["id"]
        for policy in POLICIES:  # not measured: the pair's first transfer connects the NIXL agents
            asyncio.run(send(bases[policy], served, workload(cfg, -1)[:cfg.concurrency], cfg.concurrency))
        warm = {p: decisions(bases[p]) for p in POLICIES}
        records: dict[str, list] = {p: [] for p in POLICIES}
        durations = dict.fromkeys(POLICIES, 0.0)
        for rnd in range(cfg.rounds):
            requests = workload(cfg, cfg.seed + rnd)
            for policy in (POLICIES if rnd % 2 == 0 else POLICIES[::-1]):
                flush_and_forget(pd.grpc_ports, list(bases.values()))
                done, seconds = asyncio.run(send(bases[policy], served, requests, cfg.concurrency))
                records[policy] += tag(requests, done)
                durations[policy] += seconds
        result = {"config": asdict(cfg), "policies": {
            p: {**summary(records[p], durations[p]), "decisions": decisions(bases[p], warm[p])} for p in POLICIES}}
        result["prefill_down"] = prefill_down(cfg, procs, pd, bases, served)
        result["leaks"] = {"decode": leaked(pd.decode)}
    return result


def prefill_down(cfg: DisaggBenchConfig, procs: LocalProcesses, pd, bases: dict, served: str) -> dict:
    """SIGKILL the prefill, then the workload once through each router: every request prefilled on the decode."""
    prefill = next(c for c in procs.children if c.name == "disagg-prefill0")
    prefill.signal_group(signal.SIGKILL)
    prefill.proc.wait()
    killed_at = time.monotonic()
    out = {}
    requests = workload(cfg, cfg.seed + cfg.rounds)
    for policy in POLICIES:
        flush_and_forget([pd.decode], list(bases.values()))  # the first policy's prompts are no head start
        before = decisions(bases[policy])
        done, seconds = asyncio.run(send(bases[policy], served, requests, cfg.concurrency))
        out[policy] = {**summary(tag(requests, done), seconds), "decisions": decisions(bases[policy], before)}
    out["seconds_after_kill"] = round(time.monotonic() - killed_at, 1)
    return out


def _ms(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.0f}"


def render_markdown(result: dict) -> str:
    """The table docs/performance.md shows."""
    rows = ["| run | policy | ok / failed | chat TTFT p50 / p99 ms | document TTFT p50 / p99 ms | "
            "ITL p99 ms | output tok/s | decisions |", "|---|---|---|---|---|---|---|---|"]
    runs = [("both workers", result["policies"]), ("prefill SIGKILLed", result["prefill_down"])]
    for run, by_policy in runs:
        for policy in POLICIES:
            s = by_policy[policy]
            decided = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["decisions"].items())) or "—"
            rows.append(f"| {run} | {policy} | {s['completed']} / {s['failed']} | "
                        f"{_ms(s['chat_ttft_ms']['p50'])} / {_ms(s['chat_ttft_ms']['p99'])} | "
                        f"{_ms(s['document_ttft_ms']['p50'])} / {_ms(s['document_ttft_ms']['p99'])} | "
                        f"{_ms(s['itl_ms']['p99'])} | {s['output_throughput']:.1f} | {decided} |")
    return "\n".join(rows) + "\n"


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("disagg", help="conditional disaggregation: a mixed workload through 1P+1D "
                                                   "under --disagg-policy auto and always, then with the prefill "
                                                   "killed", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = DisaggBenchConfig()
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="model dir; unset: the built-in model of --preset, created on first use")
    p.add_argument("--preset", choices=["tiny", "small"], default=d.preset, help="built-in model size")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds; each sends the workload through both "
                                                                "routers, the order alternating")
    p.add_argument("--chat-turns", type=int, default=d.chat_turns, help="short prompts per round")
    p.add_argument("--documents", type=int, default=d.documents, help="long prompts per round")
    p.add_argument("--chat-words", type=int, default=d.chat_words, help="words of a chat turn")
    p.add_argument("--document-words", type=int, default=d.document_words, help="words of a document")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight at once")
    p.add_argument("--local-prefill-max-tokens", type=int, default=d.local_prefill_max_tokens,
                   help="the auto router's --local-prefill-max-tokens")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--output-json", default=None, help="also write the figures as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = DisaggBenchConfig(**{k: getattr(args, k) for k in asdict(DisaggBenchConfig())})
    result = run_bench(cfg)
    text = json.dumps(result, indent=2)
    print(text)
    print(render_markdown(result))
    if cfg.output_json:
        Path(cfg.output_json).write_text(text + "\n")
    down = result["prefill_down"]
    failed = sum(down[p]["failed"] for p in POLICIES) + sum(result["policies"][p]["failed"] for p in POLICIES)
    return 0 if failed == 0 and all(v == 0 for v in result["leaks"]["decode"].values()) else 1
