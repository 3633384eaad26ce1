"""`tandem bench offline`: engine throughput vs HuggingFace transformers `generate`, same run; on an MoE model
also each engine's expert load (the expert-distribution recorder over the timed run)."""

from __future__ import annotations

import argparse
import time

import torch

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.bench.machine_probe import Machine, format_machine, measure_machine
from tandem.common.bench.roofline import ModelCost, RooflineRecorder, format_roofline
from tandem.common.config import EngineConfig, parse_batch_sizes
from tandem.common.cpu_threads import run_on_fresh_thread
from tandem.common.dp.engine_pool import open_engine
from tandem.common.memory.kv_pool import kv_cache_dtype
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import CPU_BF16_MATMULS, resolve_bf16_matmul, resolve_fp16_matmul
from tandem.common.model.create import ARCHS, default_model_dir
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.scheduler.step_profile import StepProfiler, format_report


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int, token_pool: int = 0) -> list[list[int]]:
    """Random prompts over the vocabulary, or over `token_pool` ids only (> 0), which skews an MoE model's routing
    toward the experts those few tokens pick."""
    gen = torch.Generator().manual_seed(seed)
    # Skip the first ids (special tokens live there in the built-in tokenizer).
    high = vocab_size if token_pool <= 0 else min(vocab_size, 16 + token_pool)
    return torch.randint(16, high, (num, input_len), generator=gen).tolist()


def threads_per_process(total: int | None, processes: int) -> int | None:
    """--num-threads is the whole engine's: its tp x pp processes share it, so each row runs on the same cores."""
    return None if total is None else max(1, total // processes)


def bench_engine(model_dir: str, dtype: str, prompts, output_len: int, args, tp_size: int = 1,
                 dp_size: int = 1, pp_size: int = 1, ep_size: int = 1, machine: Machine | None = None) -> dict:
    config = EngineConfig(model_path=model_dir, dtype=dtype, event_loop=args.event_loop,
                          max_total_tokens=args.max_total_tokens, page_size=args.page_size,
                          max_running_requests=args.max_running_requests, tp_size=tp_size, dp_size=dp_size,
                          pp_size=pp_size, ep_size=ep_size,
                          num_threads=threads_per_process(args.num_threads, max(tp_size, ep_size) * pp_size),
                          enable_eplb=args.enable_eplb, ep_num_redundant_experts=args.ep_num_redundant_experts,
                          eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
                          load_balance_method=args.load_balance_method,
                          enable_torch_compile=args.enable_torch_compile, cuda_graph_max_bs=args.cuda_graph_max_bs,
                          cuda_graph_bs=args.cuda_graph_bs, device=args.device,
                          attention_backend=args.attention_backend, disable_cuda_graph=args.disable_cuda_graph,
                          cpu_bf16_matmul=args.cpu_bf16_matmul, enable_mixed_chunk=args.enable_mixed_chunk,
                          kv_cache_dtype=args.kv_cache_dtype)
    # One scheduler's steps, each run whole on this process (a pipeline's micro-batches span several steps).
    profiler = StepProfiler() if args.profile_steps and dp_size == 1 and pp_size == 1 else None
    # One engine's recorder sees every token (each data-parallel replica has its own; a stage, some layers only).
    model_config = ModelConfig.from_pretrained(model_dir)
    record = model_config.moe is not None and dp_size == 1 and pp_size == 1
    # The roofline of one process's forwards: a single-rank engine only.
    roofline = RooflineRecorder(model_cost(model_config, dtype, args.cpu_bf16_matmul, args.device,
                                           args.kv_cache_dtype)) \
        if machine is not None and dp_size == tp_size == pp_size == ep_size == 1 else None
    with open_engine(config) as engine:
        memory = [vars(m) for m in engine.rank_memory]
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        engine.generate([GenerateRequest(f"warm-{i}", p[:16], SamplingParams(max_new_tokens=4, temperature=0.0))
                         for i, p in enumerate(prompts[:4])])
        if profiler is not None:
            engine.call(profiler.attach)
        if roofline is not None:
            engine.call(roofline.attach)
        pass_imbalance: list[list[float]] = []  # per pass and layer, under the placement of that pass
        if record:
            engine.experts.recorder.on_imbalance = pass_imbalance.append
            engine.experts.start_record()
        start = time.perf_counter()
        results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        elapsed = time.perf_counter() - start
        failed = [r for r in results if r.error]
        if failed:  # a crashed scheduler fails every request: no throughput to report
            raise RuntimeError(f"{len(failed)} of {len(results)} requests failed; the first: {failed[0].error}")
        if record:
            engine.experts.stop_record()
            load = expert_load(engine.experts.dump_record(), pass_imbalance)
            if args.enable_eplb:
                load["rebalances"] = list(engine.experts.rebalances)  # the first one's window spans the warm-up too
    tokens = sum(r.completion_tokens for r in results)
    # Weights and KV pool bytes are exact per rank; peak RSS of rank 0 is this whole benchmark process's.
    system = "tandem" + (f"-tp{tp_size}" if tp_size > 1 else "") + (f"-dp{dp_size}" if dp_size > 1 else "") + \
        (f"-pp{pp_size}" if pp_size > 1 else "") + (f"-ep{ep_size}" if ep_size > 1 else "")
    row = {"system": system, "dtype": dtype, "tp_size": config.tp_size, "dp_size": dp_size, "pp_size": pp_size,
           "ep_size": ep_size, "seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
           "rank_memory": memory}
    if profiler is not None:
        row["step_profile"] = profiler.report()
    if roofline is not None:
        row["roofline"] = roofline.report(machine)
    if record:
        row.update(load)
    return row


def model_cost(config: ModelConfig, dtype: str, bf16_matmul: str, device: str,
               kv_name: str = "auto") -> ModelCost:
    """The roofline's accounting for this engine: a bfloat16 or float16 model whose CPU linears multiply a float32
    copy (--cpu-bf16-matmul fp32; float16's auto) reads 4 bytes a weight (`widen` reads the 16-bit panels: 2); the
    KV pool holds --kv-cache-dtype's (auto: the model's dtype)."""
    model_dtype = getattr(torch, dtype)
    itemsize = model_dtype.itemsize
    resolve = {"bfloat16": resolve_bf16_matmul, "float16": resolve_fp16_matmul}.get(dtype)
    widened = resolve is not None and device == "cpu" and resolve(bf16_matmul) == "fp32"
    return ModelCost.of(config, weight_bytes=4 if widened else itemsize,
                        kv_bytes=kv_cache_dtype(kv_name, model_dtype).itemsize)


def expert_load(dump: dict, pass_imbalance: list[list[float]]) -> dict:
    """Row fields from an expert-distribution dump: per MoE layer the imbalance of the run's summed counts (max /
    mean tokens per EP rank under the final placement, 1.0 at EP 1), its mean and max over the layers; the mean
    over passes of each pass's imbalance (what a pass waits on: its busiest rank); and per layer the skew (the
    busiest expert's tokens / the mean expert's, whatever the EP size)."""
    imbalance = dump["imbalance"]
    counts = torch.tensor(dump["logical_count"], dtype=torch.float64)
    skew = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).tolist()
    per_pass = [sum(layers) / len(layers) for layers in pass_imbalance]
    return {"moe_passes": dump["num_steps"], "imbalance": imbalance,
            "imbalance_mean": sum(imbalance) / len(imbalance), "imbalance_max": max(imbalance),
            "pass_imbalance_mean": sum(per_pass) / len(per_pass) if per_pass else 1.0,
            "expert_skew": skew, "expert_skew_max": max(skew)}


