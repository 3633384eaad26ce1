"""Paged allocator of KV slots: hands out whole pages of the token-to-KV pool, page 0 reserved for padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

IntList = Sequence[int] | torch.Tensor


class PagedTokenToKVPoolAllocator:
    """Free-page list over pages 1..size // page_size of a token-to-KV pool.

    A token's KV slot is ``page * page_size + offset``. Only whole pages are
    ever shared (by the radix cache), so a page is either free or owned as a
    unit; ``free`` takes slots and returns the pages that contain them.
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(f"size ({size}) must hold at least one page of {page_size} tokens")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._free_group: list[torch.Tensor] | None = None
        self.clear()

    # ----- bookkeeping -----------------------------------------------------------------

    def clear(self) -> None:
        """Return every page to the free list (page 0 stays reserved)."""
        # A stack of free pages: alloc pops from the top, free pushes, both O(pages moved).
        # Stored descending so a fresh allocator hands out pages 1, 2, 3, ... in order.
        self._free_stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64, device=self.device)
        self._num_free = self.num_pages
        # is_free[0] is False and stays so: freeing page 0 reads as a double free.
        self.is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self.is_free[0] = False

    @property
    def free_pages(self) -> torch.Tensor:
        """The free page indices (a copy; for inspection)."""
        return self._free_stack[: self._num_free].clone()

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return self._num_free * self.page_size

    def page_indices_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Unique, sorted page indices of the pages holding ``slots``."""
        return torch.unique(slots.to(torch.int64) // self.page_size)

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > self._num_free:
            return None
        # flip copies, so later pushes onto the stack cannot alias the returned pages.
        pages = self._free_stack[self._num_free - n : self._num_free].flip(0)
        self._num_free -= n
        self.is_free[pages] = False
        return pages

    def _as_tensor(self, values: IntList) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64, device=self.device)

    # ----- allocation ------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` tokens on fresh pages (a request with no prefix)."""
        return self.alloc_extend([0], [num_tokens], [-1])

    def alloc_extend(
        self, prefix_lens: IntList, seq_lens: IntList, last_locs: IntList
    ) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated in request order.

        ``last_locs[i]`` is the slot of request i's last prefix token (-1 when it has
        none). A partly filled last prefix page belongs to the request, so its free
        tail is used before fresh pages. Returns None, allocating nothing, when there
        are not enough free pages.
        """
        ps = self.page_size
        prefix = self._as_tensor(prefix_lens)
        seq = self._as_tensor(seq_lens)
        ext_lens = seq - prefix
        if bool((ext_lens < 0).any()):
            raise ValueError("seq_lens must be >= prefix_lens")
        # Fresh pages needed: pages covering seq minus pages already covering the prefix.
        pages_per_req = (seq + ps - 1) // ps - (prefix + ps - 1) // ps
        num_new_pages = int(pages_per_req.sum())
        new_pages = self._take_pages(num_new_pages)
        if new_pages is None:
            return None
        if ps == 1:
            return new_pages  # one fresh page per position, already in request order
        return self._extend_slots(prefix, ext_lens, self._as_tensor(last_locs), pages_per_req, new_pages)

    def _extend_slots(
        self,
        prefix: torch.Tensor,
        ext_lens: torch.Tensor,
        last_locs: torch.Tensor,
        pages_per_req: torch.Tensor,
        new_pages: torch.Tensor,
    ) -> torch.Tensor:
        ps = self.page_size
        total = int(ext_lens.sum())
        req = torch.repeat_interleave(torch.arange(len(prefix), device=self.device), ext_lens)
        ext_start = torch.cumsum(ext_lens, 0) - ext_lens
        pos = torch.arange(total, dtype=torch.int64, device=self.device) - ext_start[req] + prefix[req]
        aligned_prefix = ((prefix + ps - 1) // ps * ps)[req]
        # Positions before the next page boundary continue the request's own partial page.
        in_partial_page = pos < aligned_prefix
        partial_slots = last_locs[req] + (pos - prefix[req] + 1)
        if new_pages.numel() == 0:
            return partial_slots
        page_start = (torch.cumsum(pages_per_req, 0) - pages_per_req)[req]
        page_idx = (page_start + (pos - aligned_prefix).clamp(min=0) // ps).clamp(max=new_pages.numel() - 1)
        fresh_slots = new_pages[page_idx] * ps + pos % ps
        return torch.where(in_partial_page, partial_slots, fresh_slots)

    def alloc_decode(self, seq_lens: IntList, last_locs: IntList) -> torch.Tensor | None:
        """One slot per request for its new token at position seq_len - 1.

        The slot after ``last_loc`` when the token stays in the same page, else the
        first slot of a fresh page. Returns None, allocating nothing, when out of pages.
        """
        ps = self.page_size
        seq = self._as_tensor(seq_lens)
        if ps == 1:
            return self._take_pages(int(seq.numel()))
        needs_page = (seq - 1) % ps == 0
        new_pages = self._take_pages(int(needs_page.sum()))
        if new_pages is None:
            return None
        next_slots = self._as_tensor(last_locs) + 1
        if new_pages.numel() == 0:
            return next_slots
        page_idx = (torch.cumsum(needs_page, 0) - 1).clamp(min=0)
        return torch.where(needs_page, new_pages[page_idx] * ps, next_slots)

    # ----- release ---------------------------------------------------------------------

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that contain ``slots``; callers free all slots of a page together."""
        if slots.numel() == 0:
            return
        if self._free_group is not None:
            self._free_group.append(slots)
            return
        pages = self.page_indices_of(slots.to(self.device))
        if bool((pages <= 0).any()) or bool((pages > self.num_pages).any()):
            raise ValueError(f"freeing slots outside pages 1..{self.num_pages}: pages {pages.tolist()}")
        if bool(self.is_free[pages].any()):
            doubles = pages[self.is_free[pages]].tolist()
            raise RuntimeError(f"double free of KV pages {doubles}")
        self.is_free[pages] = True
        self._free_stack[self._num_free : self._num_free + pages.numel()] = pages
        self._num_free += pages.numel()

    def free_group_begin(self) -> None:
        """Defer frees until ``free_group_end`` so they cost one concatenation."""
        if self._free_group is None:
            self._free_group = []

    def free_group_end(self) -> None:
        group, self._free_group = self._free_group, None
        if group:
            self.free(torch.cat(group))
