"""PrefillAdder's KV budget: a request's matched prefix is cached and evictable until the adder locks it, so the
tokens it locks count against the budget of the requests after it. Otherwise the batch is admitted on room that
eviction can no longer free, its allocation fails, and the scheduler retries the same batch forever."""

import torch

from tandem.common.memory.allocator import PagedTokenToKVPoolAllocator
from tandem.common.memory.radix_cache import RadixCache
from tandem.common.memory.req_to_token import ReqToTokenPool
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.prefill_adder import AddResult, PrefillAdder
from tandem.common.scheduler.req import Req

PAGE = 4
POOL = 64


def cached(alloc: PagedTokenToKVPoolAllocator, tree: RadixCache, tokens: list[int]) -> None:
    """Put `tokens` in the tree as a finished request leaves them (unlocked, evictable)."""
    value = alloc.alloc_extend([0], [len(tokens)], [-1])
    tree.insert(tokens, value)


def request(rid: str, ids: list[int], ops: KVCacheOps) -> Req:
    req = Req(rid, 0, ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True), set())
    ops.match_prefix(req)
    return req


def setup():
    alloc = PagedTokenToKVPoolAllocator(size=POOL, page_size=PAGE)
    tree = RadixCache(alloc, page_size=PAGE)
    ops = KVCacheOps(ReqToTokenPool(8, POOL, torch.device("cpu")), alloc, tree, PAGE)
    return alloc, tree, ops


def test_a_locked_prefix_leaves_the_budget_so_the_next_request_waits():
    alloc, tree, ops = setup()
    prefix = list(range(100, 140))  # 40 cached tokens: all evictable while nothing is locked
    cached(alloc, tree, prefix)
    assert ops.available_tokens() == POOL
    first = request("a", prefix + [1, 2, 3, 4], ops)
    second = request("b", list(range(200, 220)), ops)  # 20 new tokens: fits 64, not 64 - 40 locked
    assert len(first.prefix_indices) == 40 and len(second.prefix_indices) == 0
    adder = PrefillAdder(ops, [], 1.0, max_prefill_tokens=1024, chunked_prefill_size=0, free_running_slots=8)
    assert adder.add_one_req(first) is AddResult.CONTINUE
    assert adder.add_one_req(second) is AddResult.NO_TOKEN
    assert adder.can_run_list == [first]
    assert tree.protected_size() == 40
    # What the adder let in can really be allocated: its budget is free or evictable once the prefix is locked.
    assert adder.rem_total_tokens >= 0
    assert first.extend_input_len + PAGE <= ops.available_tokens()
    ops.unlock(first)
    assert tree.protected_size() == 0


def test_a_request_whose_prefix_the_earlier_ones_need_evicted_waits():
    alloc, tree, ops = setup()
    prefix = list(range(100, 140))
    cached(alloc, tree, prefix)
    first = request("a", list(range(200, 230)), ops)  # 30 new tokens: only fits by evicting the cached prefix
    second = request("b", prefix + [1, 2, 3, 4], ops)  # 4 new tokens, but it would lock that prefix
    adder = PrefillAdder(ops, [], 1.0, max_prefill_tokens=1024, chunked_prefill_size=0, free_running_slots=8)
    assert adder.add_one_req(first) is AddResult.CONTINUE
    assert adder.add_one_req(second) is AddResult.NO_TOKEN
    assert adder.can_run_list == [first] and tree.protected_size() == 0
    assert ops.evict_for(first.extend_input_len + PAGE)


def test_without_a_cached_prefix_both_requests_fit():
    alloc, tree, ops = setup()
    first = request("a", list(range(100, 120)), ops)
    second = request("b", list(range(200, 220)), ops)
    adder = PrefillAdder(ops, [], 1.0, max_prefill_tokens=1024, chunked_prefill_size=0, free_running_slots=8)
    assert adder.add_one_req(first) is AddResult.CONTINUE
    assert adder.add_one_req(second) is AddResult.CONTINUE
