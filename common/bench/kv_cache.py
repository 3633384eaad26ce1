"""`tandem bench kv-cache`: what --kv-cache-dtype fp8 (and, under a float32 model, bfloat16/float16) buys and costs
on the built-in model: tokens per pool and bytes per PD transfer, the cpu backend's decode step, and greedy agreement
with the model-dtype cache."""

from __future__ import annotations

import argparse
import statistics

import torch

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.bench.attention import decode_batch, time_steps
from tandem.common.bench.offline import make_prompts
from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.memory.kv_pool import kv_bytes_per_token, kv_cache_dtype
from tandem.common.model.config import ModelConfig
from tandem.common.model.create import default_model_dir
from tandem.common.model.loader import load_model
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.transfer.messages import KVLayout

FP8_NAMES = ("fp8_e4m3", "fp8_e5m2")
HALF_NAMES = ("bfloat16", "float16")  # under a float32 model only


def kv_names(dtype: torch.dtype) -> tuple[str, ...]:
    """The --kv-cache-dtype values compared for a model of `dtype`, the model's own first."""
    return ("auto", *(HALF_NAMES if dtype == torch.float32 else ()), *FP8_NAMES)


def capacity(mc: ModelConfig, dtype: torch.dtype, pool_mib: int, prompt_len: int, page_size: int) -> list[dict]:
    """Tokens a pool of pool_mib MiB holds, and the bytes a PD transfer of one prompt_len-token prompt moves."""
    rows = []
    for name in kv_names(dtype):
        kv_dtype = kv_cache_dtype(name, dtype)
        layout = KVLayout(mc.num_layers, page_size, mc.num_kv_heads, mc.head_dim,
                          str(kv_dtype).removeprefix("torch."), num_pages=1)
        rows.append({"kv_cache_dtype": name, "pool_dtype": layout.dtype,
                     "tokens_per_pool": (pool_mib << 20) // kv_bytes_per_token(mc.num_layers, mc.num_kv_heads,
                                                                                mc.head_dim, kv_dtype),
                     "transfer_bytes": layout.transfer_bytes(-(-prompt_len // page_size))})
    return rows


def decode_speed(model_dir: str, dtype: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per decode step on the cpu backend, model-dtype pool vs each narrower pool, in alternating
    rounds."""
    model = load_model(model_dir, dtype, "cpu", "cpu")[1]
    names = kv_names(next(model.parameters()).dtype)
    batches = {n: decode_batch(model, args.batch_size, args.context_len, args.page_size,
                               kv_dtype=kv_cache_dtype(n, next(model.parameters()).dtype)) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        time_steps(model, batches[n], 1)  # warm-up
    for _ in range(args.rounds):
        for n in names:
            times[n].append(time_steps(model, batches[n], args.steps))
    return {n: statistics.median(t) for n, t in times.items()}


def greedy(model_dir: str, dtype: str, kv_name: str, prompts: list[list[int]], output_len: int) -> list:
    config = EngineConfig(model_path=model_dir, dtype=dtype, kv_cache_dtype=kv_name, max_total_tokens=16384,
                          page_size=16)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"r{i}", p, params, return_logprob=True)
                                   for i, p in enumerate(prompts)])
    return [r.sequences[0] for r in results]


def forced_logprobs(model_dir: str, dtype: str, kv_name: str, prompts: list[list[int]], reference: list
                    ) -> list[list[float]]:
    """Teacher-forced: the logprob of each reference output token given the prompt and the reference tokens before
    it (prompt logprobs of prompt + reference output), so both runs score the same tokens in the same context."""
    config = EngineConfig(model_path=model_dir, dtype=dtype, kv_cache_dtype=kv_name, max_total_tokens=16384,
                          page_size=16, disable_radix_cache=True)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"f{i}", p + ref.output_ids, params, return_logprob=True,
                                                   logprob_start_len=len(p))
                                   for i, (p, ref) in enumerate(zip(prompts, reference))])
    return [[lp for lp in r.sequences[0].input_logprobs if lp is not None] for r in results]


def mean_abs_delta(a: list[list[float]], b: list[list[float]]) -> float:
    deltas = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b, strict=True)]
    return sum(deltas) / len(deltas)


def agreement(reference: list, quantized: list) -> dict[str, float]:
    """Share of output tokens equal position by position to the reference run's, and the mean |Δ logprob| of the
    chosen token over each request's positions before its first different token (same context on both sides)."""
    equal = total = 0
    deltas: list[float] = []
    for ref, got in zip(reference, quantized):
        total += len(ref.output_ids)
        equal += sum(a == b for a, b in zip(ref.output_ids, got.output_ids))
        for a, b, lp_a, lp_b in zip(ref.output_ids, got.output_ids, ref.logprobs, got.logprobs):
            if a != b:
                break
            deltas.append(abs(lp_a - lp_b))
    return {"token_agreement": equal / total, "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1),
            "compared_positions": len(deltas)}


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    mc = ModelConfig.from_pretrained(model_dir)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dtype = getattr(torch, args.dtype)
    rows = capacity(mc, model_dtype, args.pool_mib, args.input_len, args.page_size)
    speed = decode_speed(model_dir, args.dtype, args)
    prompts = make_prompts(args.num_prompts, args.input_len, mc.vocab_size, args.seed)
    reference = greedy(model_dir, args.dtype, "auto", prompts, args.output_len)
    forced = forced_logprobs(model_dir, args.dtype, "auto", prompts, reference)
    for row in rows:
        row["decode_step_ms"] = speed[row["kv_cache_dtype"]]
        if row["kv_cache_dtype"] != "auto":
            row.update(agreement(reference, greedy(model_dir, args.dtype, row["kv_cache_dtype"], prompts,
                                                   args.output_len)))
            row["forced_mean_abs_dlogprob"] = mean_abs_delta(
                forced, forced_logprobs(model_dir, args.dtype, row["kv_cache_dtype"], prompts, reference))
    # What the same comparison gives between float32 and --dtype weights, both with their own-dtype cache: how
    # sensitive the model's greedy path is to any rounding at all (a random-weights model is, at near-ties).
    floor = agreement(reference, greedy(model_dir, "float32", "auto", prompts, args.output_len))
    floor["forced_mean_abs_dlogprob"] = mean_abs_delta(
        forced, forced_logprobs(model_dir, "float32", "auto", prompts, reference))
    rows.append({"kv_cache_dtype": "auto", "pool_dtype": "float32", "noise_floor": True, **floor})
    print(f"model {model_dir} ({args.dtype}); pool of {args.pool_mib} MiB; PD transfer of one {args.input_len}-token "
          f"prompt; cpu backend decode step at batch {args.batch_size}, context {args.context_len}, "
          f"{torch.get_num_threads()} threads; greedy over {args.num_prompts} prompts x {args.output_len} tokens")
    print(f"{'kv-cache-dtype':<15} {'pool dtype':<14} {'tokens/pool':>12} {'transfer B':>11} {'step ms':>8} "
          f"{'tokens equal':>12} {'|dlogp| greedy':>14} {'|dlogp| forced':>14}")
    for r in rows:
        quality = (f"{r['token_agreement']:>12.1%} {r['mean_abs_dlogprob']:>14.4f} "
                   f"{r['forced_mean_abs_dlogprob']:>14.4f}" if "token_agreement" in r
                   else f"{'(reference)':>12} {'':>14} {'':>14}")
        if r.get("noise_floor"):
            print(f"{'(float32 weights, float32 cache: the noise floor)':<73} {quality}")
            continue
        print(f"{r['kv_cache_dtype']:<15} {r['pool_dtype']:<14} {r['tokens_per_pool']:>12} {r['transfer_bytes']:>11} "
              f"{r['decode_step_ms']:>8.2f} {quality}")
    print("tokens equal: greedy tokens equal position by position to the reference's; |dlogp| greedy: mean |Δ logprob| "
          "of the chosen token before the first different one; |dlogp| forced: mean |Δ logprob| of every reference "
          "token, teacher-forced")
    if args.output_json:
        write_results_json(args.output_json, args, rows)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "kv-cache", "--kv-cache-dtype fp8 (and bfloat16/float16 under "
                                                       "--dtype float32) vs the model's dtype: capacity, transfer "
                                                       "bytes, cpu decode step, greedy agreement")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (the auto KV cache's)")
    p.add_argument("--pool-mib", type=int, default=1024, help="pool size the tokens-per-pool column assumes")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (transfer bytes, greedy prompts)")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=16, help="greedy prompts")
    p.add_argument("--batch-size", type=int, default=32, help="decode step: requests")
    p.add_argument("--context-len", type=int, default=1024, help="decode step: tokens per request")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--rounds", type=int, default=5, help="decode step: alternating rounds")
    p.add_argument("--steps", type=int, default=5, help="decode step: steps timed back to back per round")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None, help="also write the rows here")
    p.set_defaults(func=run)
