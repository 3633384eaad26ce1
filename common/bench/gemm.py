"""`tandem bench gemm`: the GFLOP/s of each CPU linear path on the model's shapes (QKV, O, fused gate/up, down,
LM head) at decode and prefill row counts, as % of this machine's measured float32 FMA peak. `--dtypes int4`: a
4-bit weight (codes with a scale and an offset per 32 input columns, GGUF Q4_1's form) through Tandem's 4-bit kernel
and torch's int4 kernel, float32 and bfloat16 rows."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.bench.machine_probe import format_machine, measure_machine
from tandem.common.model import cpu_gemm
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import PACK_ROWS_HINT, onednn_packs_bf16
from tandem.common.model.create import PRESETS, model_config_dict

ROWS = (1, 8, 32, 64, 128, 256)
MIN_REPS, MIN_SECONDS = 10, 0.05  # per cell: at least this many calls and this long; the median call counts
DTYPES = ("float32", "bfloat16", "int4")
INT4_GROUP = 32
# torch's int4 kernel over float32 rows is a scalar loop (~2 GFLOP/s): timed up to this many rows only
TORCH_INT4_FLOAT32_ROWS = 8


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear a dense layer and the LM head run."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def paths(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way to run x @ weight.T here, its weight packed once: `onednn` is the engine's (cpu_linear), `mkl`
    F.linear (MKL sgemm in float32, oneDNN unpacked in bf16), `onednn-m` oneDNN packed for the call's own row
    count (built per call, so the weight is packed per row count in use), `mkl-packed` MKL's packed sgemm,
    `tandem` our kernel (over a bf16 weight: its bf16 panels widened in registers, --cpu-bf16-matmul widen); a bf16
    weight also `onednn-fp32` (the float32 copy of --cpu-bf16-matmul fp32). oneDNN packs a bf16 weight only on
    CPUs with avx512bw/vl/dq or avx_ne_convert; elsewhere (AVX2-only) a bf16 weight has no `onednn`/`onednn-m`."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"mkl": lambda x: F.linear(x, weight)}
    if weight.dtype == torch.float32 or onednn_packs_bf16():
        out["onednn"] = _onednn(weight, PACK_ROWS_HINT)
        by_rows: dict[int, Callable] = {}

        def onednn_m(x):
            rows = x.shape[0]
            if rows not in by_rows:
                by_rows[rows] = _onednn(weight, rows)
            return by_rows[rows](x)
        out["onednn-m"] = onednn_m
    if cpu_gemm.panel_widths():
        packed, n = cpu_gemm.pack_weight(weight), weight.shape[0]
        out["tandem"] = lambda x: cpu_gemm.packed_linear(x.float(), packed, n).to(x.dtype)
    if weight.dtype == torch.float32:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT)
        out["mkl-packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, None, PACK_ROWS_HINT)
    else:
        wide = torch.ops.mkldnn._reorder_linear_weight(weight.float(), PACK_ROWS_HINT)
        out["onednn-fp32"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x.float(), wide, None, "none", [], "").to(x.dtype)
    return out


def int4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset, w): `weight` rounded to 4-bit codes per group of INT4_GROUP input columns, asymmetric
    (offset the group's minimum, scale its range / 15), and w = q * scale + offset rounded once to float32, the
    weight every int4 path multiplies by."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    w = q.double().view(n, -1, INT4_GROUP) * scale.double()[..., None] + low.double()[..., None]
    return q, scale, low, w.view(n, k).float()


def int4_paths(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> dict[str, Callable]:
    """Each way to run float32 x @ W.T for the 4-bit weight: `tandem-int4` our kernel's 4-bit panels,
    `torch-int4` torch's _weight_int4pack_mm_for_cpu over float32 rows, `torch-int4-bf16` the same kernel over
    bf16 rows (the engine's path for a bfloat16 model; needs N a multiple of 16)."""
    n = q.shape[0]
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    if cpu_gemm.panel_widths():
        codes, sz = cpu_gemm.pack_int4(q, scale, offset, INT4_GROUP)
        out["tandem-int4"] = lambda x: cpu_gemm.packed_quant_linear(x, codes, sz, n, INT4_GROUP)
    if n % 16 == 0:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        pairs = torch.stack([scale.t(), (offset + 8 * scale).t()], -1).contiguous()  # (q - 8) s + z: z = offset + 8 s
        half = pairs.bfloat16()
        out["torch-int4"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, pairs)
        out["torch-int4-bf16"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), packed, INT4_GROUP, half).float()
    return out


