"""An L3 page on the wire: header (magic, version, shape, dtype, checksum) + every layer's K and V; and the keys
that name pages, so nothing computed under another model, weight version, dtype or page size is ever loaded."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"TKVP"
VERSION = 1
# magic, version, layers, page_size, kv_heads, head_dim, dtype name (16 bytes), crc32 of the payload
_HEADER = struct.Struct("<4sHHIII16sI")


class PageFormatError(ValueError):
    """A stored page that must not be used: wrong magic/version/shape/dtype, truncated, or a checksum mismatch."""


@dataclass(frozen=True)
class PageLayout:
    """The shape every page of one pool has: rows are `page_size` tokens of [kv_heads, head_dim] in `dtype`."""

    num_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def row_bytes(self) -> int:
        return self.page_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    def payload_bytes(self) -> int:
        return 2 * self.num_layers * self.row_bytes()


def encode_page(layout: PageLayout, rows: list[torch.Tensor]) -> bytes:
    """`rows`: K then V of every layer for one page, raw uint8 views (HostKVPool.read_rows / a device copy)."""
    payload = b"".join(r.contiguous().cpu().numpy().tobytes() for r in rows)
    if len(payload) != layout.payload_bytes():
        raise ValueError(f"page payload has {len(payload)} bytes, layout wants {layout.payload_bytes()}")
    header = _HEADER.pack(MAGIC, VERSION, layout.num_layers, layout.page_size, layout.kv_heads, layout.head_dim,
                          layout.dtype_name.encode().ljust(16, b"\0"), zlib.crc32(payload))
    return header + payload


def decode_page(layout: PageLayout, data: bytes) -> list[torch.Tensor]:
    """The page's rows (K then V per layer, uint8 [page_size, kv_heads, head_dim * itemsize]); raises
    PageFormatError when the page does not match `layout` or its checksum."""
    if len(data) != _HEADER.size + layout.payload_bytes():
        raise PageFormatError(f"page has {len(data)} bytes, expected {_HEADER.size + layout.payload_bytes()}")
    magic, version, layers, page_size, heads, head_dim, dtype, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise PageFormatError(f"not a version-{VERSION} KV page (magic {magic!r}, version {version})")
    seen = (layers, page_size, heads, head_dim, dtype.rstrip(b"\0").decode(errors="replace"))
    wanted = (layout.num_layers, layout.page_size, layout.kv_heads, layout.head_dim, layout.dtype_name)
    if seen != wanted:
        raise PageFormatError(f"page layout {seen} does not match the pool's {wanted}")
    payload = memoryview(data)[_HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise PageFormatError("page checksum mismatch")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    shape = (layout.page_size, layout.kv_heads, layout.head_dim * layout.dtype.itemsize)
    return list(flat.view(2 * layout.num_layers, *shape).unbind(0))


def model_identity(model_path: str, layout: PageLayout, weight_version: str) -> bytes:
    """Digest of what a page's KV depends on besides its tokens: the model's config.json (or the GGUF file's
    name and size), the weight version, the KV dtype, page size and shape."""
    h = hashlib.blake2b(digest_size=16)
    config = os.path.join(model_path, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(json.dumps(json.load(f), sort_keys=True).encode())
    else:
        h.update(os.path.basename(model_path).encode() + str(os.path.getsize(model_path)).encode())
    h.update(f"|{weight_version}|{layout}".encode())
    return h.digest()


def storage_key(identity: bytes, page_hash: int) -> str:
    """The L3 key of a page: its chained page hash (page_hash.block_hash, adapter-seeded) folded with `identity`."""
    return hashlib.blake2b(identity + page_hash.to_bytes(8, "little", signed=True), digest_size=16).hexdigest()
