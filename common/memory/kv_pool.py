"""MHATokenToKVPool: the per-layer K/V buffers of the paged KV cache, allocated once at start-up."""

from __future__ import annotations

from typing import Sequence

import torch

from tandem.common.flags import ConfigError
from tandem.common.memory.huge_pages import zeros_on_huge_pages

# --kv-cache-dtype -> the pool's element type (auto: the model's dtype).
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# A 16-bit cache under a float32 model: half the KV bytes (capacity, attention reads, PD transfers); attention
# still runs in float32 over the rounded K/V.
HALF_KV_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                  "fp16": torch.float16}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype that --kv-cache-dtype `name` asks for (config.py has refused unknown names)."""
    if name == "auto":
        return model_dtype
    if name in HALF_KV_DTYPES:
        dtype = HALF_KV_DTYPES[name]
        if model_dtype not in (torch.float32, dtype):
            raise ConfigError(f"--kv-cache-dtype {name} under a {str(model_dtype).removeprefix('torch.')} model: a "
                              "16-bit cache is for a float32 model (this model's own cache is already 16-bit; "
                              "use auto, or fp8_e4m3 for a smaller one)")
        return dtype
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


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

    An FP8 pool (dtype float8_e4m3fn / float8_e5m2) keeps k / k_scales[layer] clamped to the format's range, and
    every attention backend reads float(k) * k_scales[layer] (V alike): per-tensor scales, one per layer. A 16-bit
    pool under a float32 model (--kv-cache-dtype bfloat16/float16) is read widened to float32 (`read_dtype`).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", huge_pages: bool = True,
                 k_scales: Sequence[float] | None = None, v_scales: Sequence[float] | None = None):
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
        self.quantized = is_fp8(dtype)
        if (k_scales is not None or v_scales is not None) and not self.quantized:
            raise ValueError(f"K/V scales are for an FP8 pool, not {dtype}")
        # float32 values: what the kernels multiply by and what a PD peer compares
        self.k_scales = _scales(k_scales, num_layers, "k_scales")
        self.v_scales = _scales(v_scales, num_layers, "v_scales")
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
        """Write k/v [T, num_kv_heads, head_dim] into rows loc [T] of layer layer_id (FP8: divided by the layer's
        scale and clamped to the format's range first)."""
        if self.quantized:
            k, v = self.quantize(k, self.k_scales[layer_id]), self.quantize(v, self.v_scales[layer_id])
        elif k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v

    def read_dtype(self, q_dtype: torch.dtype) -> torch.dtype:
        """The dtype attention reads this pool in for queries of `q_dtype`: the queries' own where the pool is
        narrower (FP8, or 16-bit under a float32 model), the pool's otherwise."""
        return q_dtype if self.quantized or self.dtype != q_dtype else self.dtype

    def as_stored(self, x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """x as this pool holds it (rounded through FP8 or 16 bits), read back as `dtype`: what attention over a new
        token of an extend must see so that prefill and decode read the same K/V."""
        if self.quantized:
            return self.dequantize(self.quantize(x, scale), scale, dtype)
        return x.to(self.dtype).to(dtype)

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x / scale in this FP8 pool's dtype; values past the format's largest finite value saturate to it (a
        plain cast would make them NaN in e4m3fn, inf in e5m2)."""
        limit = torch.finfo(self.dtype).max
        scaled = x.float() if scale == 1.0 else x.float() / scale
        return scaled.clamp_(-limit, limit).to(self.dtype)

    def dequantize(self, x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Rows read from this pool as `dtype` values: float(x) * scale for FP8, a cast otherwise."""
        if not self.quantized:
            return x.to(dtype)
        values = x.float()
        if scale != 1.0:
            values.mul_(scale)
        return values.to(dtype)

    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def page_bytes(self) -> int:
        """Bytes of one page in one layer's K (or V) buffer: the unit of a KV transfer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def total_bytes(self) -> int:
        rows = self.size + self.page_size
        return 2 * self.num_layers * rows * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def _scales(scales: Sequence[float] | None, num_layers: int, name: str) -> list[float]:
    if scales is None:
        return [1.0] * num_layers
    if len(scales) != num_layers:
        raise ValueError(f"{name} has {len(scales)} entries for {num_layers} layers")
    values = torch.tensor(list(scales), dtype=torch.float32)
    if not bool(torch.isfinite(values).all()) or bool((values <= 0).any()):
        raise ValueError(f"{name} must be finite and positive, got {list(scales)}")
    return values.tolist()
