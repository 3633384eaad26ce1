"""`tandem bench moe`: one MoE layer's call vs the dense MLP of the same active width, on uniform and on skewed
routing, rounds interleaved; on CUDA also the Triton fused-MoE runner."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from tandem.common.bench import add_bench_parser, write_results_json
from tandem.common.model.attention import create_attention_backend
from tandem.common.model.config import ModelConfig
from tandem.common.model.cpu_linear import CPU_BF16_MATMULS, set_weight_prepack
from tandem.common.model.create import ARCHS, PRESETS, model_config_dict
from tandem.common.model.loader import resolve_dtype
from tandem.common.model.moe import MLP, SparseMoeBlock

# Added to the hot experts' router logits (about 5 standard deviations of a random input's logits): a skewed token
# picks exactly those top_k experts.
SKEW_LOGIT = 8.0


def layer_config(args: argparse.Namespace) -> ModelConfig:
    """The layer's sizes: --model's config.json, else the built-in --arch/--preset config (no weights are read)."""
    config = ModelConfig.from_pretrained(args.model) if args.model else \
        ModelConfig.from_hf_dict(model_config_dict(args.arch, args.preset))
    if config.moe is None:
        raise ValueError(f"{config.architecture} is a dense model: `tandem bench moe` needs an MoE config "
                         "(--arch qwen3_moe, qwen2_moe or mixtral, or an MoE --model)")
    return config


def dense_width(config: ModelConfig) -> int:
    """The dense MLP as wide as what one token runs: top_k experts (and Qwen2-MoE's shared expert)."""
    moe = config.moe
    return moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size


@torch.no_grad()
def build_layers(config: ModelConfig, dtype: torch.dtype, device: str, bf16_matmul: str,
                 seed: int) -> tuple[SparseMoeBlock, MLP]:
    """The MoE block (every expert on this rank) and the dense MLP, with seeded random weights; their activations
    run as the engine's do (the default attention backend's kernel)."""
    moe = config.moe
    backend = create_attention_backend("auto", device)
    block = SparseMoeBlock(config, 0, moe.num_experts, moe.intermediate_size, moe.shared_expert_intermediate_size,
                           backend)
    dense = MLP(config.hidden_size, dense_width(config), backend)
    gen = torch.Generator().manual_seed(seed)
    for module in (block, dense):
        for param in module.parameters():  # std ~ 1/sqrt(fan_in), as the built-in models' weights
            param.copy_(torch.randn(param.shape, generator=gen) * (1.5 / param.shape[-1] ** 0.5))
        module.to(device=device, dtype=dtype).eval()
        set_weight_prepack(module, True, bf16_matmul)  # the engine's CPU path: oneDNN-packed copies, built now
    return block, dense


def make_inputs(block: SparseMoeBlock, tokens: int, skew: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random hidden states ("uniform": the router spreads them over all experts) and the same with `skew` of the
    tokens moved, along the router's pseudo-inverse, toward the first top_k experts only ("skewed")."""
    weight = block.gate.weight.detach().float().cpu()
    uniform = torch.randn(tokens, weight.shape[1], generator=gen)
    hot = torch.zeros(weight.shape[0])
    hot[: block.top_k] = SKEW_LOGIT
    lift = torch.linalg.pinv(weight) @ hot  # raises the hot experts' logits, leaves the others' as they were
    skewed = uniform.clone()
    skewed[: round(skew * tokens)] += lift
    like = block.gate.weight
    return {"uniform": uniform.to(like), "skewed": skewed.to(like)}


def routing_stats(block: SparseMoeBlock, x: torch.Tensor) -> dict:
    """How the router spreads `x`: experts with any token, and the share of (token, k) pairs on the top_k busiest."""
    ids, _ = block.route(x)
    counts = torch.bincount(ids.flatten().cpu(), minlength=block.gate.weight.shape[0])
    busiest = counts.sort(descending=True).values[: block.top_k].sum().item()
    return {"active_experts": int((counts > 0).sum()), "top_k_share": busiest / ids.numel()}


def time_calls(fn: Callable[[], torch.Tensor], calls: int, sync: Callable[[], None]) -> float:
    """Milliseconds per call, the mean over `calls` back to back."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) * 1000 / calls


def with_runner(block: SparseMoeBlock, runner: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        block.experts.runner = runner
        try:
            return block(x)
        finally:
            block.experts.runner = "torch"
    return call


def columns_for(block: SparseMoeBlock, dense: MLP, inputs: dict[str, torch.Tensor],
                cuda: bool) -> dict[str, Callable[[], torch.Tensor]]:
    columns = {"dense": lambda: dense(inputs["uniform"]),
               "moe": with_runner(block, "torch", inputs["uniform"]),
               "moe_skewed": with_runner(block, "torch", inputs["skewed"])}
    if cuda:
        columns["triton"] = with_runner(block, "triton", inputs["uniform"])
        columns["triton_skewed"] = with_runner(block, "triton", inputs["skewed"])
    return columns


@torch.inference_mode()
def bench_tokens(block: SparseMoeBlock, dense: MLP, tokens: int, args: argparse.Namespace) -> dict:
    """One row: every column timed in rounds, the order rotating each round so the machine's load falls alike."""
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    inputs = make_inputs(block, tokens, args.skew, torch.Generator().manual_seed(args.seed + tokens))
    columns = columns_for(block, dense, inputs, cuda)
    outputs = {name: fn() for name, fn in columns.items()}  # warm-up: packs, first-call allocations, kernel builds
    names = list(columns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(time_calls(columns[name], args.calls, sync))
    row = {"tokens": tokens}
    for name in names:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_ms_min"] = min(times[name])
    row["moe_over_dense"] = row["moe_ms"] / row["dense_ms"]
    row["skewed_over_uniform"] = row["moe_skewed_ms"] / row["moe_ms"]
    for kind, x in inputs.items():
        row.update({f"{kind}_{key}": value for key, value in routing_stats(block, x).items()})
    if cuda:  # the kernel against the grouped torch path, same weights and inputs
        row["triton_over_dense"] = row["triton_ms"] / row["dense_ms"]
        row["triton_max_abs_diff"] = max((outputs[f"triton{s}"].float() - outputs[f"moe{s}"].float()).abs().max().item()
                                         for s in ("", "_skewed"))
    return row


def print_header(config: ModelConfig, args: argparse.Namespace) -> None:
    moe = config.moe
    shared = f" + shared {moe.shared_expert_intermediate_size}" if moe.shared_expert_intermediate_size else ""
    threads = f", torch threads {torch.get_num_threads()}" if not args.device.startswith("cuda") else ""
    print(f"MoE layer vs the dense MLP of the same active width: {config.architecture}, hidden {config.hidden_size}, "
          f"{moe.num_experts} experts, top-{moe.top_k} x {moe.intermediate_size}{shared} (dense "
          f"{dense_width(config)}); {args.device}{threads}; ms per call, median of {args.repeats} interleaved rounds "
          f"x {args.calls} calls; skewed: {args.skew:.0%} of the tokens routed to {moe.top_k} experts")
    extra = f" {'triton':>9} {'trit skew':>9} {'max diff':>9}" if args.device.startswith("cuda") else ""
    print(f"{'dtype':<9} {'tokens':>6} {'dense':>9} {'moe':>9} {'moe/dense':>9} {'moe skew':>9} {'skew/unif':>9} "
          f"{'experts u/s':>11} {'top-k share u/s':>15}{extra}")


def print_row(row: dict) -> None:
    experts = f"{row['uniform_active_experts']}/{row['skewed_active_experts']}"
    share = f"{row['uniform_top_k_share']:.0%}/{row['skewed_top_k_share']:.0%}"
    extra = f" {row['triton_ms']:>9.3f} {row['triton_skewed_ms']:>9.3f} {row['triton_max_abs_diff']:>9.2e}" \
        if "triton_ms" in row else ""
    print(f"{row['dtype']:<9} {row['tokens']:>6} {row['dense_ms']:>9.3f} {row['moe_ms']:>9.3f} "
          f"{row['moe_over_dense']:>8.2f}x {row['moe_skewed_ms']:>9.3f} {row['skewed_over_uniform']:>8.2f}x "
          f"{experts:>11} {share:>15}{extra}", flush=True)


def run(args: argparse.Namespace) -> int:
    config = layer_config(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print_header(config, args)
    rows = []
    for dtype_name in args.dtypes.split(","):
        block, dense = build_layers(config, resolve_dtype(dtype_name, config), args.device, args.cpu_bf16_matmul,
                                    args.seed)
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append({"dtype": dtype_name, **bench_tokens(block, dense, tokens, args)})
            print_row(rows[-1])
    if args.output_json:
        write_results_json(args.output_json, args, rows)
    return 0


def register(bench_subparsers) -> None:
    p = add_bench_parser(bench_subparsers, "moe", "one MoE layer vs the dense MLP of the same active width",
                         model_help="model dir whose config.json sizes the layer (its weights are not read; both "
                                    "layers get random ones); unset: the --arch and --preset built-in config")
    p.add_argument("--arch", choices=ARCHS, default="qwen3_moe", help="without --model: the built-in MoE family")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small", help="without --model: the built-in size")
    p.add_argument("--tokens", default="1,8,64,256,1024", help="comma-separated token counts per call")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds per row (the median is reported)")
    p.add_argument("--calls", type=int, default=5, help="calls timed back to back per round")
    p.add_argument("--skew", type=float, default=0.9,
                   help="share of the skewed input's tokens that the router sends to the same top_k experts")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (CUDA adds the Triton fused-MoE runner)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--cpu-bf16-matmul", default="auto", choices=CPU_BF16_MATMULS,
                   help="how bfloat16 CPU linears multiply (the engine flag of that name)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--output-json", default=None, help="also write the config and results as JSON here")
    p.set_defaults(func=run)
