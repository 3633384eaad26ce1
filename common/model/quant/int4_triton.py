"""int4 GEMM in Triton (CUDA): w4a16, the weight unpacked tile by tile inside the K loop.

Layout (built once from an Int4Weight): qweight int32 [K/8, N] packed along K (GPTQ's: nibble i of row r is input
column 8r + i), scales [groups, N] in the activation dtype, zeros uint8 [groups, N], g_idx int32 [K]. Each K tile
loads its packed rows, shifts out the nibbles, looks up each column's group through g_idx (act-order scatters
them; a tensor-parallel slice keeps the global group ids) and multiplies (q - z) * s by the activation tile with a
float32 accumulator. No permutation of x and no padding is needed, unlike the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from tandem.common.model.quant.int4 import PACK, Int4Weight, pack_along_k


@triton.jit
def _w4a16_gemm(A, QW, S, Z, G_idx, C, M, N, K,
                stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        kn_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(QW + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=kn_mask, other=0)
        q = (packed >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group = tl.load(G_idx + offs_k, mask=k_mask, other=0)
        s = tl.load(S + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
        z = tl.load(Z + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0)
        w = (q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)
        if DOT_IN_F32:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc=acc, input_precision=PRECISION)
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _interpreted() -> bool:
    """Whether @triton.jit built the kernel for Triton's interpreter (TRITON_INTERPRET at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_w4a16_gemm, InterpretedFunction)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T, W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]; [M, N] in x.dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    interpreted = _interpreted()
    if interpreted:  # each program costs Python time in the interpreter: few, wide tiles
        block_m, block_n, block_k, warps = 16, 64, 32, 4
    else:  # starting points, not tuned on a GPU here
        block_m = 16 if m <= 16 else (32 if m <= 64 else 64)
        block_n, block_k, warps = 64, 64, 4
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_gemm[grid](x, qweight, scales, zeros, g_idx, out, m, n, k,
                      x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
                      scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                      # float32 stays IEEE (TF32 would cost parity); the interpreter's tl.dot is np.matmul on
                      # bfloat16's raw storage, so there 16-bit tiles are widened.
                      PRECISION="ieee" if x.dtype == torch.float32 else None,
                      DOT_IN_F32=x.dtype == torch.float32 or interpreted,
                      num_warps=warps)
    return out


class TritonInt4Gemm(nn.Module):
    """x [M, K] @ W.T for one int4 weight through _w4a16_gemm."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.in_features, weight.out_features, dtype
        self.register_buffer("qweight", pack_along_k(weight.q).to(device), persistent=False)
        self.register_buffer("scales", weight.scales.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("zeros", weight.zeros.to(device), persistent=False)
        self.register_buffer("g_idx", weight.g_idx.to(device=device, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_gemm(x.to(self.dtype).contiguous(), self.qweight, self.scales, self.zeros, self.g_idx)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device).view(1, PACK, 1)
        q = ((self.qweight.unsqueeze(1) >> shifts) & 0xF).reshape(self.in_features, -1).float()
        g = self.g_idx.long()
        return ((q - self.zeros[g].float()) * self.scales[g].float()).T.contiguous()
