"""PagedTokenToKVPoolAllocator: extend/decode slot layout, exhaustion, frees and double frees."""

import pytest
import torch

from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator


def pages_of(alloc, slots):
    return set((slots // alloc.page_size).tolist())


def test_sizes_and_page_zero_reserved():
    alloc = PagedTokenToKVPoolAllocator(size=16, page_size=4)
    assert alloc.num_pages == 4 and alloc.page_size == 4 and alloc.size == 16
    assert alloc.available_size() == 16
    slots = alloc.alloc(16)
    assert 0 not in pages_of(alloc, slots)
    assert pages_of(alloc, slots) == {1, 2, 3, 4}


def test_extend_page_size_one_returns_fresh_slots_in_request_order():
    alloc = PagedTokenToKVPoolAllocator(size=10, page_size=1)
    slots = alloc.alloc_extend([0, 2], [3, 4], [-1, 7])
    assert slots.dtype == torch.int64 and slots.tolist() == [1, 2, 3, 4, 5]
    assert alloc.available_size() == 5


def test_extend_without_prefix_uses_whole_fresh_pages():
    alloc = PagedTokenToKVPoolAllocator(size=32, page_size=4)
    slots = alloc.alloc_extend([0, 0], [6, 3], [-1, -1])
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    assert alloc.available_size() == 32 - 3 * 4


def test_extend_fills_partial_last_prefix_page_first():
    alloc = PagedTokenToKVPoolAllocator(size=32, page_size=4)
    first = alloc.alloc_extend([0], [6], [-1])  # page 1 full, page 2 half: slots 8, 9
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    # Continue from prefix 6 (last slot 9) to 11 tokens: 10, 11 then a fresh page.
    more = alloc.alloc_extend([6], [11], [9])
    assert more.tolist() == [10, 11, 12, 13, 14]
    assert alloc.available_size() == 32 - 3 * 4


def test_extend_mixed_batch_aligned_and_partial_prefixes():
    alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4)
    # req0: prefix 4 aligned (new page), req1: prefix 5 in page 9 (slot 37), stays in page,
    # req2: prefix 3 at slot 42, crosses into two fresh pages.
    slots = alloc.alloc_extend([4, 5, 3], [6, 7, 10], [7, 37, 42])
    req0, req1, req2 = slots[:2].tolist(), slots[2:4].tolist(), slots[4:].tolist()
    assert req0 == [4, 5]
    assert req1 == [38, 39]
    assert req2[0] == 43
    assert req2[1:5] == [8, 9, 10, 11] and req2[5:] == [12, 13]
    assert alloc.available_size() == 64 - 3 * 4


def test_extend_within_partial_page_needs_no_new_page():
    alloc = PagedTokenToKVPoolAllocator(size=8, page_size=4)
    alloc.alloc(8)
    assert alloc.available_size() == 0
    slots = alloc.alloc_extend([1], [3], [4])
    assert slots.tolist() == [5, 6]


def test_decode_crosses_page_boundaries():
    alloc = PagedTokenToKVPoolAllocator(size=32, page_size=4)
    prompt = alloc.alloc_extend([0, 0], [3, 4], [-1, -1])  # req0: 4,5,6  req1: 8..11
    # req0's 4th token stays in its page; req1's 5th token needs a fresh page.
    slots = alloc.alloc_decode([4, 5], [int(prompt[2]), int(prompt[-1])])
    assert slots.tolist() == [7, 12]
    slots = alloc.alloc_decode([5, 6], [7, 12])
    assert slots.tolist() == [16, 13]


def test_decode_page_size_one():
    alloc = PagedTokenToKVPoolAllocator(size=4, page_size=1)
    alloc.alloc(2)
    assert alloc.alloc_decode([3, 5], [1, 2]).tolist() == [3, 4]
    assert alloc.alloc_decode([4], [3]) is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_exhaustion_returns_none_and_allocates_nothing(page_size):
    alloc = PagedTokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    alloc.alloc(5 * page_size)
    before = alloc.available_size()
    assert alloc.alloc_extend([0, 0], [2 * page_size, 2 * page_size], [-1, -1]) is None
    assert alloc.available_size() == before
    assert alloc.alloc_decode([1, 1, 1, 1], [-1, -1, -1, -1]) is None
    assert alloc.available_size() == before
    assert alloc.alloc_decode([1, 1, 1], [-1, -1, -1]) is not None
    assert alloc.available_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_and_double_free(page_size):
    alloc = PagedTokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    slots = alloc.alloc(3 * page_size)
    alloc.free(slots)
    assert alloc.available_size() == alloc.size
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(slots[:1])
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([0]))  # page 0 is padding, never allocated
    alloc.free(torch.empty(0, dtype=torch.int64))  # no-op


@pytest.mark.parametrize("page_size", [1, 4])
def test_all_pages_return_after_freeing_everything(page_size):
    alloc = PagedTokenToKVPoolAllocator(size=16 * page_size, page_size=page_size)
    a = alloc.alloc_extend([0, 0], [5, 7], [-1, -1])
    b = alloc.alloc_decode([6, 8], [int(a[4]), int(a[-1])])
    held = torch.cat([a, b])
    assert len(set(held.tolist())) == len(held)
    alloc.free_group_begin()
    alloc.free(held[:3])
    alloc.free(held[3:])
    assert alloc.available_size() < alloc.size  # deferred
    alloc.free_group_end()
    assert alloc.available_size() == alloc.size
    assert sorted(alloc.free_pages.tolist()) == list(range(1, alloc.num_pages + 1))


def test_clear_and_page_indices_of():
    alloc = PagedTokenToKVPoolAllocator(size=16, page_size=4)
    slots = alloc.alloc(6)
    assert alloc.page_indices_of(slots).tolist() == [1, 2]
    alloc.clear()
    assert alloc.available_size() == 16


def test_accepts_tensor_arguments():
    alloc = PagedTokenToKVPoolAllocator(size=32, page_size=4)
    first = alloc.alloc_extend(torch.tensor([0]), torch.tensor([5]), torch.tensor([-1]))
    more = alloc.alloc_extend(torch.tensor([5]), torch.tensor([9]), first[-1:])
    assert more.tolist() == [9, 10, 11, 12]
    assert alloc.alloc_decode(torch.tensor([10]), more[-1:]).tolist() == [13]
