"""`tandem bench report --sections serving`: the serving path (router + unified worker) of this tree, and of a
baseline checkout when given, side by side — throughput under concurrent streams, router and worker CPU per
streamed token, SSE chunks per token, and the latency the router adds over direct gRPC at concurrency 1."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.bench import client, workloads
from tandem.common.bench.local_stack import REPO_ROOT, WORKER_LISTENING, LocalProcesses, flush
from tandem.common.bench.metrics import RequestRecord, latency_stats_ms

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def direct_request(stub, ids: list[int], max_new: int) -> dict:
    """What the router sends a unified worker, straight over gRPC: one streamed Generate of the same token ids."""
    req = pb.GenerateRequest(
        request_id=f"direct-{random.getrandbits(48)}", tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, top_p=1.0, top_k=-1,
                                          repetition_penalty=1.0, ignore_eos=True))
    t0 = time.perf_counter()
    ttft = None
    for resp in stub.Generate(req, timeout=120):
        if ttft is None and resp.HasField("chunk") and resp.chunk.token_ids:
            ttft = time.perf_counter() - t0
    return {"ttft": ttft, "e2e": time.perf_counter() - t0}


async def _router_request(base: str, req: workloads.BenchRequest) -> RequestRecord:
    model = await client.fetch_first_model(base, None)
    target = client.Target(base_url=base, endpoint="completions", model=model)
    async with client.open_session(target, None) as session:
        return await client.send_request(session, target, req, time.perf_counter())


def added_latency(bases: dict[str, str], worker_ports: dict[str, int], reqs: list[workloads.BenchRequest],
                  ids: list[list[int]], out_len: int) -> dict:
    """Each request once through each tree's router and once direct to its worker, one at a time, interleaved
    (trees and paths alternate which goes first)."""
    rows: dict[str, dict[str, list]] = {name: {"router": [], "direct": []} for name in bases}
    channels = {name: grpc.insecure_channel(f"127.0.0.1:{port}") for name, port in worker_ports.items()}
    try:
        stubs = {name: pb_grpc.SglangSchedulerStub(ch) for name, ch in channels.items()}
        names = list(bases)
        for i, (req, prompt_ids) in enumerate(zip(reqs, ids)):
            for name in (names if i % 2 == 0 else names[::-1]):
                for path in (("router", "direct") if i % 2 == 0 else ("direct", "router")):
                    if path == "router":
                        rec = client.run_client(_router_request(bases[name], req))
                        rows[name]["router"].append({"ttft": rec.ttft, "e2e": rec.e2e})
                    else:
                        rows[name]["direct"].append(direct_request(stubs[name], prompt_ids, out_len))
    finally:
        for ch in channels.values():
            ch.close()
    return {name: _latency_stats(paths) for name, paths in rows.items()}


def _latency_stats(paths: dict[str, list]) -> dict:
    stats = {path: {"n": len(rows),
                    "ttft_ms": latency_stats_ms([r["ttft"] for r in rows if r["ttft"] is not None]),
                    "e2e_ms": latency_stats_ms([r["e2e"] for r in rows if r["e2e"] is not None])}
             for path, rows in paths.items()}
    stats["added_ms"] = {key: round(stats["router"][key]["mean"] - stats["direct"][key]["mean"], 2)
                         for key in ("ttft_ms", "e2e_ms")}
    return stats


def loaded_run(base: str, router_pid: int, worker_pid: int, reqs: list[workloads.BenchRequest],
               concurrency: int, seed: int) -> dict:
    """The workload under `concurrency` streams, with each process's CPU time over it."""
    from tandem.common.bench.report import bench, brief  # import cycle: report imports this module

    router0, worker0 = cpu_seconds(router_pid), cpu_seconds(worker_pid)
    summary, records = client.run_client(bench(base, reqs, max_concurrency=concurrency, seed=seed, warmup=0))
    router_cpu, worker_cpu = cpu_seconds(router_pid) - router0, cpu_seconds(worker_pid) - worker0
    tokens = sum(r.output_tokens for r in records if r.success)
    chunks = sum(len(r.itl) + 1 for r in records if r.success)
    return brief(summary) | {
        "output_tokens": tokens, "sse_chunks_per_token": round(chunks / max(tokens, 1), 3),
        "router_cpu_s": round(router_cpu, 2), "worker_cpu_s": round(worker_cpu, 2),
        "router_cpu_us_per_token": round(router_cpu / max(tokens, 1) * 1e6, 1),
        "router_cpu_share": round(router_cpu / max(summary["duration_s"], 1e-9), 3)}


def section_serving(cfg, out: Path) -> dict:
    """cfg: the report's ReportConfig (serving_* knobs)."""
    from tandem.common.bench.report import tokenize  # import cycle: report imports this module

    trees = {"this": REPO_ROOT}
    if cfg.serving_baseline_tree:
        trees["baseline"] = os.path.abspath(cfg.serving_baseline_tree)
    reqs = workloads.random_requests(cfg.serving_prompts, cfg.serving_input_len, cfg.serving_output_len, 1.0, 11)
    latency_reqs = workloads.random_requests(cfg.serving_latency_requests, cfg.serving_input_len,
                                             cfg.serving_latency_output_len, 1.0, 13)
    latency_ids = tokenize(cfg.model, [r.full_prompt() for r in latency_reqs])
    result: dict = {"trees": trees, "loaded": {name: [] for name in trees}}
    with LocalProcesses(out) as procs:
        workers = {name: procs.worker(f"srv-{name}-worker", "worker", cfg.model, 2, "0,1", tree=tree)
                   for name, tree in trees.items()}
        ports = {name: procs.port(child, WORKER_LISTENING) for name, child in workers.items()}
        routers = {name: procs.start_router(cfg.model, f"srv-{name}", worker=ports[name], extra=("--no-kv-events",),
                                            tree=trees[name]) for name in trees}
        bases = {name: procs.wait_router(child) for name, child in routers.items()}
        warm = workloads.random_requests(4, 16, 8, 1.0, 99)
        for name in trees:
            loaded_run(bases[name], routers[name].pid, workers[name].pid, warm, 4, 0)
        names = list(trees)
        for r in range(cfg.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                flush([ports[name]])
                run = loaded_run(bases[name], routers[name].pid, workers[name].pid, reqs, cfg.serving_concurrency, r)
                result["loaded"][name].append(run)
                print(f"[report] serving round {r} {name}: {run['output_throughput']:.1f} tok/s, router "
                      f"{run['router_cpu_us_per_token']} us/token", file=sys.stderr)
        for name in names:
            flush([ports[name]])
        result["added_latency"] = added_latency(bases, ports, latency_reqs, latency_ids,
                                                cfg.serving_latency_output_len)
    return result
