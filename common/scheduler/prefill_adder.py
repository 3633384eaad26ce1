"""PrefillAdder: decides which waiting requests join the next prefill batch under token budgets."""

from __future__ import annotations

import enum
from typing import Optional

from tandem.common.scheduler.kv_cache_ops import KVCacheOps
from tandem.common.scheduler.req import Req

# Cap on how many future tokens one request is assumed to need when budgeting (SGLang's clip).
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    CONTINUE = "continue"  # added; try the next request
    NO_TOKEN = "no_token"  # KV budget exhausted; stop
    OTHER = "other"  # another budget (prefill tokens, running slots) exhausted; stop


def reserved_decode_tokens(req: Req, new_token_ratio: float) -> int:
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    return int(min(remaining, CLIP_MAX_NEW_TOKENS) * new_token_ratio)


def sort_waiting_queue(waiting: list[Req], policy: str, ops: KVCacheOps) -> None:
    """fcfs keeps arrival order; lpm serves the requests with the longest cached prefix first."""
    if policy == "lpm" and ops.caching:
        for req in waiting:
            if req.req_pool_idx is None:
                ops.match_prefix(req)
        waiting.sort(key=lambda r: -len(r.prefix_indices))


class PrefillAdder:
    def __init__(self, ops: KVCacheOps, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int, free_running_slots: int):
        self.ops = ops
        self.page_size = ops.page_size
        self.new_token_ratio = new_token_ratio
        reserved = sum(reserved_decode_tokens(r, new_token_ratio) for r in running)
        self.rem_total_tokens = ops.available_tokens() - reserved
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens: Optional[int] = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.free_running_slots = free_running_slots
        self.free_req_slots = ops.req_to_token_pool.available_size()
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Optional[Req] = None

    def _budget_tokens(self, extend_len: int) -> int:
        # Pages are the unit of allocation: a partially filled page costs a whole one.
        return extend_len + self.page_size

    def _truncate_to_chunk(self, req: Req) -> bool:
        """Cut the request's extend to the chunk budget. False if not even one page fits."""
        budget = min(self.rem_chunk_tokens, self.rem_input_tokens) if self.rem_chunk_tokens else None
        if budget is None or req.extend_input_len <= budget:
            return True
        trunc = budget // self.page_size * self.page_size if self.page_size > 1 else budget
        if trunc <= 0:
            return False
        req.extend_input_len = trunc
        start = req.kv_len if req.req_pool_idx is not None else len(req.prefix_indices)
        req.fill_ids = req.fill_ids[: start + trunc]
        req.is_chunked = True
        self.new_chunked_req = req
        return True

    def add_chunked_req(self, req: Req) -> None:
        """The next chunk of a prompt already being prefilled always goes first."""
        req.fill_ids = req.all_ids()
        req.extend_input_len = len(req.fill_ids) - req.kv_len
        req.is_chunked = False
        self._truncate_to_chunk(req)
        self._take(req, locked_already=True)

    def add_one_req(self, req: Req) -> AddResult:
        if self.free_running_slots <= len(self.can_run_list) or self.free_req_slots <= 0:
            return AddResult.OTHER
        need = self._budget_tokens(req.extend_input_len) + reserved_decode_tokens(req, self.new_token_ratio)
        # Locking its prefix takes those cached tokens out of the evictable ones rem_total_tokens counted.
        if need + self.ops.lockable_tokens(req) > self.rem_total_tokens:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        if req.extend_input_len > self.rem_input_tokens and self.can_run_list and self.rem_chunk_tokens is None:
            return AddResult.OTHER
        if not self._truncate_to_chunk(req):
            return AddResult.OTHER
        self._take(req, locked_already=False)
        self.free_req_slots -= 1
        self.rem_total_tokens -= reserved_decode_tokens(req, self.new_token_ratio)
        return AddResult.CONTINUE if not req.is_chunked else AddResult.OTHER

    def _take(self, req: Req, locked_already: bool) -> None:
        if not locked_already:
            # Its prefix's tokens were counted as evictable in rem_total_tokens; locked, they are not any more.
            self.rem_total_tokens -= self.ops.lock(req)
        self.can_run_list.append(req)
        self.rem_total_tokens -= self._budget_tokens(req.extend_input_len)
        self.rem_input_tokens -= req.extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.extend_input_len
