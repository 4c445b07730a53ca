"""Page tables over a fixed pool of KV pages: the books, without the tensors (torch-free).

A fixed pool of pages of `page_size` tokens; each sequence's table lists its pages in
order. A page may be mapped by several holders (sequences' page tables, and the prefix
cache's index through `hold`/`unhold`): each page counts its holders and goes back to
the free list when the last lets go. Shared pages are only ever read: they hold full
blocks of tokens before any position a sharing sequence writes.
"""

from __future__ import annotations

import math


class PageTables:
    """Free list, page tables, reserved positions and holder counts of `num_pages` pages."""

    def __init__(self, *, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest
        self._page_tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._num_holders = [0] * num_pages

    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def num_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def num_tokens(self, seq_id: int) -> int:
        """Positions reserved for `seq_id` (0 for an unknown id)."""
        return self._num_tokens.get(seq_id, 0)

    def num_pages_held(self, seq_id: int) -> int:
        return len(self._page_tables.get(seq_id, ()))

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._num_new_pages(seq_id, num_new_tokens) <= len(self._free_pages)

    def append(self, seq_id: int, num_new_tokens: int) -> None:
        """Reserve positions [n, n + num_new_tokens) of `seq_id`; call only when can_append."""
        num_new_pages = self._num_new_pages(seq_id, num_new_tokens)
        if num_new_pages > len(self._free_pages):
            raise RuntimeError(
                f"seq {seq_id}: {num_new_pages} pages needed, {len(self._free_pages)} free"
            )
        table = self._page_tables.setdefault(seq_id, [])
        for _ in range(num_new_pages):
            page = self._free_pages.pop()
            self._num_holders[page] = 1
            table.append(page)
        self._num_tokens[seq_id] = self.num_tokens(seq_id) + num_new_tokens

    def map_shared(self, seq_id: int, pages: list[int], num_tokens: int) -> None:
        """Start `seq_id`'s (empty) table with held `pages`, filled up to `num_tokens`."""
        if seq_id in self._page_tables:
            raise RuntimeError(f"seq {seq_id} has a page table already")
        self.hold(pages)
        self._page_tables[seq_id] = list(pages)
        self._num_tokens[seq_id] = num_tokens

    def pages_of(self, seq_id: int, first: int, num_pages: int) -> tuple[int, ...]:
        """Pages [first, first + num_pages) of `seq_id`'s table."""
        return tuple(self._page_tables[seq_id][first : first + num_pages])

    def replace_pages(self, seq_id: int, first: int, pages: tuple[int, ...]) -> None:
        """Map held `pages` (same contents) in place of `seq_id`'s pages from index `first`."""
        table = self._page_tables[seq_id]
        self.hold(pages)
        self.unhold(table[first : first + len(pages)])
        table[first : first + len(pages)] = pages

    def hold(self, pages) -> None:
        """One more holder of each of `pages` (taken pages only)."""
        for page in pages:
            self._num_holders[page] += 1

    def unhold(self, pages) -> None:
        """One holder fewer of each of `pages`; a page nobody holds goes back to the pool."""
        for page in pages:
            self._num_holders[page] -= 1
            if self._num_holders[page] == 0:
                self._free_pages.append(page)

    def free(self, seq_id: int) -> None:
        """Let go of every page of `seq_id`; unknown ids are ignored."""
        self.unhold(reversed(self._page_tables.pop(seq_id, [])))
        self._num_tokens.pop(seq_id, None)

    def num_new_pages(self, seq_id: int, num_new_tokens: int) -> int:
        """Pages `seq_id` must take to grow by `num_new_tokens`."""
        return self._num_new_pages(seq_id, num_new_tokens)

    def _num_new_pages(self, seq_id: int, num_new_tokens: int) -> int:
        needed = self.num_pages_for(self.num_tokens(seq_id) + num_new_tokens)
        return max(0, needed - self.num_pages_held(seq_id))
