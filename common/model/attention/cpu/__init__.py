"""The C++ paged attention ops of the `cpu` backend: built on first use with torch's cpp_extension, then cached.

The build lands in <TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/tandem_cpu_attention_<key>, where the key
hashes the sources and their folder, the flags, torch's version and this CPU's instruction-set flags (the code is built with
-march=native), so every later process on the machine loads the built library in well under a second and a changed
source or a different CPU gets a build of its own. Concurrent loads take turns on an flock in that directory.
TANDEM_CPU_KERNEL_MARCH=<arch> (e.g. haswell) builds for that -march instead of native: on an AVX-512 machine it builds
and times the code an AVX2-only CPU gets (its own build directory; the AVX-512 kernels are still built and chosen).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from tandem.common.config import cpu_compiler as compiler
from tandem.common.config import cpu_compiler_missing_reason as compiler_missing_reason
from tandem.common.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "kernels_avx512.cpp",
                                                              "kernels_avx2.cpp", "kv_ops.cpp",
                                                              "norm_ops.cpp", "mlp_ops.cpp", "layer_loop.cpp",
                                                              "sample_ops.cpp"))
HEADERS = (Path(__file__).with_name("kernels.h"),)
# -fopenmp: at::parallel_for is header code that runs serially without it; the library then links libgomp.so.1,
# which resolves to the copy torch has already loaded (one OpenMP runtime, one thread count).
MARCH_ENV = "TANDEM_CPU_KERNEL_MARCH"
LDFLAGS = ("-fopenmp",)
COMPILE_ESTIMATE_S = 60  # measured: 18 s alone on 2 idle cores, 53 s in `tandem up` on a shared 2-core machine

_lock = threading.Lock()
_loaded = False


class CpuKernelBuildError(RuntimeError):
    """The C++ attention kernels could not be compiled or loaded; the message names the compiler and its error."""


def build_directory() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    return Path(base) / f"tandem_cpu_attention_{_build_key()}"


def cflags() -> tuple[str, ...]:
    march = os.environ.get(MARCH_ENV) or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise CpuKernelBuildError(f"{MARCH_ENV}={march!r} is no -march value (e.g. native, haswell, x86-64-v3)")
    return ("-O3", f"-march={march}", "-fopenmp", "-Wall")


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    # The sources' folder too: ninja's build file names them by path, so two checkouts of the same sources
    # sharing one directory would rebuild it each time the other one loaded.
    digest.update(" ".join(cflags() + LDFLAGS + (torch.__version__, compiler(), str(SOURCES[0].parent))).encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


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
            _loaded = True
    return torch.ops.tandem_cpu


def loaded_ops():
    """torch.ops.tandem_cpu where this process has loaded them already (the cpu backend runs), else None: for
    callers (greedy sampling) that must not trigger a build."""
    return torch.ops.tandem_cpu if _loaded else None


def _build_and_load() -> None:
    from torch.utils.cpp_extension import load  # ~0.1 s on top of torch: only a process that runs the cpu backend

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    name = directory.name
    try:
        with _build_turn(directory):
            # Checked in our turn: a process that waited for another's build only loads it.
            compiling = not (directory / f"{name}.so").exists()
            if compiling:  # a warning: shown at the default log level, where a silent minute looks like a hang
                logger.warning("compiling the CPU attention kernels (once, up to about %d s) in %s", COMPILE_ESTIMATE_S,
                               directory)
            start = time.perf_counter()
            load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(cflags()),
                 extra_ldflags=list(LDFLAGS), build_directory=str(directory), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise CpuKernelBuildError(
            f"--attention-backend cpu: building the C++ attention kernels with {compiler()!r} failed in {directory}: "
            f"{e}\nFix the toolchain, or use --attention-backend torch") from e
    elapsed = time.perf_counter() - start
    if compiling:
        logger.warning("compiled the CPU attention kernels in %.1f s; later processes reuse the build", elapsed)
    else:
        logger.debug("cpu attention kernels loaded from %s in %.2f s", directory, elapsed)


@contextlib.contextmanager
def _build_turn(directory: Path):
    """One process at a time builds or loads in `directory`. torch's own baton is a plain `lock` file that a
    process killed mid-build leaves behind, and every later process would wait on it forever; an flock is released
    by the kernel when its holder dies, so whoever holds ours knows a `lock` file it finds is stale."""
    with open(directory / "build.flock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


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
