"""The page and prefix-cache books of an engine that runs no model: the scripted test
engine (worker_client.testing) and the simulator's engine (service.sim.engine) keep
ModelEngine's books exactly, with snapshots that are bookkeeping only."""
from __future__ import annotations

from .api import CacheDelta
from .page_tables import PageTables
from .prefix_cache import PrefixCache


class NoStates:
    """GDN states without tensors: a snapshot is bookkeeping only."""

    def empty_like(self, num_slots: int) -> NoStates:
        return self

    def copy_slot(self, source: NoStates, source_slot: int, slot: int) -> None:
        pass


class CacheBooks:
    """`_pages` and `_cache` (None: no prefix cache) and what an engine reports of them;
    engines without a model inherit it and call `_keep_books` in their constructor."""

    _pages: PageTables
    _cache: PrefixCache | None

    def _keep_books(self, *, total_kv_pages: int, page_size: int, cache_block_tokens: int,
                    snapshot_slots: int, needs_snapshots: bool,
                    max_unused_blocks: int | None = None) -> None:
        self._pages = PageTables(num_pages=total_kv_pages, page_size=page_size)
        self._cache = None if not cache_block_tokens else PrefixCache(
            self._pages, NoStates(), block_tokens=cache_block_tokens,
            num_snapshot_slots=snapshot_slots, needs_snapshots=needs_snapshots,
            max_unused_blocks=max_unused_blocks)

    def _release_books(self, held) -> None:
        """A sequence leaves: its pages go back, its full blocks stay in the cache."""
        self._pages.free(held.seq_id)
        if self._cache is not None:
            self._cache.release(held)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The cache's books and counters (as ModelEngine.prefix_cache); None when off."""
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
