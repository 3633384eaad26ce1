"""The C++ paged attention ops of the `cpu` backend (with its RoPE, KV-write, norm, MLP, layer-loop and sampling ops):
built on first use by common/model/cpp_build.py, then cached.

The build lands in <TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/tandem_cpu_attention_<key>, where the key
hashes the sources, the flags, torch's version and this CPU's instruction-set flags (the code is built with
-march=native), so every later process on the machine loads the built library in well under a second and a changed
source or a different CPU gets a build of its own. Concurrent loads take turns on an flock in that directory.
TANDEM_CPU_KERNEL_MARCH=<arch> (e.g. haswell) builds for that -march instead of native (the GEMM kernels' build
follows it too): on an AVX-512 machine it builds and times the code an AVX2-only CPU gets (its own build directory;
the AVX-512 kernels are still built, and chosen unless TANDEM_CPU_KERNEL_ISA=avx2 names the AVX2 ones).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from tandem.common.config import cpu_compiler_missing_reason as compiler_missing_reason
from tandem.common.model import cpp_build
from tandem.common.model.cpp_build import MARCH_ENV  # noqa: F401  (the knob's name, read by tests and the docs)

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "kernels_avx512.cpp",
                                                              "kernels_avx2.cpp", "kv_ops.cpp",
                                                              "norm_ops.cpp", "mlp_ops.cpp", "layer_loop.cpp",
                                                              "sample_ops.cpp"))
HEADERS = (Path(__file__).with_name("kernels.h"),)
BUILD_PREFIX = "tandem_cpu_attention"
ISA_ENV = "TANDEM_CPU_KERNEL_ISA"
COMPILE_ESTIMATE_S = 60  # measured: 18 s alone on 2 idle cores, 53 s in `tandem up` on a shared 2-core machine

_lock = threading.Lock()
_loaded = False


class CpuKernelBuildError(RuntimeError):
    """The C++ attention kernels could not be compiled or loaded; the message names the compiler and its error."""


def build_directory() -> Path:
    return cpp_build.build_directory(BUILD_PREFIX, SOURCES + HEADERS)


def cflags() -> tuple[str, ...]:
    """cpp_build's flags (-march from TANDEM_CPU_KERNEL_MARCH, default native)."""
    try:
        return cpp_build.cflags()
    except ValueError as e:
        raise CpuKernelBuildError(str(e)) from e


def load_ops():
    """torch.ops.tandem_cpu with decode_attention and extend_attention registered; builds them the first time on
    this machine (logged with the time it took). Raises CpuKernelBuildError with the compiler's complaint."""
    global _loaded
    with _lock:
        if not _loaded:
            reason = compiler_missing_reason()
            if reason:
                raise CpuKernelBuildError(reason)
            _build_and_load()
            _register_fakes()
            _choose_kernels()
            _loaded = True
    return torch.ops.tandem_cpu


def _choose_kernels() -> None:
    """TANDEM_CPU_KERNEL_ISA (auto, avx512, avx2 or portable; unset: auto) forces the attention kernels a process
    runs, e.g. avx2 on an AVX-512 machine to time what an AVX2-only CPU runs; one the CPU lacks raises."""
    name = os.environ.get(ISA_ENV)
    if not name:
        return
    try:
        chosen = torch.ops.tandem_cpu.set_kernel_isa(name)
    except RuntimeError as e:
        raise CpuKernelBuildError(f"{ISA_ENV}={name!r}: {str(e).splitlines()[0]}") from e
    logger.info("%s=%s: the cpu attention backend runs its %s kernels", ISA_ENV, name, chosen)


def loaded_ops():
    """torch.ops.tandem_cpu where this process has loaded them already (the cpu backend runs), else None: for
    callers (greedy sampling) that must not trigger a build."""
    return torch.ops.tandem_cpu if _loaded else None


def _build_and_load() -> None:
    try:
        cpp_build.build_and_load(BUILD_PREFIX, SOURCES + HEADERS, "the CPU attention kernels", COMPILE_ESTIMATE_S,
                                 logger)
    except cpp_build.CppBuildError as e:
        raise CpuKernelBuildError(f"--attention-backend cpu: {e}\nFix the toolchain, or use --attention-backend "
                                  "torch") from e


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing: both attention ops return a new tensor shaped and typed like q; rope_ and
    store_kv only write into their first argument(s); the norms return a new contiguous tensor shaped like x (and
    add_rms_norm_ writes its residual); silu_and_mul a new [R, I] from gate_up [R, 2I]."""

    @torch.library.register_fake("tandem_cpu::decode_attention")
    def _decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, k_scale=1.0, v_scale=1.0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tandem_cpu::extend_attention")
    def _extend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, extend_prefix_lens, extend_seq_lens,
                sm_scale, k_scale=1.0, v_scale=1.0):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tandem_cpu::rope_")
    def _rope(x, cos, sin):
        return None

    @torch.library.register_fake("tandem_cpu::store_kv")
    def _store(k_buffer, v_buffer, loc, k, v):
        return None

    @torch.library.register_fake("tandem_cpu::rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake("tandem_cpu::add_rms_norm_")
    def _add_rms_norm(residual, x, weight, eps):
        return torch.empty_like(residual)

    @torch.library.register_fake("tandem_cpu::silu_and_mul")
    def _silu_and_mul(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