def bench_hf(model_dir: str, dtype: str, prompts, output_len: int, batch_size: int, device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM  # transformers (~1 s): only the reference run (not --skip-hf)

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=kwargs["pad_token_id"])
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i: i + batch_size], device=device)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    return {"system": "hf-transformers", "dtype": dtype, "seconds": elapsed, "output_tokens": tokens,
            "tokens_per_s": tokens / elapsed}


def parallel_rows(model_dir: str, dtype: str, prompts, args: argparse.Namespace, ours: dict) -> list[dict]:
    """The parallel engines next to the single process `ours`: --tp-size, --dp-size, --pp-size and --ep-size each
    alone, or --tp-size with --pp-size as one engine of tp x pp ranks."""
    rows = []

    def run_one(**sizes) -> dict:
        rows.append(bench_engine(model_dir, dtype, prompts, args.output_len, args, **sizes))
        return rows[-1]

    tp, dp, pp = args.tp_size, args.dp_size, args.pp_size
    if tp > 1 and pp > 1:
        row = run_one(tp_size=tp, pp_size=pp)
        row["speedup_vs_pp1"] = row["tokens_per_s"] / ours["tokens_per_s"]  # vs the single process
    elif tp > 1:
        run_one(tp_size=tp)
    if dp > 1:
        row = run_one(dp_size=dp)
        row["speedup_vs_dp1"] = row["tokens_per_s"] / ours["tokens_per_s"]
    if pp > 1 and tp == 1:
        row = run_one(pp_size=pp)
        row["speedup_vs_pp1"] = row["tokens_per_s"] / ours["tokens_per_s"]
    if args.ep_size > 1:
        row = run_one(ep_size=args.ep_size)
        row["speedup_vs_ep1"] = row["tokens_per_s"] / ours["tokens_per_s"]
    return rows


