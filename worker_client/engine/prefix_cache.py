"""The engine's prefix cache: which computed blocks a new sequence can start from.

The books (what the scheduler sees through kv_free_pages and kv_cached_pages):
- a sequence registers each full block of `block_tokens` tokens (prompt or generated) as
  soon as its KV is written; where the index has that hash already, the sequence maps the
  index's pages instead of its own (its own go back to the pool at once);
- a block's pages stay taken while the index has it; a block no held sequence uses is
  "unused": its pages count as free, and are reclaimed least recently used first when a
  sequence needs pages (or when more than `max_unused_blocks` are unused);
- with GDN layers, a forward that ends a sequence exactly on a block boundary snapshots
  its GDN slot under that block's hash, in the snapshot pool (LRU, its own size); a
  block's snapshot is dropped with the block;
- a resume point is a cached block with a snapshot (any cached block, for a model
  without GDN layers); resuming maps the blocks' pages and copies the snapshot in.
"""

from __future__ import annotations

from typing import Protocol

from common.block_hash import ROOT_HASH, block_hashes, next_block_hash

from .api import CacheDelta, SequenceSpec
from .block_index import BlockIndex
from .page_tables import PageTables
from .resume_points import ResumePointLog
from .snapshots import SlotStates, SnapshotPool


class CachingSequence(Protocol):
    """What the cache reads of a held sequence (engine.sequence.HeldSequence, or an
    engine's own), and `block_hashes`, which it keeps: the hashes of the leading blocks
    the sequence maps from the index, in order."""

    seq_id: int
    slot: int
    spec: SequenceSpec
    token_ids: list[int]
    block_hashes: list[int]


