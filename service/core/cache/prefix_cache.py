"""The workers' prefix caches as the core knows them: each worker's resume points, and
the lookup of a queued sequence's longest one (docs/contract.md, "Prefix caching";
docs/prefix-caching.md, "The scheduler").

Mechanism only: which worker a sequence goes to is not decided here (the worker that
asks gets its own cache's answer); the policies read `DecisionView.cached_tokens`, and
the placement policy (service/core/decide/policies/placement.py) reads where else a prefix is
cached through `FleetCache`, kept in step with every worker's `ResumePoints`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.block_hash import block_hashes
from service.core.types import CacheReport


class FleetCache:
    """Which workers hold each resume point: the union of the workers' `ResumePoints`,
    kept in step by them, so that one walk down a prompt's block hashes finds its longest
    resume point on any worker (O(prompt blocks), whatever the number of workers)."""

    def __init__(self) -> None:
        # Block hash -> the worker ids that report it, in the order they reported it: a
        # dict used as an ordered set, so that placement, which breaks ties between
        # holders by this order, decides alike in every process (a set's order of
        # strings follows the process's hash seed).
        self.owners: dict[int, dict[str, None]] = {}

    def add(self, block_hash: int, worker_id: str) -> None:
        owners = self.owners.get(block_hash)
        if owners is None:
            self.owners[block_hash] = {worker_id: None}
        else:
            owners[worker_id] = None

    def discard(self, block_hash: int, worker_id: str) -> None:
        owners = self.owners.get(block_hash)
        if owners is not None:
            owners.pop(worker_id, None)
            if not owners:
                del self.owners[block_hash]


@dataclass
class ResumePoints:
    """One worker incarnation's resume points (block hashes), from its cache reports.

    A new registration starts a new, empty set (the worker's first report after it is a
    reset); nothing here is saved: a restarted scheduler knows only what is reported
    after its restart, and a point it does not know is simply never used.
    """

    block_tokens: int  # the worker's cache_block_tokens; 0: it keeps no cache
    points: set[int] = field(default_factory=set)
    # The fleet's index these points are part of, under `worker_id` (None: none).
    fleet: FleetCache | None = None
    worker_id: str = ""

    def apply(self, report: CacheReport) -> int:
        """Reset first, then removed, then added: a report applied twice changes nothing
        the second time (each step is a set operation). Returns how many known points the
        report removed (the worker's evictions; 0 for a retried report or a reset)."""
        if not self.block_tokens:
            return 0  # a worker that registered no cache has no hashes we could match
        fleet, points = self.fleet, self.points
        if fleet is None:
            if report.reset:
                points.clear()
            known = len(points)
            points.difference_update(report.removed)
            removed = known - len(points)
            points.update(report.added)
            return removed
        if report.reset:
            self.release()
        removed = 0
        for block_hash in report.removed:
            if block_hash in points:
                points.discard(block_hash)
                fleet.discard(block_hash, self.worker_id)
                removed += 1
        for block_hash in report.added:
            if block_hash not in points:
                points.add(block_hash)
                fleet.add(block_hash, self.worker_id)
        return removed

    def num_after(self, report: CacheReport) -> int:
        """How many points `apply(report)` would leave; changes nothing. O(report)."""
        if not self.block_tokens:
            return 0
        if report.reset:
            return len(set(report.added))
        points = self.points
        gone = points.intersection(report.removed)
        added = set(report.added)
        # Kept, then new ones, then ones removed and added again in the same report.
        return len(points) - len(gone) + len(added - points) + len(added & gone)

    def forget(self, block_hash: int) -> None:
        """A point the worker missed on: never offered again until it reports it again."""
        if block_hash in self.points:
            self.points.discard(block_hash)
            if self.fleet is not None:
                self.fleet.discard(block_hash, self.worker_id)

    def release(self) -> None:
        """Forget every point (a reset, or the worker left), in the fleet's index too."""
        if self.fleet is not None:
            for block_hash in self.points:
                self.fleet.discard(block_hash, self.worker_id)
        self.points.clear()

    def __len__(self) -> int:
        return len(self.points)


@dataclass(slots=True)
class PromptHashes:
    """A sequence's block hashes of its resume prompt (prompt + generated so far), kept
    on the sequence: computed once, extended when it comes back with more tokens."""

    block_tokens: int
    num_tokens: int  # tokens hashed (full blocks of them)
    hashes: list[int]


def prompt_hashes(
    cached: PromptHashes | None,
    token_ids: Callable[[], Sequence[int]],
    num_tokens: int,
    adapter_id: str,
    block_tokens: int,
) -> PromptHashes:
    """The hashes of the first `num_tokens` of `token_ids()` in blocks of `block_tokens`,
    reusing `cached` where it covers them (same block size, a prefix of these tokens:
    a sequence's resume prompt only grows). `token_ids` is called only when something
    is left to hash."""
    if cached is not None and cached.block_tokens == block_tokens:
        if cached.num_tokens == num_tokens:
            return cached
        if cached.num_tokens < num_tokens:
            # Only whole blocks were hashed; the tokens before num_tokens never change.
            start = len(cached.hashes)
            previous = cached.hashes[-1] if cached.hashes else 0
            more = block_hashes(
                token_ids()[:num_tokens],
                adapter_id,
                block_tokens,
                start_block=start,
                previous_hash=previous,
            )
            return PromptHashes(block_tokens, num_tokens, cached.hashes + more)
    return PromptHashes(
        block_tokens, num_tokens, block_hashes(token_ids()[:num_tokens], adapter_id, block_tokens)
    )


def longest_resume(hashes: list[int], num_tokens: int, block_tokens: int, points: set[int]) -> int:
    """Tokens before the longest resume point in `points` strictly below `num_tokens`
    (a first chunk must compute at least one token), walking from the longest: 0 if none.
    O(prompt blocks)."""
    last = min(len(hashes), (num_tokens - 1) // block_tokens)
    for i in range(last - 1, -1, -1):
        if hashes[i] in points:
            return (i + 1) * block_tokens
    return 0


def align_chunk(start: int, length: int, block_tokens: int) -> int:
    """`length` shortened so that a chunk from `start` ends on its last block boundary,
    when one lies inside it (vLLM's align rule: the worker can only snapshot GDN state
    where a forward ends on a block). The prompt's last chunk too: its full blocks then
    get a resume point (a conversation's next turn starts there), and the tokens after
    the last boundary follow in the next step. A chunk that starts inside a block (after
    a chunk the budget cut short) ends at that block's end, so that every boundary a
    prefill crosses gets its snapshot (vLLM runs no other). Unchanged with
    `block_tokens` 0 (no cache) or when no boundary lies inside."""
    if not block_tokens:
        return length
    end = start + length
    if start % block_tokens:
        next_boundary = start - start % block_tokens + block_tokens
        return next_boundary - start if next_boundary < end else length
    aligned = end - end % block_tokens
    return aligned - start if aligned > start else length