def _onednn(weight: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def median_seconds(fn: Callable[[], torch.Tensor]) -> float:
    fn()
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < MIN_REPS or time.perf_counter() - begin < MIN_SECONDS:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def survey(shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], dtype: str, peak: float) -> list[dict]:
    """dtype: float32, bfloat16, or int4 (float32 rows times a 4-bit weight)."""
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=gen) / k ** 0.5
        if dtype == "int4":
            q, scale, offset, weight = int4_weight(weight)
            ways, x_dtype = int4_paths(q, scale, offset), torch.float32
        else:
            weight = weight.to(getattr(torch, dtype))
            ways, x_dtype = paths(weight), weight.dtype
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(x_dtype)
            reference = F.linear(x.double(), weight.double())
            row = {"shape": name, "n": n, "k": k, "m": m, "dtype": dtype, "paths": {}}
            for path, fn in ways.items():
                if path == "torch-int4" and m > TORCH_INT4_FLOAT32_ROWS:
                    continue
                err = ((fn(x).double() - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()
                gflops = 2 * m * n * k / median_seconds(lambda: fn(x)) / 1e9
                row["paths"][path] = {"gflops_per_s": gflops, "pct_of_peak": 100 * gflops / peak, "max_rel_err": err}
            row["best"] = max(row["paths"], key=lambda p: row["paths"][p]["gflops_per_s"])
            results.append(row)
    return results


def format_survey(results: list[dict]) -> str:
    names = list(dict.fromkeys(p for r in results for p in r["paths"]))
    lines = [f"{'dtype':<9} {'shape':<8} {'N':>6} {'K':>5} {'M':>4} " + " ".join(f"{p:>12}" for p in names)
             + "  best  (GFLOP/s, % of FMA peak)"]
    for r in results:
        cells = [f"{r['paths'][p]['gflops_per_s']:>6.1f} {r['paths'][p]['pct_of_peak']:>4.0f}%" if p in r["paths"]
                 else f"{'-':>12}" for p in names]
        lines.append(f"{r['dtype']:<9} {r['shape']:<8} {r['n']:>6} {r['k']:>5} {r['m']:>4} " + " ".join(cells)
                     + f"  {r['best']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    machine = measure_machine(args.num_threads)
    print(f"machine: {format_machine(machine)}")
    configs = {"model": ModelConfig.from_pretrained(args.model)} if args.model else {
        p: ModelConfig.from_hf_dict(model_config_dict("llama", p)) for p in args.presets.split(",")}
    rows = tuple(int(m) for m in args.rows.split(","))
    results = []
    for source, cfg in configs.items():
        for dtype in args.dtypes.split(","):
            if dtype not in DTYPES:
                raise SystemExit(f"tandem bench gemm: --dtypes takes {', '.join(DTYPES)}, got {dtype!r}")
            part = survey(model_shapes(cfg), rows, dtype, machine.peak_gflops)
            results += [r | {"model": source} for r in part]
    print(format_survey(results))
    if args.output_json:
        write_results_json(args.output_json, args, results, machine=machine.as_dict())
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "gemm", "CPU linear paths on the model's shapes vs the FMA peak",
                         model_help="model dir whose shapes to run (default: the built-in presets of --presets)")
    p.add_argument("--presets", default="small", help=f"comma-separated built-in presets ({', '.join(PRESETS)})")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts M")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated: float32, bfloat16, int4 (float32 rows, a 4-bit weight, groups of 32)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output-json", default=None, help="also write the config, the machine and the results here")
    p.set_defaults(func=run)