class PrefixCache:
    """Blocks and snapshots over the engine's KV pages and GDN slots (torch-free: the
    engines without a model keep the same books with it).

    `needs_snapshots`: the model has GDN layers (resume points need a snapshot)."""

    def __init__(
        self,
        kv: PageTables,
        states: SlotStates,
        *,
        block_tokens: int,
        num_snapshot_slots: int,
        needs_snapshots: bool,
        max_unused_blocks: int | None = None,
    ) -> None:
        if block_tokens < 1 or block_tokens % kv.page_size:
            raise ValueError(
                f"cache_block_tokens must be a positive multiple of the page size "
                f"({kv.page_size}), got {block_tokens}"
            )
        self.block_tokens = block_tokens
        self.needs_snapshots = needs_snapshots
        self._kv = kv
        self._pages_per_block = block_tokens // kv.page_size
        self._index = BlockIndex(self._pages_per_block)
        self._snapshots = SnapshotPool(states, num_snapshot_slots if self.needs_snapshots else 0)
        self._max_unused_blocks = max_unused_blocks
        self._log = ResumePointLog()
        # The worker's own hit rate and evictions (lattice-worker prints them at exit; the
        # scheduler serves them live from the reports).
        self.num_resumes = 0  # first chunks started from a resume point
        self.num_resume_misses = 0  # first chunks whose resume point was gone
        self.num_resumed_tokens = 0  # prompt tokens those resumes did not compute
        self.num_evicted_blocks = 0

    def stats_line(self) -> str:
        """The counters in words: resumes, misses, hit rate, evictions."""
        asked = self.num_resumes + self.num_resume_misses
        rate = f"{100.0 * self.num_resumes / asked:.1f}%" if asked else "n/a"
        return (
            f"prefix cache: {self.num_resumes} resumes ({self.num_resumed_tokens} prompt "
            f"tokens not computed), {self.num_resume_misses} misses, hit rate {rate}, "
            f"{self.num_evicted_blocks} blocks evicted, {self.num_cached_blocks()} cached "
            f"and {self.num_snapshots()} snapshots now"
        )

    def num_unused_pages(self) -> int:
        return self._index.num_unused_pages()

    def num_cached_blocks(self) -> int:
        return len(self._index)

    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def resume_points(self) -> list[int]:
        return self._snapshots.hashes() if self.needs_snapshots else self._index.hashes()

    def delta(self, full: bool = False) -> CacheDelta:
        delta = self._log.take()
        if full:
            return CacheDelta(added=tuple(self.resume_points()), reset=True)
        return delta

    def resume(self, held: CachingSequence, num_tokens: int) -> bool:
        """Start `held` (no pages yet) at `num_tokens` (a multiple of block_tokens) from
        the cache: map the blocks' pages and copy the snapshot into its GDN slot; False if
        that resume point is gone (nothing changed)."""
        hashes = block_hashes(held.token_ids[:num_tokens], held.spec.adapter_id, self.block_tokens)
        last = hashes[-1]
        if last not in self._index or (self.needs_snapshots and last not in self._snapshots):
            self.num_resume_misses += 1
            return False
        self.num_resumes += 1
        self.num_resumed_tokens += num_tokens
        # A cached block's ancestors are cached (evictions take whole subtrees).
        pages = [page for h in hashes for page in self._index.use(h)]
        self._kv.map_shared(held.seq_id, pages, num_tokens)
        if self.needs_snapshots:
            self._snapshots.restore(last, held.slot)
        held.block_hashes = hashes
        return True

    def computed(self, held: CachingSequence, num_computed: int) -> None:
        """After a forward that wrote `held`'s KV up to `num_computed` and left its GDN
        slot at the state after token num_computed - 1: register its new full blocks, and
        snapshot the slot if that is a block boundary."""
        b = self.block_tokens
        seq_id, token_ids, adapter_id = held.seq_id, held.token_ids, held.spec.adapter_id
        num_full = num_computed // b
        hashes = held.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            h = next_block_hash(
                ROOT_HASH if parent is None else parent, adapter_id, token_ids[i * b : (i + 1) * b]
            )
            first_page = i * self._pages_per_block
            if h in self._index:  # computed twice: share the index's copy, free ours
                self._kv.replace_pages(seq_id, first_page, self._index.use(h))
            else:
                pages = self._kv.pages_of(seq_id, first_page, self._pages_per_block)
                self._kv.hold(pages)
                self._index.insert(h, parent, pages)
                if not self.needs_snapshots:
                    self._log.add(h)
            hashes.append(h)
        if self.needs_snapshots and num_full and num_computed % b == 0:
            h = hashes[num_full - 1]
            is_new = h not in self._snapshots
            evicted = self._snapshots.take(h, held.slot)
            if evicted is not None:
                self._log.remove(evicted)
            if is_new and h in self._snapshots:
                self._log.add(h)

    def release(self, held: CachingSequence) -> None:
        """The sequence lets go of its blocks (last first: its first block stays the most
        recently used); trims unused blocks beyond the limit."""
        for h in reversed(held.block_hashes):
            self._index.release(h)
        held.block_hashes = []
        if self._max_unused_blocks is not None:
            while self._index.num_unused_blocks() > self._max_unused_blocks:
                self._evict_lru()

    def reclaim(self, num_free_pages: int) -> None:
        """Evict unused blocks, least recently used first, until the KV pool has
        `num_free_pages` free pages or nothing unused is left."""
        while self._kv.num_free_pages() < num_free_pages and self._index.num_unused_blocks():
            self._evict_lru()

    def clear(self) -> None:
        """Evict every unused block (and its snapshot)."""
        while self._index.num_unused_blocks():
            self._evict_lru()

    def _evict_lru(self) -> None:
        for block in self._index.evict_lru():
            self.num_evicted_blocks += 1
            self._kv.unhold(block.pages)
            if not self.needs_snapshots or self._snapshots.drop(block.block_hash):
                self._log.remove(block.block_hash)


def cached_tokens_problem(cached_tokens: int, prompt_len: int, block_tokens: int) -> str | None:
    """Why a first chunk's cached_tokens can name no resume point, or None."""
    if cached_tokens == 0 or block_tokens == 0:  # no cache: a miss, not a mistake
        return None
    if cached_tokens % block_tokens or cached_tokens >= prompt_len:
        return (
            f"cached_tokens {cached_tokens} must be a multiple of the cache block "
            f"({block_tokens} tokens) below the prompt's length ({prompt_len})"
        )
    return None
