"""The KV pool's CPU buffers are advised for transparent huge pages (what makes NIXL's WRITE of them fast)."""

from __future__ import annotations

import pytest
import torch

from tandem.common.memory.huge_pages import advise_huge_pages, thp_mode, zeros_on_huge_pages
from tandem.common.memory.kv_pool import MHATokenToKVPool

needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=f"kernel THP mode is {thp_mode()}")


def _advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding the middle of the tensor carries MADV_HUGEPAGE ('hg' in smaps VmFlags)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("tensor memory not found in /proc/self/smaps")


@needs_thp
def test_kv_pool_buffers_are_advised_for_huge_pages_and_zeroed_also_after_reallocation(monkeypatch):
    pool = MHATokenToKVPool(4096, 16, torch.float32, 2, 4, 64)  # 4 MiB a buffer: holds an aligned 2 MiB
    for buf in pool.k_buffers + pool.v_buffers:
        assert _advised(buf)
        assert buf.count_nonzero() == 0
    pool.allocate()  # resume_memory's re-allocation keeps them there
    assert all(_advised(buf) for buf in pool.k_buffers + pool.v_buffers)
    # huge_pages=False never advises. (Whether its memory shows the flag depends on where malloc places it: a
    # heap region freed by the pool above may still carry it, so the smaps flag cannot tell.)
    import tandem.common.memory.kv_pool as kv_pool

    monkeypatch.setattr(kv_pool, "zeros_on_huge_pages", lambda *a: pytest.fail("advised with huge_pages=False"))
    plain = MHATokenToKVPool(4096, 16, torch.float32, 1, 4, 64, huge_pages=False)
    assert not plain.huge_pages and plain.k_buffers[0].count_nonzero() == 0


@needs_thp
def test_only_whole_aligned_huge_pages_are_advised():
    small = zeros_on_huge_pages((1024,), torch.float32)  # 4 KiB
    assert small.shape == (1024,) and small.count_nonzero() == 0
    assert advise_huge_pages(small) == 0
    big = torch.empty(5 << 20, dtype=torch.uint8)  # holds an aligned 2 MiB page wherever it starts
    advised = advise_huge_pages(big)
    assert advised % (2 << 20) == 0 and 2 << 20 <= advised <= 4 << 20
    assert _advised(big)
