"""Build a folder of C++ torch ops once per machine with torch's cpp_extension, and load the cached build after.

The build lands in <TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/<prefix>_<key>; the key hashes the sources,
their folder, the flags, torch's version, the compiler and this CPU's instruction-set flags (-march=native), so a
changed source or another CPU gets a build of its own. Concurrent processes take turns on an flock there.
(The same scheme as the attention kernels' common/model/attention/cpu/__init__.py.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Sequence

from tandem.common.config import cpu_compiler as compiler
from tandem.common.config import cpu_compiler_missing_reason
from tandem.common.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-Wall")
LDFLAGS = ("-fopenmp",)


class CppBuildError(RuntimeError):
    """The C++ ops could not be compiled or loaded; the message names the compiler and its error."""


def build_directory(prefix: str, sources: Sequence[Path]) -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    import torch

    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS + (torch.__version__, compiler(), str(sources[0].parent))).encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return Path(base) / f"{prefix}_{digest.hexdigest()[:16]}"


def build_and_load(prefix: str, sources: Sequence[Path], what: str) -> None:
    """Compile `sources` (.cpp first, headers after: they only enter the key) into a library of torch ops and
    load it; raises CppBuildError with the compiler's complaint."""
    from torch.utils.cpp_extension import load

    reason = cpu_compiler_missing_reason()
    if reason:
        raise CppBuildError(f"{what}: {reason}")
    directory = build_directory(prefix, sources)
    directory.mkdir(parents=True, exist_ok=True)
    name = directory.name
    try:
        with _build_turn(directory):
            compiling = not (directory / f"{name}.so").exists()
            if compiling:
                logger.warning("compiling %s (once) in %s", what, directory)
            start = time.perf_counter()
            load(name=name, sources=[str(s) for s in sources if s.suffix == ".cpp"], extra_cflags=list(CFLAGS),
                 extra_ldflags=list(LDFLAGS), build_directory=str(directory), is_python_module=False,
                 verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise CppBuildError(f"{what}: building with {compiler()!r} failed in {directory}: {e}") from e
    if compiling:
        logger.warning("compiled %s in %.1f s; later processes reuse the build", what, time.perf_counter() - start)


@contextlib.contextmanager
def _build_turn(directory: Path):
    """An flock (released by the kernel if its holder dies), so torch's own `lock` file found here is stale."""
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
