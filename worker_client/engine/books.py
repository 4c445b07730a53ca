"""The page and prefix-cache books every engine keeps: the reference engine
(engine.ModelEngine) over its KV cache and GDN state pool, the scripted test engine
(worker_client.testing) and the simulator's engine (service.sim.engine) over bare page
tables, with snapshots that are bookkeeping only."""

from __future__ import annotations

from .api import CacheDelta
from .page_tables import PageTables
from .prefix_cache import PrefixCache
from .snapshots import SlotStates


class NoStates:
    """GDN states without tensors: a snapshot is bookkeeping only."""

    def empty_like(self, num_slots: int) -> NoStates:
        return self

    def copy_slot(self, source: NoStates, source_slot: int, slot: int) -> None:
        pass


class CacheBooks:
    """`_pages` and `_cache` (None: no prefix cache) and what an engine reports of them;
    engines inherit it and call `_keep_books` in their constructor."""

    _pages: PageTables
    _cache: PrefixCache | None

    def _keep_books(
        self,
        pages: PageTables,
        *,
        cache_block_tokens: int,
        snapshot_slots: int,
        needs_snapshots: bool,
        max_unused_blocks: int | None = None,
        states: SlotStates | None = None,
    ) -> None:
        """Keep the books of `pages`; `states` (None: NoStates) are what the cache's
        snapshots copy, a GDN state pool in an engine that runs a model."""
        self._pages = pages
        self._cache = (
            None
            if not cache_block_tokens
            else PrefixCache(
                pages,
                NoStates() if states is None else states,
                block_tokens=cache_block_tokens,
                num_snapshot_slots=snapshot_slots,
                needs_snapshots=needs_snapshots,
                max_unused_blocks=max_unused_blocks,
            )
        )

    def _append_pages(self, seq_id: int, num_tokens: int) -> None:
        """`seq_id` grows by `num_tokens` positions, on new pages that unused cached blocks
        give up first (least recently used); the caller checked that kv_free_pages holds them."""
        if self._cache is not None:
            self._cache.reclaim(self._pages.num_new_pages(seq_id, num_tokens))
        self._pages.append(seq_id, num_tokens)

    def _release_books(self, held) -> None:
        """A sequence leaves: its pages go back, its full blocks stay in the cache."""
        self._pages.free(held.seq_id)
        if self._cache is not None:
            self._cache.release(held)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The cache's books and counters (blocks, snapshots), for inspection; None when off."""
        return self._cache

    def kv_free_pages(self) -> int:
        return self._pages.num_free_pages() + self.kv_cached_pages()

    def kv_cached_pages(self) -> int:
        return 0 if self._cache is None else self._cache.num_unused_pages()

    def cache_delta(self, full: bool = False) -> CacheDelta:
        return CacheDelta(reset=full) if self._cache is None else self._cache.delta(full)

    def clear_prefix_cache(self) -> None:
        """Drop every cached block no held sequence uses, with its snapshot."""
        if self._cache is not None:
            self._cache.clear()
