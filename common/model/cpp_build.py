"""Build a set of C++ torch ops once per machine with torch's cpp_extension, and load the cached build after: the
`cpu` attention backend's kernels (common/model/attention/cpu) and the GEMM kernels (common/model/cpu_gemm).

The build lands in <TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/<prefix>_<key>; the key hashes the sources'
names and contents, the flags, torch's version, the compiler and this CPU's instruction-set flags, so a changed source
or another CPU gets a build of its own, and every copy of the same sources (a wheel's install, a second checkout, a
symlink to one) shares one build. The sources are copied into the build directory and compiled from there, so the
ninja file never names a checkout. Concurrent processes take turns on an flock there.
TANDEM_CPU_KERNEL_MARCH=<arch> (e.g. haswell) builds for that -march instead of native, in a directory of its own:
on an AVX-512 machine every C++ op of Tandem then runs as an AVX2-only CPU gets it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Optional, Sequence

from tandem.common.config import cpu_compiler as compiler
from tandem.common.config import cpu_compiler_missing_reason
from tandem.common.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

MARCH_ENV = "TANDEM_CPU_KERNEL_MARCH"
LDFLAGS = ("-fopenmp",)  # at::parallel_for runs serially without OpenMP; libgomp resolves to torch's copy


class CppBuildError(RuntimeError):
    """The C++ ops could not be compiled or loaded; the message names the compiler and its error."""


def cflags() -> tuple[str, ...]:
    """The compiler flags: -march from TANDEM_CPU_KERNEL_MARCH (default native); raises ValueError on a value that
    is no -march name."""
    march = os.environ.get(MARCH_ENV) or "native"
    if not march.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"{MARCH_ENV}={march!r} is no -march value (e.g. native, haswell, x86-64-v3)")
    return ("-O3", f"-march={march}", "-fopenmp", "-Wall")


def build_directory(prefix: str, sources: Sequence[Path]) -> Path:
    """Where `sources` (.cpp files and the headers they include, all in one folder) build with cflags()."""
    import torch

    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    digest = hashlib.sha256()
    for source in sources:
        digest.update(Path(source).name.encode() + b"\0" + Path(source).read_bytes())
    digest.update(" ".join(cflags() + LDFLAGS + (torch.__version__, compiler())).encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return Path(base) / f"{prefix}_{digest.hexdigest()[:16]}"


def build_and_load(prefix: str, sources: Sequence[Path], what: str, estimate_s: Optional[int] = None,
                   log: logging.Logger = logger) -> None:
    """Compile `sources` (the .cpp files and the headers they include) into a library of torch ops and load it; a
    first build logs a warning to `log` before (with estimate_s, how long it may take) and after. Raises
    CppBuildError with the compiler's complaint."""
    from torch.utils.cpp_extension import load  # ~0.1 s on top of torch: only a process that runs C++ ops

    reason = cpu_compiler_missing_reason()
    if reason:
        raise CppBuildError(f"{what}: {reason}")
    try:
        flags = cflags()
    except ValueError as e:
        raise CppBuildError(f"{what}: {e}") from e
    directory = build_directory(prefix, sources)
    name = directory.name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _build_turn(directory):
            # Checked in our turn: a process that waited for another's build only loads it.
            # (torch names a library it loads a second time in one process, from another directory, <name>_v1.so)
            compiling = not any(directory.glob(f"{name}.so")) and not any(directory.glob(f"{name}_v*.so"))
            if compiling:  # a warning: shown at the default log level, where a silent minute looks like a hang
                up_to = f", up to about {estimate_s} s" if estimate_s else ""
                log.warning("compiling %s (once%s) in %s", what, up_to, directory)
            start = time.perf_counter()
            copies = _copy_sources(sources, directory / "src")
            load(name=name, sources=[str(c) for c in copies if c.suffix == ".cpp"], extra_cflags=list(flags),
                 extra_ldflags=list(LDFLAGS), build_directory=str(directory), is_python_module=False,
                 verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise CppBuildError(f"building {what} with {compiler()!r} failed in {directory}: {e}") from e
    elapsed = time.perf_counter() - start
    if compiling:
        log.warning("compiled %s in %.1f s; later processes reuse the build", what, elapsed)
    else:
        log.debug("%s loaded from %s in %.2f s", what, directory, elapsed)


def _copy_sources(sources: Sequence[Path], into: Path) -> list[Path]:
    """The sources copied into the build directory (their contents are in its key, so a copy already there is the
    same file and stays, keeping its time stamp: ninja then rebuilds nothing)."""
    into.mkdir(exist_ok=True)
    copies = []
    for source in sources:
        copy = into / Path(source).name
        if not copy.exists():
            partial = copy.with_name(copy.name + ".partial")
            partial.write_bytes(Path(source).read_bytes())
            partial.replace(copy)
        copies.append(copy)
    return copies


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
