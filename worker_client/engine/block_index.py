"""The prefix cache's index: full blocks by chained hash, their KV pages, users and LRU.

A block is `pages_per_block` KV pages holding the tokens of one full block of some
sequence, under its chained hash (common/block_hash.py). Its `num_users` counts the held
sequences whose page tables map those pages; a block no held sequence uses is "unused":
its pages count as free (the engine reclaims them on demand) and it sits in the LRU.

Invariant (kept by the engine, which registers a sequence's blocks in order and maps the
index's pages for every block the index has): a sequence that uses block i also uses the
blocks 0..i-1 before it. So an unused block's descendants are unused too, and evicting a
block with its whole subtree never takes pages from under a sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CachedBlock:
    """One cached block: its pages, its parent (None for block 0) and children."""

    pages: tuple[int, ...]
    parent: int | None
    num_users: int = 0
    children: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class EvictedBlock:
    """A block taken out of the index; the caller drops the index's hold on its pages."""

    block_hash: int
    pages: tuple[int, ...]


class BlockIndex:
    """Blocks by hash with user counts; unused blocks in least-recently-used order."""

    def __init__(self, pages_per_block: int) -> None:
        self.pages_per_block = pages_per_block
        self._blocks: dict[int, CachedBlock] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # LRU first

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[int]:
        return list(self._blocks)

    def pages(self, block_hash: int) -> tuple[int, ...]:
        return self._blocks[block_hash].pages

    def num_unused_blocks(self) -> int:
        return len(self._unused)

    def num_unused_pages(self) -> int:
        return len(self._unused) * self.pages_per_block

    def insert(self, block_hash: int, parent: int | None, pages: tuple[int, ...]) -> None:
        """A new block, used by the sequence that computed it (num_users 1)."""
        if block_hash in self._blocks:
            raise KeyError(f"block {block_hash:#x} is cached already")
        self._blocks[block_hash] = CachedBlock(pages, parent, num_users=1)
        if parent is not None:
            self._blocks[parent].children.add(block_hash)

    def use(self, block_hash: int) -> tuple[int, ...]:
        """One more user of a cached block; its pages."""
        block = self._blocks[block_hash]
        if block.num_users == 0:
            del self._unused[block_hash]
        block.num_users += 1
        return block.pages

    def release(self, block_hash: int) -> None:
        """One user fewer; at none, the block becomes the most recently used unused one."""
        block = self._blocks[block_hash]
        block.num_users -= 1
        if block.num_users == 0:
            self._unused[block_hash] = None

    def evict_lru(self) -> list[EvictedBlock]:
        """Take the least recently used unused block out, with its subtree; [] if none."""
        if not self._unused:
            return []
        block_hash = next(iter(self._unused))
        parent = self._blocks[block_hash].parent
        if parent is not None:
            self._blocks[parent].children.discard(block_hash)
        evicted, todo = [], [block_hash]
        while todo:
            h = todo.pop()
            block = self._blocks.pop(h)
            if block.num_users:
                raise RuntimeError(f"block {h:#x} evicted while {block.num_users} sequences use it")
            self._unused.pop(h, None)
            todo.extend(block.children)
            evicted.append(EvictedBlock(h, block.pages))
        return evicted
