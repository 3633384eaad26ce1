"""The machine's measured limits for the roofline: float32 FMA peak (one core's, from independent FMA chains on the
widest vector unit, times the threads used) and memory bandwidth (a copy over arrays several times the last-level
cache, every thread). Measured once per process and thread count, in one to two seconds.

Both are the best of several short runs: other processes on the machine only ever slow a run down. One core's
peak times the threads is what the brief of issue 31 asks for, and on a shared machine one thread finds a free
core far more often than all of them at once do."""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.common.cpuinfo import cpu_flags, cpu_model_name

# Flags that decide which GEMM and attention kernels run; the report names those this CPU has.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                "amx_bf16")
FMA_REP_S = 0.03  # one timed run of the chains; the best of FMA_REPS is the peak
FMA_REPS = 10
COPY_REPS = 5
MIN_COPY_BYTES, MAX_COPY_BYTES = 256 << 20, 1 << 30


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    cpu_flags: list[str]  # of KERNEL_FLAGS, those present
    threads: int
    fma_isa: str  # "avx512" or "avx2": the vector unit that gave the peak
    core_gflops: float  # float32, one core
    peak_gflops: float  # core_gflops x threads
    bandwidth_gbs: float  # copy: bytes read + bytes written per second
    copy_bytes: int  # size of each array copied

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP per byte) above which a step is bound by the FMAs, not the memory."""
        return self.peak_gflops / self.bandwidth_gbs

    def as_dict(self) -> dict:
        return asdict(self) | {"ridge_flop_per_byte": self.ridge}


def fma_peak(threads: int = 1) -> tuple[str, float]:
    """(isa, GFLOP/s): the best of a few runs of independent FMA chains on `threads` threads, over the vector
    units built here (the one that wins)."""
    from tandem.common.model.cpu_gemm import load_ops  # builds the C++ probe on first use (cached per machine)

    ops = load_ops()
    best = ("", 0.0)
    for width in ops.fma_widths():
        iters, seconds = 1 << 14, 0.0
        while seconds < FMA_REP_S / 4:  # calibrate the run length (the first runs also wake the threads)
            iters *= 2
            seconds = ops.fma_probe(iters, width, threads).tolist()[1]
        iters = int(iters * FMA_REP_S / seconds)
        for _ in range(FMA_REPS):
            flops, seconds = ops.fma_probe(iters, width, threads).tolist()
            gflops = flops / seconds / 1e9
            if gflops > best[1]:
                best = ("avx512" if width == 16 else "avx2", gflops)
    if not best[0]:
        raise RuntimeError("the FMA probe needs AVX-512 or AVX2+FMA; this CPU has neither")
    return best


def llc_bytes() -> int:
    """The largest cache's size from sysfs (0 when unknown)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def copy_bandwidth(nbytes: int) -> float:
    """GB/s of dst.copy_(src) over `nbytes`-byte float32 arrays, counting the bytes read and written (STREAM's
    convention); best of COPY_REPS after a pass that faults the pages in."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(COPY_REPS):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


@functools.cache
def measure_machine(threads: int | None = None) -> Machine:
    """This CPU's peak and bandwidth with `threads` torch threads (default: torch's); measured once per process."""
    threads = threads or torch.get_num_threads()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        isa, core = fma_peak(1)
        nbytes = min(MAX_COPY_BYTES, max(MIN_COPY_BYTES, 4 * llc_bytes()))
        bandwidth = copy_bandwidth(nbytes)
    finally:
        torch.set_num_threads(saved)
    flags = cpu_flags()
    return Machine(cpu_model=cpu_model_name(), cpu_flags=[f for f in KERNEL_FLAGS if f in flags], threads=threads,
                   fma_isa=isa, core_gflops=core, peak_gflops=core * threads, bandwidth_gbs=bandwidth,
                   copy_bytes=nbytes)


def format_machine(m: Machine) -> str:
    return (f"{m.cpu_model} ({', '.join(m.cpu_flags)}), {m.threads} threads: float32 FMA peak "
            f"{m.peak_gflops:.1f} GFLOP/s ({m.core_gflops:.1f} a core, {m.fma_isa}), copy bandwidth {m.bandwidth_gbs:.1f} GB/s "
            f"({m.copy_bytes >> 20} MiB arrays), ridge {m.ridge:.1f} FLOP/byte")
