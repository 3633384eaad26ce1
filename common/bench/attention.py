"""`tandem bench attention`: one decode step's forward (plan + model) per attention backend, same process, rounds
alternating so the machine's load falls on every backend alike; optionally one torch.profiler step per backend
splitting the step into attention, linears and the rest. With --kernels: the `cpu` backend's ops alone (decode, and
extend over a cached prefix), every kernel set this CPU runs side by side (common/bench/attention_kernels.py)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.common.bench import add_bench_parser
from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.model.attention.cpu import load_ops
from tandem.common.model.create import default_model_dir
from tandem.common.model.forward_batch import ForwardBatch, ForwardMode
from tandem.common.model.loader import load_model


def decode_batch(model, batch: int, context_len: int, page_size: int, seed: int = 0,
                 kv_dtype: torch.dtype | None = None) -> ForwardBatch:
    """A DECODE batch of `batch` requests, each `context_len` tokens long after this step, on shuffled pages of a
    pool (the model's dtype, or kv_dtype) filled with random K/V (as after their prefills)."""
    mc = model.config
    dtype = kv_dtype or next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = -(-context_len // page_size)
    pool = MHATokenToKVPool(batch * pages_per_req * page_size, page_size, dtype, mc.num_layers, mc.num_kv_heads,
                            mc.head_dim)
    for k_buf, v_buf in zip(pool.k_buffers, pool.v_buffers):
        k_buf.copy_(torch.randn(k_buf.shape, generator=gen))
        v_buf.copy_(torch.randn(v_buf.shape, generator=gen))
    req_pool = ReqToTokenPool(batch, context_len + 8)
    pages = (torch.randperm(pool.num_pages, generator=gen) + 1).view(batch, pages_per_req)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)[:, :context_len]
    req_pool.req_to_token[:, :context_len] = slots
    full = lambda value: torch.full((batch,), value, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(mode=ForwardMode.DECODE, batch_size=batch,
                        input_ids=torch.randint(16, mc.vocab_size, (batch,), generator=gen),
                        positions=full(context_len - 1), out_cache_loc=slots[:, -1].contiguous(),
                        req_pool_indices=torch.arange(batch), seq_lens=full(context_len),
                        extend_prefix_lens=full(context_len - 1), extend_seq_lens=full(1), req_to_token_pool=req_pool,
                        token_to_kv_pool=pool, seq_lens_cpu=[context_len] * batch,
                        extend_prefix_lens_cpu=[context_len - 1] * batch, extend_seq_lens_cpu=[1] * batch)


def decode_step(model, fb: ForwardBatch) -> torch.Tensor:
    model.attn_backend.init_forward_metadata(fb)
    return model(fb)


def time_steps(model, fb: ForwardBatch, steps: int) -> float:
    """Milliseconds per decode step, the mean over `steps` back to back."""
    start = time.perf_counter()
    for _ in range(steps):
        decode_step(model, fb)
    return (time.perf_counter() - start) * 1000 / steps


# The ops a Linear's forward runs: unpacked, and each packed path (oneDNN, our kernel, MKL's packed sgemm); none
# calls another, so their times add up.
LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise", "tandem_gemm::packed_linear", "mkl::_mkl_linear")


def profile_split(model, fb: ForwardBatch, steps: int = 5) -> dict:
    """Share of a decode step in attention (the backend's forward, pool write included), in linears (aten::linear, and
    for packed weights the op of TANDEM_CPU_GEMM's path: LINEAR_OPS) and in the rest, from torch.profiler over `steps`
    steps."""
    backend = model.attn_backend
    original = backend.forward

    def traced(*args, **kwargs):
        with torch.profiler.record_function("attention"):
            return original(*args, **kwargs)

    backend.forward = traced
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with torch.profiler.record_function("decode_step"):
                    decode_step(model, fb)
    finally:
        del backend.forward
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step = totals["decode_step"]
    attention = totals.get("attention", 0.0)
    linear = sum(totals.get(op, 0.0) for op in LINEAR_OPS)
    return {"step_ms": step / steps / 1000, "attention": attention / step, "linear": linear / step,
            "other": 1 - (attention + linear) / step}


def backend_specs(text: str) -> list[str]:
    """--backends: attention backends, comma-separated; `cpu:portable` / `cpu:avx2` / `cpu:avx512` / `cpu:auto` pick
    the `cpu` backend's kernels for that column (plain `cpu` is `cpu:auto`), so one run can time them side by side."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        name, colon, kernels = spec.partition(":")
        if colon and (name != "cpu" or kernels not in ("auto", "avx512", "avx2", "portable")):
            raise argparse.ArgumentTypeError(f"{spec!r}: only the cpu backend takes kernels, as cpu:auto, cpu:avx512, "
                                             "cpu:avx2 or cpu:portable")
    if not specs:
        raise argparse.ArgumentTypeError("name at least one attention backend")
    return specs


def use_backend(spec: str) -> str:
    """The backend name of a column, after switching the `cpu` backend to that column's kernels."""
    name, _, kernels = spec.partition(":")
    if name == "cpu":
        load_ops().set_kernel_isa(kernels or "auto")
    return name


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.kernels:
        for flag, value in (("--backends", args.backends), ("--profile", args.profile or None)):
            if value is not None:
                raise SystemExit(f"tandem bench attention: {flag} times whole decode steps; --kernels times the cpu "
                                 "backend's ops alone: pick one")
        from tandem.common.bench.attention_kernels import run_kernels

        return run_kernels(args, model_dir)
    if args.extend_len is not None:
        raise SystemExit("tandem bench attention: --extend-len sizes the extend op of --kernels; add --kernels")
    columns = args.backends or ["torch", "cpu"]
    print(f"decode step forward, {args.rounds} rounds x {args.steps} steps, context {args.context_len}, "
          f"{torch.get_num_threads()} threads (ms per step: median, min)")
    print(f"{'dtype':<9} {'batch':>5} " + " ".join(f"{c:>16}" for c in columns) + "   speed-up")
    try:
        for dtype in args.dtypes.split(","):
            names = dict.fromkeys(c.partition(":")[0] for c in columns)  # cpu:portable and cpu share one model
            models = {name: load_model(model_dir, dtype, "cpu", name)[1] for name in names}
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                run_batch(args, dtype, batch, columns, models)
    finally:
        if any(c.startswith("cpu") for c in columns):
            use_backend("cpu")
    return 0


def run_batch(args: argparse.Namespace, dtype: str, batch: int, columns: list[str], models: dict) -> None:
    """One table row: every column timed in alternating rounds on its own copy of the same batch."""
    model_of = {c: models[c.partition(":")[0]] for c in columns}
    batches = {c: decode_batch(model_of[c], batch, args.context_len, args.page_size) for c in columns}
    times: dict[str, list[float]] = {c: [] for c in columns}
    for c in columns:
        use_backend(c)
        decode_step(model_of[c], batches[c])  # warm-up: first-call allocations, the kernels' build
    for _ in range(args.rounds):
        for c in columns:
            use_backend(c)
            times[c].append(time_steps(model_of[c], batches[c], args.steps))
    cells = " ".join(f"{statistics.median(times[c]):>8.2f} ({min(times[c]):>5.2f})" for c in columns)
    ratio = statistics.median(times[columns[0]]) / statistics.median(times[columns[-1]])
    print(f"{dtype:<9} {batch:>5} {cells}   {ratio:.2f}x")
    if args.profile:
        for c in columns:
            use_backend(c)
            split = profile_split(model_of[c], batches[c])
            print(f"    profile {c:<6} step {split['step_ms']:.2f} ms: attention {split['attention']:.0%}, "
                  f"linears {split['linear']:.0%}, other {split['other']:.0%}")


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "attention", "decode-step forward per attention backend, alternating")
    p.add_argument("--backends", type=backend_specs, default=None,
                   help="comma-separated attention backends (unset: torch,cpu); cpu:portable / cpu:avx2 / cpu:avx512 "
                        "pick the cpu backend's kernels for a column (cpu = cpu:auto); the speed-up column is the "
                        "first's time over the last's")
    p.add_argument("--kernels", action="store_true",
                   help="time the cpu backend's decode and extend ops alone with every kernel set this CPU runs "
                        "(portable, avx2, avx512), their KV read in GB/s against a copy of as many bytes")
    p.add_argument("--extend-len", type=int, default=None,
                   help="--kernels: new tokens per request of the extend op, after a cached prefix of "
                        "context-len minus this (unset: 64)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--batch-sizes", default="32,64", help="comma-separated decode batch sizes")
    p.add_argument("--context-len", type=int, default=192, help="tokens per request after the step (KV attended)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per configuration")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed back to back per round")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="also split one profiled step per backend into "
                                                          "attention / linears / other")
    p.set_defaults(func=run)
