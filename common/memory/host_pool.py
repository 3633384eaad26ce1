"""HostKVPool: HiCache's L2, per-layer K/V in host memory in the device pool's layout, with its own page allocator."""

from __future__ import annotations

import torch

from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.kv_pool import MHATokenToKVPool


def host_pool_tokens(device_tokens: int, page_size: int, ratio: float, size_gib: float, bytes_per_token: int) -> int:
    """L2 capacity in tokens: `size_gib` GiB when set, else `ratio` x the device pool; whole pages."""
    tokens = int(size_gib * (1 << 30)) // bytes_per_token if size_gib > 0 else int(device_tokens * ratio)
    return tokens // page_size * page_size


class HostKVPool:
    """K and V buffers [size + page_size, num_kv_heads, head_dim] per layer, on the CPU (pinned when the device pool
    is on CUDA, so copies run as DMA). Row r holds host slot r; page 0 is padding, as in the device pool.

    Copies move slot lists: `backup` device→host, `load` host→device (`_copy` says how).
    """

    def __init__(self, device_pool: MHATokenToKVPool, size: int):
        if size < device_pool.page_size:
            raise ValueError(f"host pool of {size} tokens holds no page of {device_pool.page_size}")
        self.device_pool = device_pool
        self.size = size
        self.page_size = device_pool.page_size
        self.dtype = device_pool.dtype
        self.num_layers = device_pool.num_layers
        pin = device_pool.device.type == "cuda"
        shape = (size + self.page_size, device_pool.num_kv_heads, device_pool.head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.allocator = PagedTokenToKVPoolAllocator(size, self.page_size, "cpu")

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for `num_tokens` (a whole number of pages), or None when the pool is full."""
        return self.allocator.alloc(num_tokens)

    def free(self, host_slots: torch.Tensor) -> None:
        self.allocator.free(host_slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def used_tokens(self) -> int:
        return self.size - self.allocator.available_size()

    def bytes_per_token(self) -> int:
        return self.device_pool.bytes_per_token()

    def _layer_pairs(self):
        """(host, device) buffer pairs, K and V of every layer, as raw bytes of the same element size (index_copy_
        has no FP8 kernel on CPU)."""
        for layer in range(self.num_layers):
            k, v = self.device_pool.get_kv_buffer(layer)
            yield _raw(self.k_buffers[layer]), _raw(k)
            yield _raw(self.v_buffers[layer]), _raw(v)

    def _by_page(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Page indices when `slots` are whole pages in order (what the tree holds), else None."""
        ps = self.page_size
        if ps == 1:
            return slots
        pages = slots[::ps] // ps
        expected = pages[:, None] * ps + torch.arange(ps, device=slots.device)
        if len(slots) % ps or not torch.equal(slots.view(-1, ps), expected):
            return None
        return pages

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, to_host: bool) -> None:
        """Rows `src` of one side into rows `dst` of the other, every layer's K and V. Whole pages on the CPU move
        as runs of consecutive pages, one slice copy each (5x faster than index_select + index_copy_ there);
        otherwise one batched gather, one transfer and one scatter per buffer."""
        src_pages, dst_pages = self._by_page(src), self._by_page(dst)
        pairs = list(self._layer_pairs())
        if src_pages is not None and dst_pages is not None and self.device_pool.device.type == "cpu":
            for start_src, start_dst, length in _runs(src_pages.tolist(), dst_pages.tolist()):
                for host, device in pairs:
                    from_buf, to_buf = (device, host) if to_host else (host, device)
                    rows = self.page_size
                    to_buf[start_dst * rows:(start_dst + length) * rows].copy_(
                        from_buf[start_src * rows:(start_src + length) * rows])
            return
        for host, device in pairs:
            if to_host:
                host.index_copy_(0, dst.cpu(), device.index_select(0, src.to(device.device)).cpu())
            else:
                device.index_copy_(0, dst.to(device.device), host.index_select(0, src.cpu()).to(device.device))

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy device slots' K/V into host slots (same length), every layer."""
        self._copy(device_slots.cpu(), host_slots.cpu(), to_host=True)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host slots' K/V into device slots (same length), every layer."""
        self._copy(host_slots.cpu(), device_slots.cpu(), to_host=False)

    def read_rows(self, host_slots: torch.Tensor) -> list[torch.Tensor]:
        """The rows of `host_slots` as raw bytes, K then V of every layer (what an L3 page holds)."""
        src = host_slots.cpu()
        return [host.index_select(0, src) for host, _ in self._layer_pairs()]


def _runs(src: list[int], dst: list[int]):
    """(src start, dst start, length) of the runs where both page lists go up by one."""
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        yield src[i], dst[i], j - i
        i = j


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as unsigned bytes, one column per byte of an element: every copy here moves bytes."""
    return t.view(torch.uint8)
