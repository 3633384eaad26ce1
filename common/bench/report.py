"""`tandem bench report`: reproduces docs/performance.md — starts the processes each comparison needs on 127.0.0.1,
runs the compared setups side by side (interleaved rounds, one setup active at a time), prints JSON summaries and
stops every process it started.

Sections: offline (full stack vs in-process engine), pd (disaggregated vs unified under long-prompt interference),
prefix (radix cache on/off; cache_aware vs round_robin over 2 prefill workers), overhead (router vs direct gRPC),
kv (`tandem bench kv`), serving (router CPU per streamed token and router-added latency, this tree vs a baseline). The defaults are the measured setup; the size flags shrink a run (tests use a tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from tandem.common.tokenizer import build_backend

from tandem.common.bench import client, workloads
from tandem.common.bench.local_stack import LocalProcesses, PDWorkers, WORKER_LISTENING, can_pin, flush
from tandem.common.bench.serving import section_serving
from tandem.common.bench.metrics import SLO, RequestRecord, cache_hit_rate, latency_stats_ms, summarize
from tandem.common.cpuinfo import cpu_model_name
from tandem.common.model.create import PRESETS, create_model

SECTIONS = ("offline", "pd", "prefix", "overhead", "kv", "serving")


@dataclass
class ReportConfig:
    """Every knob of one report run; the defaults reproduce docs/performance.md."""

    model: str = "/tmp/tandem-perf-model"
    preset: str = "small"
    sections: str = ",".join(SECTIONS)
    rounds: int = 2
    out_dir: str = "/tmp/tandem-perf"
    offline_prompts: int = 64
    offline_input_len: int = 44  # words, ~130 tokens
    offline_output_len: int = 64
    pd_duration: float = 30.0
    pd_short_rate: float = 2.0
    pd_long_every: float = 5.0
    pd_long_len: int = 520  # words, ~1500 tokens
    prefix_requests: int = 24
    prefix_rate: float = 1.5
    prefix_words: int = 128
    policy_requests: int = 40
    policy_rate: float = 2.0
    policy_prefix_words: int = 160
    overhead_requests: int = 20
    overhead_input_len: int = 44
    overhead_output_len: int = 32
    kv_tokens: str = "1024,4096,16384"
    kv_repeats: int = 5
    serving_prompts: int = 96
    serving_input_len: int = 44  # words, ~128 tokens
    serving_output_len: int = 128
    serving_concurrency: int = 32
    serving_latency_requests: int = 10
    serving_latency_output_len: int = 32
    serving_baseline_tree: str = ""  # another checkout (e.g. main) to compare with, side by side

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReportConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)}).validate()

    @property
    def section_list(self) -> list[str]:
        return [s.strip() for s in self.sections.split(",") if s.strip()]

    def validate(self) -> ReportConfig:
        tree = self.serving_baseline_tree
        if tree and not (Path(tree) / "common" / "cli.py").is_file():
            raise ValueError(f"--serving-baseline-tree: {tree} is not a Tandem checkout (no common/cli.py)")
        unknown = [s for s in self.section_list if s not in SECTIONS]
        if unknown or not self.section_list:
            raise ValueError(f"--sections: unknown {','.join(unknown) or '(none given)'}; choose from "
                             f"{','.join(SECTIONS)}")
        counts = ("rounds", "offline_prompts", "offline_input_len", "offline_output_len", "pd_long_len",
                  "prefix_requests", "prefix_words", "policy_requests", "policy_prefix_words", "overhead_requests",
                  "overhead_input_len", "overhead_output_len", "kv_repeats", "serving_prompts", "serving_input_len",
                  "serving_output_len", "serving_concurrency", "serving_latency_requests",
                  "serving_latency_output_len")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("pd_duration", "pd_short_rate", "pd_long_every", "prefix_rate", "policy_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        return self


def machine_state() -> dict:
    import torch  # torch (~2 s), for its version only: -h and flag errors answer without it

    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model_name(), "ram_gib": round(mem_kb / 2**20, 1),
            "torch": torch.__version__, "python": platform.python_version(), "loadavg": os.getloadavg(),
            "pinned": can_pin("0,1")}


async def bench(base: str, requests: list[workloads.BenchRequest], rate: float = math.inf,
                max_concurrency: int | None = None, seed: int = 0, warmup: int = 2) -> tuple[dict, list]:
    model = await client.fetch_first_model(base, None)
    target = client.Target(base_url=base, endpoint="completions", model=model, request_timeout_s=300)
    async with client.open_session(target, max_concurrency) as session:
        if warmup:
            warm = workloads.random_requests(warmup, 16, 4, 1.0, seed + 999)
            await client.run_load(session, target, warm, math.inf, None, seed)
        before = await client.fetch_cache_counters(session, base)
        records, duration = await client.run_load(session, target, requests, rate, max_concurrency, seed)
        after = await client.fetch_cache_counters(session, base)
    return summarize(records, duration, SLO(), cache_hit_rate(before, after)), records


def brief(s: dict) -> dict:
    keys = ("completed", "failed", "duration_s", "output_throughput", "request_throughput", "cache_hit_rate")
    out = {k: s[k] for k in keys}
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        out[k] = {q: (None if v is None else round(v, 1)) for q, v in s[k].items()}
    if s["errors"]:
        out["errors"] = dict(list(s["errors"].items())[:3])
    return out


def tokenize(model: str, texts: list[str]) -> list[list[int]]:
    tok = build_backend(model)  # the ids the router would send for these texts
    return [tok.encode(t).ids for t in texts]


# ---------------------------------------------------------------- 1. full stack vs offline engine

OFFLINE_SNIPPET = r"""
import json, sys, time
from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
model, prompts_path, out_len, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.load(open(prompts_path))
cfg = EngineConfig(model_path=model, max_total_tokens=32768, num_threads=threads)
with Engine(cfg) as engine:
    engine.generate([GenerateRequest(f"w{i}", p[:16], SamplingParams(max_new_tokens=4, temperature=0.0))
                     for i, p in enumerate(prompts[:2])])
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    res = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    dt = time.perf_counter() - t0
tok = sum(r.completion_tokens for r in res)
print(json.dumps({"seconds": dt, "output_tokens": tok, "output_throughput": tok / dt}))
"""


def offline_engine(model: str, prompts_path: Path, output_len: int) -> dict:
    """One Engine.generate over the prompts, in a fresh process on cores 0,1 (2 threads)."""
    pin = ["taskset", "-c", "0,1"] if can_pin("0,1") else []
    p = subprocess.run([*pin, sys.executable, "-c", OFFLINE_SNIPPET, model, str(prompts_path), str(output_len), "2"],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"offline engine exited with code {p.returncode}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def section_offline(cfg: ReportConfig, out: Path) -> dict:
    reqs = workloads.random_requests(cfg.offline_prompts, cfg.offline_input_len, cfg.offline_output_len, 1.0, 0)
    prompts_path = out / "offline_prompts.json"
    prompts_path.write_text(json.dumps(tokenize(cfg.model, [r.full_prompt() for r in reqs])))
    results: dict = {"stack": [], "offline_engine": []}
    with LocalProcesses(out) as procs:
        pd = procs.wait_pd(procs.start_pd(cfg.model, "s1"))
        base = procs.wait_router(procs.start_router(cfg.model, "s1", pd))
        for _ in range(cfg.rounds):
            flush(pd.grpc_ports)  # the stack starts cold each round, like the fresh offline engine
            s, _ = client.run_client(bench(base, reqs))
            results["stack"].append(brief(s))
            results["offline_engine"].append(offline_engine(cfg.model, prompts_path, cfg.offline_output_len))
    return results


# ---------------------------------------------------------------- 2. PD vs unified under long-prompt interference

async def mixed_load(base: str, duration: float, short_rate: float, long_every: float, long_len: int,
                     seed: int) -> dict:
    shorts = workloads.random_requests(int(duration * short_rate * 1.5) + 4, 32, 64, 1.0, seed)  # ~95 tokens
    n_long = int(duration / long_every)
    longs = workloads.random_requests(n_long, long_len, 8, 1.0, seed + 1)
    model = await client.fetch_first_model(base, None)
    target = client.Target(base_url=base, endpoint="completions", model=model, request_timeout_s=300)
    async with client.open_session(target, None) as session:
        warm = workloads.random_requests(2, 16, 4, 1.0, seed + 999)
        await client.run_load(session, target, warm, math.inf, None, seed)
        start = time.perf_counter()
        gaps = client.arrival_gaps(len(shorts), short_rate, seed)
        short_tasks, long_tasks = [], []

        async def feed_shorts():
            for req, gap in zip(shorts, gaps):
                await asyncio.sleep(gap)
                if time.perf_counter() - start > duration:
                    break
                short_tasks.append(asyncio.create_task(client.send_request(session, target, req, start)))

        async def feed_longs():
            for req in longs:
                await asyncio.sleep(long_every)
                long_tasks.append(asyncio.create_task(client.send_request(session, target, req, start)))

        await asyncio.gather(feed_shorts(), feed_longs())
        short_recs = await asyncio.gather(*short_tasks)
        long_recs = await asyncio.gather(*long_tasks)
        elapsed = time.perf_counter() - start
    return {"short": brief(summarize(list(short_recs), elapsed, SLO())),
            "long": brief(summarize(list(long_recs), elapsed, SLO()))}


def section_pd(cfg: ReportConfig, out: Path) -> dict:
    results: dict = {"pd": [], "unified": []}
    with LocalProcesses(out) as procs:
        pending, uni = procs.start_pd(cfg.model, "pd"), procs.worker("uni-worker", "worker", cfg.model, 2, "0,1")
        routers = (procs.start_router(cfg.model, "pd", procs.wait_pd(pending)),
                   procs.start_router(cfg.model, "uni", worker=procs.port(uni, WORKER_LISTENING)))
        pd_base, uni_base = (procs.wait_router(r) for r in routers)
        for r in range(cfg.rounds):
            for name, base in (("pd", pd_base), ("unified", uni_base)):
                run = mixed_load(base, cfg.pd_duration, cfg.pd_short_rate, cfg.pd_long_every, cfg.pd_long_len, r)
                results[name].append(client.run_client(run))
                print(f"[report] pd round {r} {name}: {json.dumps(results[name][-1]['short']['itl_ms'])}",
                      file=sys.stderr)
    return results


# ---------------------------------------------------------------- 3. prefix cache on/off; cache_aware vs round_robin

POLICY_GROUPS = 5  # odd: with 2 prefill workers, round_robin cannot keep a group on one worker
POLICY_POOL_PROMPTS = 10 / 3  # prompts each prefill worker's KV pool holds: ~3 of 5 groups (1664 tokens as measured)


def policy_pool_tokens(model: str, reqs: list[workloads.BenchRequest], page_size: int = 16) -> int:
    """A prefill KV pool of ~3.3 average prompts, in whole pages: one worker cannot hold all 5 groups."""
    ids = tokenize(model, [r.full_prompt() for r in reqs])
    tokens = POLICY_POOL_PROMPTS * sum(map(len, ids)) / len(ids)
    return page_size * math.ceil(tokens / page_size)


def section_prefix(cfg: ReportConfig, out: Path) -> dict:
    results: dict = {"radix_on": [], "radix_off": [], "cache_aware": [], "round_robin": []}

    def radix_workload(seed):
        return workloads.shared_prefix_requests(cfg.prefix_requests, 4, cfg.prefix_words, 8, 8, seed)

    def policy_workload(seed):
        reqs = workloads.shared_prefix_requests(cfg.policy_requests, POLICY_GROUPS, cfg.policy_prefix_words, 8, 8,
                                                seed)
        random.Random(seed).shuffle(reqs)  # groups arrive in random order, not i mod groups
        return reqs

    # a) one PD pair with and without the radix cache (both ends), same cores, run in turn
    with LocalProcesses(out) as procs:
        pending = (procs.start_pd(cfg.model, "radix-on"),
                   procs.start_pd(cfg.model, "radix-off", prefill_extra=("--disable-radix-cache",),
                                  decode_extra=("--disable-radix-cache",)))
        on, off = (procs.wait_pd(p) for p in pending)
        routers = procs.start_router(cfg.model, "radix-on", on), procs.start_router(cfg.model, "radix-off", off)
        on_base, off_base = (procs.wait_router(r) for r in routers)
        for r in range(cfg.rounds):
            for name, base, pd in (("radix_on", on_base, on), ("radix_off", off_base, off)):
                flush(pd.grpc_ports)
                s, _ = client.run_client(bench(base, radix_workload(r), rate=cfg.prefix_rate, seed=r))
                results[name].append(brief(s))
    # b) 2 prefill workers (core 0 and core 1) + 1 decode (unpinned); two routers over the same workers.
    # 5 groups (odd, so round_robin cannot stay group-affine) in a seeded random order, ~500-token prompts,
    # and a prefill KV pool of ~3 prefixes: one worker cannot hold all 5 groups, so a policy that spreads
    # each group over both workers evicts, while one that keeps each group on one worker need not.
    pool = policy_pool_tokens(cfg.model, policy_workload(100))
    results["policy_prefill_pool_tokens"] = pool
    with LocalProcesses(out) as procs:
        pd = procs.wait_pd(procs.start_pd(cfg.model, "pol", n_prefill=2, prefill_cores=("0", "1"),
                                          decode_cores="0,1", prefill_extra=("--max-total-tokens", str(pool)),
                                          # usage.cached_tokens is the prefill's hit; the decode's cache saves
                                          # it no compute here, so it is off and the pool stays the prefill's
                                          decode_extra=("--disable-radix-cache",)))
        routers = {pol: procs.start_router(cfg.model, pol, pd, extra=("--prefill-policy", pol))
                   for pol in ("cache_aware", "round_robin")}
        bases = {pol: procs.wait_router(router) for pol, router in routers.items()}
        for r in range(cfg.rounds):
            for pol, base in bases.items():
                flush(pd.grpc_ports)
                time.sleep(1.0)  # let the router's KV-event index see the flush
                s, _ = client.run_client(bench(base, policy_workload(100 + r), rate=cfg.policy_rate, seed=r))
                results[pol].append(brief(s))
                print(f"[report] prefix round {r} {pol}: hit={s['cache_hit_rate']} ttft={brief(s)['ttft_ms']}",
                      file=sys.stderr)
    return results


# ---------------------------------------------------------------- 4. router overhead vs direct gRPC (both legs)

def direct_pd_request(p_stub, d_stub, boot: int, ids: list[int], max_new: int, pool) -> dict:
    req = pb.GenerateRequest(
        request_id=f"direct-{random.getrandbits(48)}", tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, top_p=1.0, top_k=-1,
                                          repetition_penalty=1.0, ignore_eos=True),
        stream=True, disaggregated_params=pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=random.randrange(0, 2**31)))
    t0 = time.perf_counter()
    pf = pool.submit(lambda: list(p_stub.Generate(req, timeout=120)))
    ttft, tokens = None, 0
    for resp in d_stub.Generate(req, timeout=120):
        if resp.HasField("chunk") and resp.chunk.token_ids:
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens += len(resp.chunk.token_ids)
        elif resp.HasField("complete"):
            tokens = max(tokens, len(resp.complete.output_ids))
    e2e = time.perf_counter() - t0
    pf.result()
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens}


def overhead_stats(rows: list[dict]) -> dict:
    return {"n": len(rows), "ttft_ms": latency_stats_ms([r["ttft"] for r in rows if r["ttft"] is not None]),
            "e2e_ms": latency_stats_ms([r["e2e"] for r in rows]), "tokens": sorted({r["tokens"] for r in rows}),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in rows})}


def compare_paths(base: str, pd: PDWorkers, reqs: list[workloads.BenchRequest], ids: list[list[int]],
                  out_len: int) -> tuple[list[dict], list[dict]]:
    """Each request once through the router and once straight to the workers, alternating which goes first."""
    async def one_router(req):
        model_name = await client.fetch_first_model(base, None)
        target = client.Target(base_url=base, endpoint="completions", model=model_name)
        async with client.open_session(target, None) as session:
            return await client.send_request(session, target, req, time.perf_counter())

    (pport, boot), = pd.prefill
    via_router, direct = [], []
    with grpc.insecure_channel(f"127.0.0.1:{pport}") as pch, grpc.insecure_channel(f"127.0.0.1:{pd.decode}") as dch, \
            ThreadPoolExecutor(4) as pool:
        p_stub, d_stub = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)
        for i in range(3):  # warm both paths
            direct_pd_request(p_stub, d_stub, boot, ids[i % len(ids)][:16], 4, pool)
            client.run_client(one_router(workloads.random_requests(1, 16, 4, 1.0, 99 + i)[0]))
        flush(pd.grpc_ports)
        for i, req in enumerate(reqs):  # interleaved, one request at a time
            for path in (("router", "direct") if i % 2 == 0 else ("direct", "router")):
                if path == "router":
                    rec: RequestRecord = client.run_client(one_router(req))
                    via_router.append({"ttft": rec.ttft, "e2e": rec.e2e, "tokens": rec.output_tokens,
                                       "prompt_tokens": rec.prompt_len, "ok": rec.success})
                else:
                    direct.append(direct_pd_request(p_stub, d_stub, boot, ids[i], out_len, pool) |
                                  {"prompt_tokens": len(ids[i])})
    return via_router, direct


def section_overhead(cfg: ReportConfig, out: Path) -> dict:
    reqs = workloads.random_requests(cfg.overhead_requests, cfg.overhead_input_len, cfg.overhead_output_len, 1.0, 7)
    ids = tokenize(cfg.model, [r.full_prompt() for r in reqs])
    with LocalProcesses(out) as procs:
        pd = procs.wait_pd(procs.start_pd(cfg.model, "ovh"))
        base = procs.wait_router(procs.start_router(cfg.model, "ovh", pd, extra=("--no-kv-events",)))
        via_router, direct = compare_paths(base, pd, reqs, ids, cfg.overhead_output_len)
    return {"router": overhead_stats(via_router), "direct": overhead_stats(direct)}


# ---------------------------------------------------------------- 5. KV transfer

def section_kv(cfg: ReportConfig, out: Path) -> dict:
    path = out / "kv.json"
    p = subprocess.run([sys.executable, "-m", "tandem.common.cli", "bench", "kv", "--tokens", cfg.kv_tokens,
                        "--repeats", str(cfg.kv_repeats), "--output", str(path)],
                       capture_output=True, text=True, timeout=300)
    print(p.stdout, file=sys.stderr)
    return json.loads(path.read_text()) if p.returncode == 0 and path.exists() else {"error": p.stderr[-2000:]}


SECTION_RUNNERS = {"offline": section_offline, "pd": section_pd, "prefix": section_prefix,
                   "overhead": section_overhead, "kv": section_kv, "serving": section_serving}


def run(args: argparse.Namespace) -> int:
    cfg = ReportConfig.from_args(args)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if set(cfg.section_list) - {"kv"} and not (Path(cfg.model) / "config.json").exists():
        print(f"[report] creating the built-in {cfg.preset} model in {cfg.model}", file=sys.stderr)
        create_model(cfg.model, arch="llama", preset=cfg.preset)
    doc = {"machine": machine_state()}
    for name in cfg.section_list:
        t0 = time.perf_counter()
        doc[name] = SECTION_RUNNERS[name](cfg, out)
        doc[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        (out / f"{name}.result.json").write_text(json.dumps(doc[name], indent=2))
        print(json.dumps({name: doc[name]}, indent=1))
    (out / "report.json").write_text(json.dumps(doc, indent=2))
    return 0


def register(bench_subparsers) -> None:
    d = ReportConfig  # the defaults
    p = bench_subparsers.add_parser("report", help="reproduce docs/performance.md (starts and stops its own processes)",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", "--model-path", dest="model", default=d.model,
                   help="model dir; the built-in model of --preset is created there if it holds no config.json")
    p.add_argument("--preset", choices=sorted(PRESETS), default=d.preset, help="size of the model created at --model")
    p.add_argument("--sections", default=d.sections, help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="interleaved rounds per comparison (offline, pd, prefix)")
    p.add_argument("--out-dir", default=d.out_dir, help="where <section>.result.json, report.json and logs go")
    g = p.add_argument_group("offline: full stack vs in-process engine")
    g.add_argument("--offline-prompts", type=int, default=d.offline_prompts, help="prompts, all sent at once")
    g.add_argument("--offline-input-len", type=int, default=d.offline_input_len,
                   help="words (~3 tokens each) per prompt")
    g.add_argument("--offline-output-len", type=int, default=d.offline_output_len, help="output tokens per prompt")
    g = p.add_argument_group("pd: disaggregated vs unified under long prompts")
    g.add_argument("--pd-duration", type=float, default=d.pd_duration, help="seconds of load per setup and round")
    g.add_argument("--pd-short-rate", type=float, default=d.pd_short_rate,
                   help="short (32 words in / 64 tokens out) requests per second")
    g.add_argument("--pd-long-every", type=float, default=d.pd_long_every, help="one long prompt every N seconds")
    g.add_argument("--pd-long-len", type=int, default=d.pd_long_len, help="words per long prompt (520: ~1500 tokens)")
    g = p.add_argument_group("prefix: radix cache on/off, then cache_aware vs round_robin")
    g.add_argument("--prefix-requests", type=int, default=d.prefix_requests, help="radix on/off: requests per run")
    g.add_argument("--prefix-rate", type=float, default=d.prefix_rate, help="radix on/off: requests/s (Poisson)")
    g.add_argument("--prefix-words", type=int, default=d.prefix_words, help="radix on/off: words in each of 4 prefixes")
    g.add_argument("--policy-requests", type=int, default=d.policy_requests, help="policies: requests per run")
    g.add_argument("--policy-rate", type=float, default=d.policy_rate, help="policies: requests/s (Poisson)")
    g.add_argument("--policy-prefix-words", type=int, default=d.policy_prefix_words,
                   help="policies: words in each of 5 prefixes (the prefill pool is sized from them)")
    g = p.add_argument_group("overhead: router vs direct gRPC")
    g.add_argument("--overhead-requests", type=int, default=d.overhead_requests,
                   help="requests per path, one at a time")
    g.add_argument("--overhead-input-len", type=int, default=d.overhead_input_len, help="words per prompt")
    g.add_argument("--overhead-output-len", type=int, default=d.overhead_output_len, help="output tokens per request")
    g = p.add_argument_group("kv: `tandem bench kv`")
    g.add_argument("--kv-tokens", default=d.kv_tokens, help="comma-separated prompt lengths in tokens")
    g.add_argument("--kv-repeats", type=int, default=d.kv_repeats, help="transfers per prompt length")
    g = p.add_argument_group("serving: router + unified worker, this tree vs --serving-baseline-tree")
    g.add_argument("--serving-prompts", type=int, default=d.serving_prompts, help="streamed requests per run")
    g.add_argument("--serving-input-len", type=int, default=d.serving_input_len, help="words per prompt")
    g.add_argument("--serving-output-len", type=int, default=d.serving_output_len, help="output tokens per request")
    g.add_argument("--serving-concurrency", type=int, default=d.serving_concurrency, help="streams in flight")
    g.add_argument("--serving-latency-requests", type=int, default=d.serving_latency_requests,
                   help="router-added latency: requests per path, one at a time")
    g.add_argument("--serving-latency-output-len", type=int, default=d.serving_latency_output_len,
                   help="router-added latency: output tokens per request")
    g.add_argument("--serving-baseline-tree", default=d.serving_baseline_tree,
                   help="a second checkout (e.g. /work/main) run side by side with this one, same workload")
    p.set_defaults(func=run)
