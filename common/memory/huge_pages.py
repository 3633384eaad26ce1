"""Large CPU buffers on transparent huge pages (THP): the KV pool, whose pages NIXL copies between processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size
_MADV_HUGEPAGE = 14
_THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@functools.cache
def thp_mode() -> str:
    """The kernel's THP mode ('always', 'madvise', 'never'), or 'unavailable' off Linux / without THP."""
    try:
        with open(_THP_MODE_PATH) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose 2 MiB-aligned interior is advised for THP before its first touch, so page
    faults map 2 MiB pages. Why: a cross-process copy (UCX's CMA, i.e. process_vm_writev, under every NIXL
    WRITE on one host) pins and maps the target 4 KiB at a time; on 2 MiB pages the same copy runs ~2x faster
    here (docs/performance-history.md §5), and every reader walks 512x fewer page-table entries.

    Where the kernel cannot (no THP, or no free 2 MiB blocks) the tensor is an ordinary one."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """madvise(MADV_HUGEPAGE) the 2 MiB-aligned part of a CPU tensor's memory; returns the bytes advised
    (0 when nothing could be). Pages already touched keep their size until khugepaged merges them."""
    if tensor.is_cuda or sys.platform != "linux" or thp_mode() not in ("always", "madvise"):
        return 0
    begin = tensor.data_ptr()
    first = (begin + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    length = (begin + tensor.numel() * tensor.element_size() - first) & ~(_HUGE_PAGE - 1)
    if length <= 0:
        return 0
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    return length
