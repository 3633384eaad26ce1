"""`tandem bench report`: reproduces docs/performance.md — starts the processes each comparison needs on 127.0.0.1,
runs the compared setups side by side (interleaved rounds, one setup active at a time), prints JSON summaries and
stops every process it started.

Sections: offline (full stack vs in-process engine), pd (disaggregated vs unified under long-prompt interference),
prefix (radix cache on/off; cache_aware vs round_robin over 2 prefill workers), overhead (router vs direct gRPC),
kv (`tandem bench kv`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.bench import client, workloads
from common.bench.metrics import SLO, RequestRecord, cache_hit_rate, latency_stats_ms, summarize

ENGINE = ("--max-total-tokens", "32768", "--max-context-len", "4096")


def machine_state() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "ram_gib": round(mem_kb / 2**20, 1),
            "torch": torch.__version__, "python": platform.python_version(), "loadavg": os.getloadavg()}


class Procs:
    """Child processes started by this run; stop() ends exactly those, by pid."""

    def __init__(self, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, name: str, args: list[str], cores: str | None = None) -> subprocess.Popen:
        cmd = (["taskset", "-c", cores] if cores else []) + [sys.executable, "-m", "common.cli", *args]
        log = open(self.log_dir / f"{name}.log", "w")
        print(f"[report] start {name}: {' '.join(cmd)}", file=sys.stderr)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def wait_grpc(port: int, timeout: float = 120.0) -> None:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)


def wait_http(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/readiness", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} not ready")
        time.sleep(0.5)


def worker_args(role: str, model: str, port: int, threads: int, extra: tuple = (), boot: int | None = None) -> list:
    args = [role, "--model", model, "--port", str(port), "--num-threads", str(threads), *ENGINE, *extra]
    if boot is not None:
        args += ["--bootstrap-port", str(boot)]
    return args


def start_pd(procs: Procs, model: str, tag: str, n_prefill: int = 1, prefill_cores=("0",), decode_cores="1",
             threads: int = 1, prefill_extra: tuple = (), decode_extra: tuple = ()) -> tuple[list, int]:
    """n prefill + 1 decode; returns (prefill specs for --prefill, decode port)."""
    specs = []
    for i in range(n_prefill):
        port, boot = free_port(), free_port()
        procs.start(f"{tag}-prefill{i}", worker_args("prefill", model, port, threads, prefill_extra, boot),
                    prefill_cores[i % len(prefill_cores)])
        specs.append((port, boot))
    dport = free_port()
    procs.start(f"{tag}-decode", worker_args("decode", model, dport, threads, decode_extra), decode_cores)
    for port, _ in specs:
        wait_grpc(port)
    wait_grpc(dport)
    return specs, dport


def start_router(procs: Procs, model: str, tag: str, prefill=(), decode=None, worker=None,
                 extra: tuple = ()) -> str:
    port = free_port()
    args = ["router", "--port", str(port), "--grpc-port", str(free_port()), "--model-path", model, *extra]
    for p, b in prefill:
        args += ["--prefill", f"grpc://127.0.0.1:{p},{b}"]
    if decode:
        args += ["--decode", f"grpc://127.0.0.1:{decode}"]
    if worker:
        args += ["--worker", f"grpc://127.0.0.1:{worker}"]
    procs.start(f"{tag}-router", args)
    base = f"http://127.0.0.1:{port}"
    wait_http(base)
    return base


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


def flush(ports: list[int]) -> None:
    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    for port in ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for _ in range(50):
                if pb_grpc.SglangSchedulerStub(ch).FlushCache(common_pb2.FlushCacheRequest()).success:
                    break
                time.sleep(0.1)


# ---------------------------------------------------------------- 1. full stack vs offline engine

OFFLINE_SNIPPET = r"""
import json, sys, time
from common.config import EngineConfig
from common.engine import Engine
from common.sampling.params import SamplingParams
from common.scheduler.io_struct import GenerateRequest
from common.launcher.children import free_port
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


