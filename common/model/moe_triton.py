"""Fused mixture-of-experts in Triton: the routed (token, k) pairs grouped by expert, two grouped GEMMs around SiLU.

Layout
------
T tokens each pick K experts, giving T*K (token, k) pairs; pair p = t*K + k. Every per-pair buffer below is
indexed by p, so reducing over K at the end is a view [T, K, H] and a sum.

1. Align (moe_align_block_size, torch ops, no host sync): pairs are sorted by their local expert and each
   expert's run is padded to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert.
   sorted_token_ids [max_padded] holds pair ids in that order, T*K (the sentinel) in the padding;
   expert_ids [max_padded / BLOCK_M] names each block's expert (-1 past the end); num_tokens_post_padded [1]
   is where the real blocks end. max_padded is a bound known from the shapes alone (T*K plus BLOCK_M - 1 of
   padding for each expert that can be non-empty), so the launch grids never wait on the device; blocks past
   num_tokens_post_padded return at once. Pairs routed to an expert this rank does not hold (expert_map -1)
   get no slot at all.
2. Kernel 1: per block, x[p // K] (gathered through sorted_token_ids) @ w13[e].T -> gate_up [T*K, 2I].
3. silu(gate) * up -> act [T*K, I] (a small elementwise kernel over the same sorted slots).
4. Kernel 2: per block, act[p] @ w2[e].T, scaled by topk_weights[p] -> down [T*K, H] in float32.
5. down.view(T, K, H).sum(1): pairs nobody computed (not held here) stay zero, which is what expert
   parallelism wants from this rank; another rank's partial sums are added by the caller's all-reduce.

Accumulation is float32 throughout; gate_up and act are stored in x.dtype (as the torch path rounds its
projections), the final per-pair rows in float32 so the sum over K rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoeBlockConfig:
    """Tile sizes of the grouped GEMMs; block_m is also the padding of each expert's run of pairs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _moe_grouped_gemm(A, B, C, Topk_weights, Sorted_token_ids, Expert_ids, Num_tokens_post_padded,
                      N, K, num_pairs, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                      PAIRS_PER_A_ROW: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr):
    # Axis 0 (the fastest launched) walks the row blocks, so neighbouring programs of one expert share a weight
    # tile: the weights, not the activations, are what a MoE layer mostly reads.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_post_padded = tl.load(Num_tokens_post_padded)
    expert = tl.load(Expert_ids + pid_m).to(tl.int64)
    if (pid_m * BLOCK_M < num_post_padded) & (expert >= 0):
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(Sorted_token_ids + offs_m).to(tl.int64)  # int64: pair * stride can pass 2**31
        row_mask = pair < num_pairs
        a_row = pair // PAIRS_PER_A_ROW  # kernel 1 reads token p // K of x (K pairs share it), kernel 2 row p of act
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        b_base = B + expert * stride_be
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(A + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_IN_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc=acc, input_precision=PRECISION)
        if MUL_ROUTED_WEIGHT:
            weight = tl.load(Topk_weights + pair, mask=row_mask, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        tl.store(C + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _silu_and_mul(Gate_up, Out, Sorted_token_ids, num_pairs, inter, stride_gm, stride_om, BLOCK: tl.constexpr):
    # One program per slot of the aligned layout, not per pair: the rows of pairs no expert here computed hold
    # whatever torch.empty left, and skipping them keeps that garbage out of exp (overflow, NaN warnings).
    pair = tl.load(Sorted_token_ids + tl.program_id(0)).to(tl.int64)
    if pair < num_pairs:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(Gate_up + pair * stride_gm + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(Gate_up + pair * stride_gm + inter + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + pair * stride_om + offs, (gate * tl.sigmoid(gate) * up).to(Out.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    """Whether @triton.jit built these kernels for Triton's interpreter (TRITON_INTERPRET at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_moe_grouped_gemm, InterpretedFunction)


def moe_block_config(num_pairs: int, num_experts: int) -> MoeBlockConfig:
    """A small fixed table, picked from shapes only (never a device value, so a captured graph replays it). The GPU
    rows are SGLang-like starting points, not yet timed on this project's hardware."""
    if _interpreted():
        # Each program costs Python time under the interpreter: few, small row blocks keep the padding (and the
        # tests) cheap, wide N and K tiles keep the program count down.
        return MoeBlockConfig(block_m=16, block_n=64, block_k=32)
    if num_pairs <= 16 * max(num_experts, 1):  # decode: a handful of pairs per expert, padding is the cost
        return MoeBlockConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return MoeBlockConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_local_experts: int,
                         expert_map: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids int32 [max_padded], expert_ids int32 [max_padded / block_m], num_tokens_post_padded
    int32 [1]) for topk_ids [T, K]; see the module docstring for the layout. Pairs keep their order within an
    expert (a stable sort), which keeps the result deterministic."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_experts = num_local_experts
    expert = topk_ids.reshape(-1).long()
    if expert_map is not None:
        expert = expert_map.long()[expert]
    # Pairs this rank does not hold go to one extra bucket past the last expert, which is given no blocks.
    expert = torch.where(expert >= 0, expert, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # not `padded[i] = 0`: that copies a host scalar (a sync; no graph capture)
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    run_start = counts.cumsum(0) - counts

    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    rank_in_run = torch.arange(num_pairs, device=device) - run_start[sorted_expert]
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    max_padded = num_blocks * block_m
    # The unheld bucket's pairs all land in one spare slot past the end, dropped below: no boolean mask (which
    # would sync to learn its size) is needed.
    dest = torch.where(sorted_expert < num_experts, padded_start[sorted_expert] + rank_in_run, max_padded)
    sorted_token_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_token_ids = sorted_token_ids[:max_padded]

    num_post_padded = padded_end[num_experts:]  # the unheld bucket adds 0, so this is the total
    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end[:num_experts].contiguous(), block_start, right=True)
    expert_ids = torch.where(block_start < num_post_padded, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, num_post_padded.to(torch.int32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                  align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pairs_per_a_row: int, mul_weight: bool,
                  config: MoeBlockConfig) -> None:
    """c[p] = a[p // pairs_per_a_row] @ b[expert of p].T (times topk_weights[p] if mul_weight), p in the
    aligned layout; rows of c whose pair has no expert here are not written."""
    sorted_token_ids, expert_ids, num_post_padded = align
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(n, config.block_n))
    interpreted = _interpreted()
    _moe_grouped_gemm[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_post_padded, n, k, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row, MUL_ROUTED_WEIGHT=mul_weight,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # float32 stays IEEE (TF32 would cost parity with the torch path); None lets 16-bit dots pick.
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        # The interpreter runs tl.dot as np.matmul on bfloat16's raw uint16 storage: widen those tiles.
        DOT_IN_F32=interpreted and a.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, H]; w13 [E_local, 2*I, H] (rows: gate then up, like HF's gate_proj/up_proj stacked); w2 [E_local, H, I];
    topk_ids [T, K] int (global expert ids); topk_weights [T, K] float32; expert_map: None, or int32 [E_global]
    mapping a global expert id to its local index in w13/w2, -1 for an expert this rank does not hold (expert
    parallelism: those (token, k) pairs contribute nothing). Returns [T, H] in x.dtype:
    out[t] = sum_k topk_weights[t,k] * (w2[e] @ (silu(w13[e,:I] @ x[t]) * (w13[e,I:] @ x[t]))), e = local id of
    topk_ids[t,k]."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}")
    if num_tokens == 0 or top_k == 0 or num_experts == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    config = moe_block_config(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, config.block_m, num_experts, expert_map)
    weights = topk_weights.reshape(-1).contiguous()

    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, align, top_k, False, config)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    act_block = min(1024, triton.next_power_of_2(inter))
    sorted_token_ids = align[0]
    _silu_and_mul[(sorted_token_ids.numel(), triton.cdiv(inter, act_block))](
        gate_up, act, sorted_token_ids, num_pairs, inter, gate_up.stride(0), act.stride(0), BLOCK=act_block)
    # zeros, not empty: kernel 2 leaves the rows of unheld pairs alone and the sum over K reads them.
    down = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, weights, align, 1, True, config)
    return down.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