def print_rank_memory(rows: list[dict]) -> None:
    """Per rank: weights and KV pool (exact bytes), peak RSS (rank 0's is the benchmark process's)."""
    print(f"\n{'system':<16} {'dtype':<9} {'rank':>4} {'weights MiB':>12} {'KV pool MiB':>12} {'peak RSS MiB':>13}")
    for r in rows:
        for m in r.get("rank_memory", []):
            print(f"{r['system']:<16} {r['dtype']:<9} {m['rank']:>4} {m['weight_bytes'] / 2**20:>12.2f} "
                  f"{m['kv_pool_bytes'] / 2**20:>12.2f} {m['peak_rss_bytes'] / 2**20:>13.1f}")


def print_expert_load(rows: list[dict]) -> None:
    """MoE rows: the expert load over the timed run, and each EPLB rebalance."""
    moe_rows = [r for r in rows if "imbalance" in r]
    if not moe_rows:
        return
    print("\nexpert load over the timed run (imbalance: max / mean tokens per EP rank, per MoE layer over the run, "
          "then per pass; skew: the busiest expert's tokens / the mean expert's)")
    print(f"{'system':<16} {'dtype':<9} {'ep':>3} {'passes':>7} {'imbal mean':>10} {'imbal max':>9} "
          f"{'per pass':>8} {'skew max':>8} {'rebal':>5} {'vs ep1':>7}")
    for r in moe_rows:
        ep_ratio = f"{r['speedup_vs_ep1']:.2f}x" if "speedup_vs_ep1" in r else ""
        print(f"{r['system']:<16} {r['dtype']:<9} {r['ep_size']:>3} {r['moe_passes']:>7} {r['imbalance_mean']:>10.3f} "
              f"{r['imbalance_max']:>9.3f} {r['pass_imbalance_mean']:>8.3f} {r['expert_skew_max']:>8.2f} {len(r.get('rebalances', [])):>5} "
              f"{ep_ratio:>7}")
        for b in r.get("rebalances", []):
            print(f"    EPLB after {b['passes']} passes: mean imbalance on that window {b['imbalance_before']:.3f} -> "
                  f"{b['imbalance_after']:.3f}")


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir(arch=args.arch)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed, args.prompt_token_pool)
    rows = []
    machine = None
    if args.roofline:  # before any engine: the probe gets the cores to itself
        if args.device != "cpu":
            raise SystemExit("--roofline: the probe measures this CPU's FMA peak and bandwidth; run it with "
                             "--device cpu")
        # On a thread of its own, as HF's runs below: a parallel op on this thread would leave it an OpenMP team
        # beside the engine's, slowing every op of the engine (common/cpu_threads.py).
        machine = run_on_fresh_thread(measure_machine, args.num_threads)
        print(f"machine: {format_machine(machine)}")
    for dtype in args.dtypes.split(","):
        ours = bench_engine(model_dir, dtype, prompts, args.output_len, args, machine=machine)
        rows += [ours, *parallel_rows(model_dir, dtype, prompts, args, ours)]
        if not args.skip_hf:
            if args.num_threads:
                torch.set_num_threads(args.num_threads)
            ref = run_on_fresh_thread(bench_hf, model_dir, dtype, prompts, args.output_len, args.hf_batch_size,
                                      args.device)
            rows.append(ref)
            ours["speedup_vs_hf"] = ours["tokens_per_s"] / ref["tokens_per_s"]
    print(f"{'system':<16} {'dtype':<9} {'out tok':>8} {'seconds':>8} {'tok/s':>9} {'vs HF':>7} {'vs dp1':>7} "
          f"{'vs pp1':>7}")
    for r in rows:
        ratio = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else ""
        dp_ratio = f"{r['speedup_vs_dp1']:.2f}x" if "speedup_vs_dp1" in r else ""
        pp_ratio = f"{r['speedup_vs_pp1']:.2f}x" if "speedup_vs_pp1" in r else ""
        print(f"{r['system']:<16} {r['dtype']:<9} {r['output_tokens']:>8} {r['seconds']:>8.2f} "
              f"{r['tokens_per_s']:>9.1f} {ratio:>7} {dp_ratio:>7} {pp_ratio:>7}")
    print_rank_memory(rows)
    print_expert_load(rows)
    if args.profile_steps:
        for r in rows:
            if "step_profile" in r:
                print(f"\nstep time split, tandem {r['dtype']} (ms per step; forward and sample overlap the "
                      f"rest in the overlap loop)\n{format_report(r['step_profile'])}")
    if machine is not None:
        for r in rows:
            if "roofline" in r:
                print(f"\nroofline, tandem {r['dtype']} (forward time of each step; against {machine.peak_gflops:.1f} "
                      f"GFLOP/s and {machine.bandwidth_gbs:.1f} GB/s measured here)\n{format_roofline(r['roofline'])}")
    if args.output_json:
        write_results_json(args.output_json, args, rows, machine=machine.as_dict() if machine else None)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "offline", "engine vs HF transformers generate, same workload")
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="without --model: the built-in small model of this architecture (qwen3_moe, qwen2_moe, "
                        "mixtral: MoE), created on first use")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (ignore_eos, greedy)")
    p.add_argument("--prompt-token-pool", type=int, default=0,
                   help="draw the prompts' ids from this many distinct tokens (0: the whole vocabulary); a small pool "
                        "skews an MoE model's routing toward the experts those tokens pick")
    p.add_argument("--hf-batch-size", type=int, default=32, help="HF generate: prompts per static batch")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--event-loop", default="overlap", choices=["normal", "overlap"], help="engine scheduler loop")
    p.add_argument("--attention-backend", default="auto",
                   help="engine: auto (cpu on CPU, triton on CUDA), cpu, torch or triton")
    p.add_argument("--page-size", type=int, default=16, help="engine: tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="engine: KV pool capacity in tokens")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="engine: KV cache dtype (auto: each --dtypes entry's own; bfloat16/float16 under float32, "
                        "fp8_e4m3, fp8_e5m2)")
    p.add_argument("--max-running-requests", type=int, default=256, help="engine: most requests decoding at once")
    p.add_argument("--tp-size", type=int, default=1,
                   help="also run the engine at this tensor-parallel size (one process per rank), same prompts")
    p.add_argument("--dp-size", type=int, default=1,
                   help="also run this many in-process data-parallel engine replicas, same prompts; reports the "
                        "speed-up over one engine")
    p.add_argument("--pp-size", type=int, default=1,
                   help="also run the engine at this pipeline-parallel size (one process per stage), same prompts; "
                        "reports the speed-up over one process and each stage's memory")
    p.add_argument("--ep-size", type=int, default=1,
                   help="MoE: also run the engine at this expert-parallel size (one process per rank; the engine "
                        "flag's attention tensor-parallel over the same ranks), same prompts; reports the speed-up "
                        "over EP 1")
    p.add_argument("--enable-eplb", action="store_true",
                   help="MoE, every engine: rebalance the experts at run time (the engine flag); rows list each "
                        "rebalance")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="MoE, every engine: extra physical expert slots per layer for EPLB's copies of hot experts")
    p.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000,
                   help="MoE with --enable-eplb: forward passes between two rebalances")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads of each engine, split evenly over its processes (tp x pp ranks) so every "
                        "row runs on as many cores, and of the HF reference (default: torch's, in every process)")
    p.add_argument("--load-balance-method", default="round_robin",
                   choices=["round_robin", "shortest_queue", "minimum_tokens"], help="with --dp-size")
    p.add_argument("--device", default="cpu", help="engine and HF reference: cpu or cuda[:N]")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="engine: decode eagerly (no CUDA graphs on CUDA, no --enable-torch-compile graphs on CPU)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="engine: decode through torch.compile graphs on CPU (compiles each bucket first)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="engine: largest decode batch run as a graph")
    p.add_argument("--cuda-graph-bs", type=parse_batch_sizes, default=None,
                   help="engine: decode batch sizes to capture, e.g. 1,2,4,8")
    p.add_argument("--cpu-bf16-matmul", default="auto", choices=CPU_BF16_MATMULS,
                   help="engine: how bfloat16 CPU linears multiply (the engine flag of that name)")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="engine: run the running requests' decode step in a prefill's forward (the engine flag)")
    p.add_argument("--profile-steps", action="store_true",
                   help="report the engine's per-step time split: schedule / prepare / forward / sample / output")
    p.add_argument("--roofline", action="store_true",
                   help="measure this CPU's FMA peak and memory bandwidth first, then report per phase (prefill, "
                        "decode) the achieved GFLOP/s and GB/s of the engine's forwards and which one bounds them "
                        "(the single-process engine's rows; --device cpu only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--skip-hf", action="store_true", help="only run the engine")
    p.add_argument("--output-json", default=None, help="also write the config and results as JSON here")
    p.set_defaults(func=run)
