"""ReqToTokenPool and MHATokenToKVPool: slot bookkeeping, buffer layout and sizes."""

from __future__ import annotations

import pytest
import torch

from tandem.common.memory.kv_pool import MHATokenToKVPool
from tandem.common.memory.req_to_token import ReqToTokenPool


def test_req_to_token_pool_alloc_free_and_double_free():
    pool = ReqToTokenPool(3, 16, "cpu")
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int64
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.alloc() is None and pool.available_size() == 0
    pool.free(slots[1])
    assert pool.available_size() == 1 and pool.alloc() == slots[1]
    pool.free(slots[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots[0])
    with pytest.raises(ValueError):
        pool.free(7)


def test_kv_pool_layout_and_sizes():
    pool = MHATokenToKVPool(size=32, page_size=8, dtype=torch.bfloat16, num_layers=3, num_kv_heads=2, head_dim=4,
                            device="cpu")
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    assert pool.k_buffers[0].shape == (40, 2, 4) and pool.k_buffers[0].dtype == torch.bfloat16
    assert pool.bytes_per_token() == 2 * 3 * 2 * 4 * 2
    assert pool.page_bytes() == 8 * 2 * 4 * 2
    assert pool.total_bytes() == 2 * 3 * 40 * 2 * 4 * 2
    assert pool.num_pages == 4


def test_set_kv_buffer_writes_rows_of_the_given_page():
    pool = MHATokenToKVPool(16, 4, torch.float32, 2, 2, 3, "cpu")
    page = 2
    loc = torch.arange(page * 4, page * 4 + 4)
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert torch.equal(k_buf[8:12], k) and torch.equal(v_buf[8:12], v)
    assert k_buf[:8].abs().sum() == 0 and pool.k_buffers[0].abs().sum() == 0
    assert torch.equal(k_buf[8:12].contiguous().view(-1), k_buf.view(-1)[8 * 6: 12 * 6])  # page = contiguous rows
