"""The roofline of the engine's steps: each forward's FLOPs and bytes from the model's shapes, its measured time,
and which of the machine's limits (common/bench/machine_probe.py) bounds it, per phase (extend, decode, mixed).

FLOPs: 2 x the linear weights a token multiplies (QKV, O, MLP or its routed experts, router) x the step's tokens,
2 x the LM head x the rows scored, and attention's 4 x heads x head_dim per (query, key) pair (causal: a prefill
token attends to its prefix and the new tokens up to itself). Bytes: every weight read once per step (an MoE layer's
experts: those the step's tokens can reach, at most num_experts), the LM head, each sequence's KV read once per
layer and the new tokens' KV written. Activations and the embedding rows are left out (a few % at most here).

A step's two parts run one after the other, not at once: the GEMMs (weights against the step's rows, compute-bound
from a few dozen rows up) and attention (each sequence's KV, memory-bound). So beside the step's combined
intensity, the report gives its floor: each part's time at its own bound (max of FLOPs over the peak and bytes over
the bandwidth), summed, and the measured forward as a share of it. A decode step whose combined intensity is under
the ridge can still not reach the bandwidth: its GEMMs alone need the compute they need.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from tandem.common.bench.machine_probe import Machine
from tandem.common.model.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step constants of one model, in parameters and bytes."""

    dense_layer_params: int  # attention + MLP weights of one dense layer
    moe_layer_attention_params: int  # attention + router (+ shared expert) weights of one MoE layer
    expert_params: int  # one routed expert (gate, up, down)
    num_dense_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    lm_head_params: int
    attention_flops_per_pair: int  # all layers, one (query, key) pair
    kv_bytes_per_token: int  # all layers, K and V
    weight_bytes: int  # bytes per parameter as the GEMMs read them

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bytes: int, kv_bytes: int) -> "ModelCost":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        moe = cfg.moe
        shared = 3 * cfg.hidden_size * moe.shared_expert_intermediate_size if moe else 0
        return cls(dense_layer_params=attention + 3 * cfg.hidden_size * cfg.intermediate_size,
                   moe_layer_attention_params=attention + (cfg.hidden_size * moe.num_experts + shared if moe else 0),
                   expert_params=3 * cfg.hidden_size * moe.intermediate_size if moe else 0,
                   num_dense_layers=cfg.num_layers - moe_layers, num_moe_layers=moe_layers,
                   num_experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
                   lm_head_params=cfg.hidden_size * cfg.vocab_size,
                   attention_flops_per_pair=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
                   kv_bytes_per_token=2 * kv * kv_bytes * cfg.num_layers, weight_bytes=weight_bytes)

    def step(self, tokens: int, logit_rows: int, attention_pairs: int, kv_tokens_read: int) -> tuple[int, int]:
        """(FLOPs, bytes) of one forward over `tokens` new tokens of sequences `kv_tokens_read` long in all."""
        (gemm_flops, gemm_bytes), (attn_flops, attn_bytes) = self.parts(tokens, logit_rows, attention_pairs,
                                                                        kv_tokens_read)
        return gemm_flops + attn_flops, gemm_bytes + attn_bytes

    def parts(self, tokens: int, logit_rows: int, attention_pairs: int,
              kv_tokens_read: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(FLOPs, bytes) of the step's GEMMs (weights read once) and of its attention (KV read and written)."""
        token_params = self.num_dense_layers * self.dense_layer_params + self.num_moe_layers * (
            self.moe_layer_attention_params + self.top_k * self.expert_params)
        gemm_flops = 2 * token_params * tokens + 2 * self.lm_head_params * logit_rows
        experts_read = min(self.num_experts, self.top_k * tokens)
        weights = self.num_dense_layers * self.dense_layer_params + self.num_moe_layers * (
            self.moe_layer_attention_params + experts_read * self.expert_params) + self.lm_head_params
        kv = self.kv_bytes_per_token * (kv_tokens_read + tokens)
        return (gemm_flops, weights * self.weight_bytes), (self.attention_flops_per_pair * attention_pairs, kv)


def batch_shape(seq_lens: list[int], new_tokens: list[int]) -> tuple[int, int, int]:
    """(tokens, attention pairs, KV tokens read) of a batch: each sequence ends `seq_len` long after this step,
    whose last `new` tokens are computed (1 for a decode row), each attending to itself and all before it."""
    pairs = sum(new * (seq - new) + new * (new + 1) // 2 for seq, new in zip(seq_lens, new_tokens))
    return sum(new_tokens), pairs, sum(seq_lens)


class RooflineRecorder:
    """Wraps one scheduler's `worker.forward` and sums, per batch mode, the forwards' seconds, FLOPs and bytes."""

    def __init__(self, cost: ModelCost):
        self.cost = cost
        self.steps: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.parts: dict[str, list] = defaultdict(list)  # per step: ((GEMM FLOPs, bytes), (attention FLOPs, bytes))

    def attach(self, scheduler) -> None:
        """Record this scheduler's forwards from now on; call it on the scheduler thread (Engine.call)."""
        worker = scheduler.runner.worker
        sync = (functools.partial(torch.cuda.synchronize, worker.device) if worker.device.type == "cuda"
                else (lambda: None))
        forward = worker.forward

        @functools.wraps(forward)
        def timed(work):
            start = time.perf_counter()
            out = forward(work)
            sync()
            self.record(work, time.perf_counter() - start)
            return out
        worker.forward = timed

    def record(self, work, seconds: float) -> None:
        fb = work.forward_batch
        mode = "mixed" if work.decode_rows else fb.mode.value
        new = [1] * fb.batch_size if fb.is_decode else list(fb.extend_seq_lens_cpu)
        tokens, pairs, kv_read = batch_shape(list(fb.seq_lens_cpu), new)
        rows = fb.batch_size if fb.logits_indices is None else int(fb.logits_indices.numel())
        parts = self.cost.parts(tokens, rows, pairs, kv_read)
        flops, nbytes = (sum(part[0] for part in parts), sum(part[1] for part in parts))
        self.parts[mode].append(parts)
        self.steps[mode] += 1
        self.seconds[mode] += seconds
        self.flops[mode] += flops
        self.bytes[mode] += nbytes
        self.tokens[mode] += tokens

    def report(self, machine: Machine) -> dict:
        """Per mode: steps, tokens, forward seconds, GFLOP/s and GB/s achieved and as % of the machine's, the
        arithmetic intensity against the ridge point, the bound it implies ("compute" or "memory"), and the floor:
        the seconds its GEMMs and its attention take each at its own bound, summed, and the forward's share of it."""
        out = {}
        for mode in sorted(self.steps):
            seconds, flops, nbytes = self.seconds[mode], self.flops[mode], self.bytes[mode]
            gflops, gbs = flops / seconds / 1e9, nbytes / seconds / 1e9
            intensity = flops / nbytes
            floor = sum(max(part_flops / 1e9 / machine.peak_gflops, part_bytes / 1e9 / machine.bandwidth_gbs)
                        for parts in self.parts[mode] for part_flops, part_bytes in parts)
            out[mode] = {"steps": self.steps[mode], "tokens": self.tokens[mode], "forward_s": seconds,
                         "gflop": flops / 1e9, "gbytes": nbytes / 1e9, "gflops_per_s": gflops, "gb_per_s": gbs,
                         "pct_of_peak": 100 * gflops / machine.peak_gflops,
                         "pct_of_bandwidth": 100 * gbs / machine.bandwidth_gbs,
                         "flop_per_byte": intensity, "ridge_flop_per_byte": machine.ridge,
                         "bound": "compute" if intensity >= machine.ridge else "memory",
                         "floor_s": floor, "pct_of_floor": 100 * floor / seconds}
        return out


def format_roofline(report: dict) -> str:
    lines = [f"{'phase':<8} {'steps':>6} {'tokens':>8} {'fwd s':>7} {'GFLOP/s':>8} {'% peak':>7} {'GB/s':>7} "
             f"{'% bw':>6} {'FLOP/B':>7} {'ridge':>6} {'bound':<7} {'floor s':>7} {'% floor':>7}"]
    for mode, r in report.items():
        lines.append(f"{mode:<8} {r['steps']:>6} {r['tokens']:>8} {r['forward_s']:>7.2f} {r['gflops_per_s']:>8.1f} "
                     f"{r['pct_of_peak']:>7.1f} {r['gb_per_s']:>7.1f} {r['pct_of_bandwidth']:>6.1f} "
                     f"{r['flop_per_byte']:>7.1f} {r['ridge_flop_per_byte']:>6.1f} {r['bound']:<7} "
                     f"{r['floor_s']:>7.2f} {r['pct_of_floor']:>7.1f}")
    return "\n".join(lines)
