"""The Triton attention kernels compile natively for a CUDA GPU (sm_90 cubin, via the wheel's own ptxas), which
needs no GPU: it catches what the CPU interpreter lets through (types, loop-carried values, tl.dot shapes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("triton")

# Runs in a fresh interpreter: @triton.jit fixed the interpreter for the kernels already imported in this process.
_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.common.model.attention.triton_kernels import decode, extend, kernels_interpreted

assert not kernels_interpreted()


def compile_kernel(fn, pointers, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name == "sm_scale" else "i32"
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))
    assert len(kernel.asm["cubin"]) > 0
    print("compiled", fn.__name__, pointers["Q" if "Q" in pointers else "Out"], constexprs["HEAD_DIM"])


for kv, head_dim, group in (("bf16", 128, 4), ("fp32", 64, 1)):
    precision = "ieee" if kv == "fp32" else None
    block_d = max(16, triton.next_power_of_2(head_dim))
    index = dict(Req_to_token="i64", Req_pool_idx="i64")
    compile_kernel(decode._decode_stage1, dict(Q=kv, K_Buf=kv, V_Buf=kv, Seq_lens="i64", Mid_O="fp32",
                                               Mid_Lse="fp32", **index),
                   dict(NUM_HEADS=group * 2, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                        BLOCK_H=max(16, group), BLOCK_N=32, NUM_SPLITS=8, PRECISION=precision, DOT_IN_F32=False))
    compile_kernel(decode._decode_stage2, dict(Mid_O="fp32", Mid_Lse="fp32", Seq_lens="i64", Out=kv),
                   dict(NUM_HEADS=group * 2, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=8))
    compile_kernel(extend._extend_kernel, dict(Q=kv, K_New=kv, V_New=kv, Out=kv, K_Buf=kv, V_Buf=kv,
                                               Prefix_lens="i64", Extend_lens="i64", Extend_starts="i64", **index),
                   dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=32, BLOCK_N=32,
                        PRECISION=precision, DOT_IN_F32=False))
'''


def test_kernels_compile_for_cuda_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 6, proc.stdout
