"""MHATokenToKVPool: the per-layer K/V buffers of the paged KV cache, allocated once at start-up."""

from __future__ import annotations

import torch

from tandem.common.memory.huge_pages import zeros_on_huge_pages


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one token across all layers (sizes the pool before it exists)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class MHATokenToKVPool:
    """K and V buffers of shape [size + page_size, num_kv_heads, head_dim], one pair per layer.

    Row r holds the K/V of KV slot r. Page p spans rows [p*page_size, (p+1)*page_size) in every
    layer buffer; page 0 is a padding page that the allocator never hands out, so padded slot
    indices (0) in a batch write and read harmless rows.

    CPU buffers sit on transparent huge pages where the kernel allows (`huge_pages`,
    common/memory/huge_pages.py): NIXL's cross-process WRITE of their pages runs about twice as fast.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", huge_pages: bool = True):
        if page_size < 1 or size < page_size:
            raise ValueError(f"KV pool needs page_size >= 1 and size >= page_size, got size={size}, "
                             f"page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.huge_pages = huge_pages and self.device.type == "cpu"
        self.allocate()

    def allocate(self) -> None:
        """(Re)create zeroed K and V buffers (start-up, and resume after release_memory)."""
        shape = (self.size + self.page_size, self.num_kv_heads, self.head_dim)

        def buffer() -> torch.Tensor:
            if self.huge_pages:
                return zeros_on_huge_pages(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        self.k_buffers = [buffer() for _ in range(self.num_layers)]
        self.v_buffers = [buffer() for _ in range(self.num_layers)]

    @property
    def num_pages(self) -> int:
        """Pages the allocator may hand out (1..num_pages); page 0 is padding."""
        return self.size // self.page_size

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffers[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [T, num_kv_heads, head_dim] into rows loc [T] of layer layer_id."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v

    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def page_bytes(self) -> int:
        """Bytes of one page in one layer's K (or V) buffer: the unit of a KV transfer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def total_bytes(self) -> int:
        rows = self.size + self.page_size
        return 2 * self.num_layers * rows * self.num_kv_heads * self.head_dim * self.dtype.itemsize