def tokenize(model: str, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return [tok.encode(t).ids for t in texts]


def section_offline(model: str, out: Path, rounds: int) -> dict:
    reqs = workloads.random_requests(64, 44, 64, 1.0, 0)  # 44 words ~ 128 tokens
    prompts_path = out / "offline_prompts.json"
    prompts_path.write_text(json.dumps(tokenize(model, [r.full_prompt() for r in reqs])))
    procs = Procs(out)
    results: dict = {"stack": [], "offline_engine": []}
    try:
        specs, dport = start_pd(procs, model, "s1")
        base = start_router(procs, model, "s1", prefill=specs, decode=dport)
        for _ in range(rounds):
            flush([specs[0][0], dport])  # the stack starts cold each round, like the fresh offline engine
            s, _ = asyncio.run(bench(base, reqs))
            results["stack"].append(brief(s))
            p = subprocess.run(["taskset", "-c", "0,1", sys.executable, "-c", OFFLINE_SNIPPET, model,
                                str(prompts_path), "64", "2"], capture_output=True, text=True, timeout=300)
            results["offline_engine"].append(json.loads(p.stdout.strip().splitlines()[-1]))
    finally:
        procs.stop()
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


def section_pd(model: str, out: Path, rounds: int, duration: float, short_rate: float, long_every: float,
               long_len: int) -> dict:
    procs = Procs(out)
    results: dict = {"pd": [], "unified": []}
    try:
        specs, dport = start_pd(procs, model, "pd")
        pd_base = start_router(procs, model, "pd", prefill=specs, decode=dport)
        uport = free_port()
        procs.start("uni-worker", worker_args("worker", model, uport, 2), "0,1")
        wait_grpc(uport)
        uni_base = start_router(procs, model, "uni", worker=uport)
        for r in range(rounds):
            for name, base in (("pd", pd_base), ("unified", uni_base)):
                results[name].append(asyncio.run(mixed_load(base, duration, short_rate, long_every, long_len, r)))
                print(f"[report] pd round {r} {name}: {json.dumps(results[name][-1]['short']['itl_ms'])}",
                      file=sys.stderr)
    finally:
        procs.stop()
    return results


# ---------------------------------------------------------------- 3. prefix cache on/off; cache_aware vs round_robin

POLICY_GROUPS = 5  # odd: with 2 prefill workers, round_robin cannot keep a group on one worker
POLICY_PREFIX_WORDS = 160  # ~470 prefix tokens, ~500 per prompt
POLICY_REQUESTS = 40
POLICY_RATE = 2.0  # req/s, Poisson
POLICY_PREFILL_POOL = 1664  # tokens per prefill worker: ~3 of the 5 prefixes


def section_prefix(model: str, out: Path, rounds: int) -> dict:
    procs = Procs(out)
    results: dict = {"radix_on": [], "radix_off": [], "cache_aware": [], "round_robin": []}

    def workload(seed):
        return workloads.shared_prefix_requests(24, 4, 128, 8, 8, seed)

    def policy_workload(seed):
        reqs = workloads.shared_prefix_requests(POLICY_REQUESTS, POLICY_GROUPS, POLICY_PREFIX_WORDS, 8, 8, seed)
        random.Random(seed).shuffle(reqs)  # groups arrive in random order, not i mod groups
        return reqs

    try:
        # a) one PD pair with and without the radix cache (both ends), same cores, run in turn
        on_specs, on_d = start_pd(procs, model, "radix-on")
        off_specs, off_d = start_pd(procs, model, "radix-off", prefill_extra=("--disable-radix-cache",),
                                    decode_extra=("--disable-radix-cache",))
        on_base = start_router(procs, model, "radix-on", prefill=on_specs, decode=on_d)
        off_base = start_router(procs, model, "radix-off", prefill=off_specs, decode=off_d)
        for r in range(rounds):
            for name, base, ports in (("radix_on", on_base, [on_specs[0][0], on_d]),
                                      ("radix_off", off_base, [off_specs[0][0], off_d])):
                flush(ports)
                s, _ = asyncio.run(bench(base, workload(r), rate=1.5, seed=r))
                results[name].append(brief(s))
        procs.stop()
        # b) 2 prefill workers (core 0 and core 1) + 1 decode (unpinned); two routers over the same workers.
        # 5 groups (odd, so round_robin cannot stay group-affine) in a seeded random order, ~500-token prompts,
        # and a prefill KV pool of ~3 prefixes: one worker cannot hold all 5 groups, so a policy that spreads
        # each group over both workers evicts, while one that keeps each group on one worker need not.
        specs, dport = start_pd(procs, model, "pol", n_prefill=2, prefill_cores=("0", "1"), decode_cores="0,1",
                                prefill_extra=("--max-total-tokens", str(POLICY_PREFILL_POOL)),
                                # usage.cached_tokens is the prefill's hit; the decode's cache saves it no
                                # compute here, so it is off and the pool stays the prefill workers' story
                                decode_extra=("--disable-radix-cache",))
        bases = {pol: start_router(procs, model, pol, prefill=specs, decode=dport,
                                   extra=("--prefill-policy", pol)) for pol in ("cache_aware", "round_robin")}
        for r in range(rounds):
            for pol, base in bases.items():
                flush([p for p, _ in specs] + [dport])
                time.sleep(1.0)  # let the router's KV-event index see the flush
                s, _ = asyncio.run(bench(base, policy_workload(100 + r), rate=POLICY_RATE, seed=r))
                results[pol].append(brief(s))
                print(f"[report] prefix round {r} {pol}: hit={s['cache_hit_rate']} ttft={brief(s)['ttft_ms']}",
                      file=sys.stderr)
    finally:
        procs.stop()
    return results


# ---------------------------------------------------------------- 4. router overhead vs direct gRPC (both legs)

def direct_pd_request(p_stub, d_stub, boot: int, ids: list[int], max_new: int, pool) -> dict:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

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


def section_overhead(model: str, out: Path, n: int, in_len: int, out_len: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    procs = Procs(out)
    reqs = workloads.random_requests(n, in_len, out_len, 1.0, 7)
    ids = tokenize(model, [r.full_prompt() for r in reqs])
    via_router, direct = [], []
    try:
        specs, dport = start_pd(procs, model, "ovh")
        base = start_router(procs, model, "ovh", prefill=specs, decode=dport, extra=("--no-kv-events",))
        (pport, boot), = specs
        pch, dch = grpc.insecure_channel(f"127.0.0.1:{pport}"), grpc.insecure_channel(f"127.0.0.1:{dport}")
        p_stub, d_stub = pb_grpc.SglangSchedulerStub(pch), pb_grpc.SglangSchedulerStub(dch)

        async def one_router(req):
            model_name = await client.fetch_first_model(base, None)
            target = client.Target(base_url=base, endpoint="completions", model=model_name)
            async with client.open_session(target, None) as session:
                return await client.send_request(session, target, req, time.perf_counter())

        with ThreadPoolExecutor(4) as pool:
            for i in range(3):  # warm both paths
                direct_pd_request(p_stub, d_stub, boot, ids[i][:16], 4, pool)
                asyncio.run(one_router(workloads.random_requests(1, 16, 4, 1.0, 99 + i)[0]))
            flush([pport, dport])
            for i, req in enumerate(reqs):  # interleaved, one request at a time
                order = ("router", "direct") if i % 2 == 0 else ("direct", "router")
                for path in order:
                    if path == "router":
                        rec: RequestRecord = asyncio.run(one_router(req))
                        via_router.append({"ttft": rec.ttft, "e2e": rec.e2e, "tokens": rec.output_tokens,
                                           "prompt_tokens": rec.prompt_len, "ok": rec.success})
                    else:
                        direct.append(direct_pd_request(p_stub, d_stub, boot, ids[i], out_len, pool) |
                                      {"prompt_tokens": len(ids[i])})
        pch.close()
        dch.close()
    finally:
        procs.stop()

    def stats(rows):
        return {"n": len(rows), "ttft_ms": latency_stats_ms([r["ttft"] for r in rows if r["ttft"] is not None]),
                "e2e_ms": latency_stats_ms([r["e2e"] for r in rows]),
                "tokens": sorted({r["tokens"] for r in rows}), "prompt_tokens": sorted({r["prompt_tokens"] for r in rows})}

    return {"router": stats(via_router), "direct": stats(direct)}


# ---------------------------------------------------------------- 5. KV transfer

def section_kv(out: Path) -> dict:
    path = out / "kv.json"
    p = subprocess.run([sys.executable, "-m", "common.cli", "bench", "kv", "--tokens", "1024,4096,16384",
                        "--repeats", "5", "--output", str(path)], capture_output=True, text=True, timeout=300)
    print(p.stdout, file=sys.stderr)
    return json.loads(path.read_text()) if path.exists() else {"error": p.stderr[-2000:]}


SECTIONS = ("offline", "pd", "prefix", "overhead", "kv")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not (Path(model) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "common.cli", "model", "create", model, "--preset", "small"], check=True)
    sections = args.sections.split(",")
    doc = {"machine": machine_state()}
    for name in sections:
        t0 = time.perf_counter()
        if name == "offline":
            doc[name] = section_offline(model, out, args.rounds)
        elif name == "pd":
            doc[name] = section_pd(model, out, args.rounds, args.pd_duration, args.pd_short_rate, args.pd_long_every,
                                   args.pd_long_len)
        elif name == "prefix":
            doc[name] = section_prefix(model, out, args.rounds)
        elif name == "overhead":
            doc[name] = section_overhead(model, out, args.overhead_requests, 44, 32)
        elif name == "kv":
            doc[name] = section_kv(out)
        else:
            raise SystemExit(f"unknown section {name!r}; choose from {','.join(SECTIONS)}")
        doc[name + "_seconds"] = round(time.perf_counter() - t0, 1)
        (out / f"{name}.result.json").write_text(json.dumps(doc[name], indent=2))
        print(json.dumps({name: doc[name]}, indent=1))
    (out / "report.json").write_text(json.dumps(doc, indent=2))
    return 0


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("report", help="reproduce docs/performance.md (starts and stops its own processes)")
    p.add_argument("--model", default="/tmp/tandem-perf-model", help="model dir (created with --preset small if absent)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per comparison")
    p.add_argument("--out-dir", default="/tmp/tandem-perf")
    p.add_argument("--pd-duration", type=float, default=30.0)
    p.add_argument("--pd-short-rate", type=float, default=2.0, help="short (32 in / 64 out) requests per second")
    p.add_argument("--pd-long-every", type=float, default=5.0, help="one long prompt every N seconds")
    p.add_argument("--pd-long-len", type=int, default=520, help="words (~1500 tokens)")
    p.add_argument("--overhead-requests", type=int, default=20)
    p.set_defaults(func=run)
