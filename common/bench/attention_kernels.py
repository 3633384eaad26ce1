"""`tandem bench attention --kernels`: the `cpu` backend's ops alone, every kernel set this CPU runs (portable, avx2,
avx512) on the same inputs in alternating rounds. Decode reports the K/V bytes it reads per second beside a plain copy
of as many bytes (read + write) in the same run; extend (new tokens over a cached prefix) its GFLOP/s."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.common.cpuinfo import cpu_model_name
from tandem.common.model.attention.cpu import load_ops
from tandem.common.model.loader import load_model


@dataclass
class OpCase:
    name: str                    # decode / extend
    call: Callable[[], object]   # one call of the op on fixed inputs
    unit: str                    # GB/s (K/V read) or GFLOP/s
    work: float                  # bytes or FLOPs of one call


def available_kernels(ops) -> list[str]:
    """portable, then avx2 and avx512 where this CPU (and build) has them."""
    names = ["portable"]
    try:
        for isa in ("avx2", "avx512"):
            try:
                ops.set_kernel_isa(isa)
            except RuntimeError:
                continue
            names.append(isa)
    finally:
        ops.set_kernel_isa("auto")
    return names


def op_cases(model, batch: int, context_len: int, extend_len: int, page_size: int) -> list[OpCase]:
    """Decode (one query row per request) and extend (extend_len new rows after context_len - extend_len cached
    tokens) over the same pool: `batch` requests of context_len tokens on shuffled pages of random K/V."""
    from tandem.common.bench.attention import decode_batch

    mc = model.config
    fb = decode_batch(model, batch, context_len, page_size)
    k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(0)
    dtype = k_buf.dtype
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, mc.num_heads, mc.head_dim, generator=gen).to(dtype)
    q_ext = torch.randn(batch * extend_len, mc.num_heads, mc.head_dim, generator=gen).to(dtype)
    r2t, rows, scale = fb.req_to_token_pool.req_to_token, fb.req_pool_indices, mc.head_dim ** -0.5
    new = torch.full((batch,), extend_len, dtype=torch.int64)
    ops = load_ops()
    kv_bytes = batch * context_len * 2 * mc.num_kv_heads * mc.head_dim * k_buf.element_size()
    prefix = context_len - extend_len
    # Per new token at position p: p + 1 scores and p + 1 value rows, 2 FLOPs per multiply-add, per query head.
    visible = sum(prefix + j + 1 for j in range(extend_len))
    extend_flops = batch * visible * mc.num_heads * mc.head_dim * 4
    return [
        OpCase("decode", lambda: ops.decode_attention(q, k_buf, v_buf, r2t, rows, fb.seq_lens, scale), "GB/s",
               kv_bytes),
        OpCase("extend", lambda: ops.extend_attention(q_ext, k_buf, v_buf, r2t, rows, fb.seq_lens - new, new, scale),
               "GFLOP/s", extend_flops),
    ]


def time_calls(call: Callable[[], object], calls: int) -> float:
    """Seconds per call, the mean over `calls` back to back."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def copy_gbps(nbytes: int, rounds: int, calls: int) -> float:
    """Bytes read + written per second by torch's copy of an nbytes buffer (torch's threads), median of rounds."""
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / statistics.median(time_calls(lambda: dst.copy_(src), calls) for _ in range(rounds)) / 1e9


def run_kernels(args: argparse.Namespace, model_dir: str) -> int:
    extend_len = 64 if args.extend_len is None else args.extend_len
    if not 0 < extend_len <= args.context_len:
        raise SystemExit(f"tandem bench attention: --extend-len {extend_len} must be in [1, --context-len "
                         f"{args.context_len}]")
    ops = load_ops()
    kernels = available_kernels(ops)
    print(f"cpu attention ops on {cpu_model_name()}, {torch.get_num_threads()} threads; context {args.context_len}, "
          f"extend {extend_len} new tokens after {args.context_len - extend_len} cached; page size {args.page_size}; "
          f"{args.rounds} rounds x {args.steps} calls, ms per call (median) and rate")
    print(f"{'dtype':<9} {'batch':>5} {'op, rate':<14} " + " ".join(f"{k:>21}" for k in kernels) +
          f" {'copy GB/s':>10}   speed-up over portable")
    try:
        for dtype in args.dtypes.split(","):
            model = load_model(model_dir, dtype, "cpu", "cpu")[1]
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                for case in op_cases(model, batch, args.context_len, extend_len, args.page_size):
                    run_case(args, dtype, batch, case, kernels, ops)
    finally:
        ops.set_kernel_isa("auto")
    return 0


def run_case(args: argparse.Namespace, dtype: str, batch: int, case: OpCase, kernels: list[str], ops) -> None:
    """One table row: each kernel set timed in alternating rounds on the same inputs; decode rows add the copy."""
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for k in kernels:
        ops.set_kernel_isa(k)
        case.call()  # warm-up: first-call allocations, the threads' scratch
    for _ in range(args.rounds):
        for k in kernels:
            ops.set_kernel_isa(k)
            times[k].append(time_calls(case.call, args.steps))
    median = {k: statistics.median(times[k]) for k in kernels}
    cells = " ".join(f"{median[k] * 1e3:>9.3f} ms {case.work / median[k] / 1e9:>8.1f}" for k in kernels)
    copy = f"{copy_gbps(int(case.work), args.rounds, args.steps):>10.1f}" if case.unit == "GB/s" else f"{'':>10}"
    ups = " ".join(f"{k} {median['portable'] / median[k]:.2f}x" for k in kernels if k != "portable")
    print(f"{dtype:<9} {batch:>5} {case.name + ' ' + case.unit:<14} {cells} {copy}   {ups}")
