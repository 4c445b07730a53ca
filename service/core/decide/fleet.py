"""What one decision sees of the rest of the fleet: where a queued sequence's prefix is
cached (on the asking worker and on the others) and how loaded each worker is.

Mechanism only: the batcher builds a `FleetView` for a worker that keeps a prefix cache
(with --prefix-caching on), and the placement policy (service/core/decide/policies/placement.py)
decides with it. Built in O(workers) per decision; a lookup is one walk down the
sequence's block hashes over the fleet's index (O(prompt blocks)), memoized per decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.core.cache.prefix_cache import FleetCache, prompt_hashes
from service.core.tables.ledger import WorkerRecord
from service.core.tables.sequences import Sequence


@dataclass(frozen=True, slots=True)
class CacheSpread:
    """Where a sequence's prefix is cached, in prompt tokens (0: nowhere)."""

    # Its longest resume point on the asking worker (DecisionView.cached_tokens).
    own_tokens: int
    # Its longest one on another worker that admits now and can run it (as long as
    # own_tokens: a tie; 0 when the asker's is longer).
    best_other_tokens: int
    # Whether one of the workers holding that best other point has room now.
    best_other_has_room: bool
    # How many other workers hold that point, and the least load (sequences assigned)
    # of those of them with room (None: none has room).
    best_other_holders: int = 0
    best_other_least_load: int | None = None
    # The holder a sequence would wait for: the least loaded of those with room, else
    # the least loaded of all (None: no other holds it).
    best_other_holder: str | None = None


COLD = CacheSpread(0, 0, False)


def has_room(worker: WorkerRecord) -> bool:
    """Whether `worker` could admit one more sequence at its next call, as far as its
    last report tells: batch places and a free GDN slot."""
    return len(worker.assigned) < worker.settings.max_batch_size and worker.gdn_free_slots > 0


def sequence_hashes(seq: Sequence, block_tokens: int) -> list[int]:
    """The block hashes of `seq`'s resume prompt, kept on the sequence (computed once,
    extended when it comes back with more tokens)."""
    seq.prompt_hashes = prompt_hashes(
        seq.prompt_hashes, seq.resume_token_ids, seq.num_tokens(), seq.adapter_id, block_tokens
    )
    return seq.prompt_hashes.hashes


class FleetView:
    """The fleet as the decision for `worker` sees it (read-only to the policy)."""

    def __init__(
        self,
        worker: WorkerRecord,
        workers: Iterable[WorkerRecord],
        fleet_cache: FleetCache,
        num_queued: int,
        now: float,
    ) -> None:
        self.worker_id = worker.worker_id
        self.block_tokens = worker.resume_points.block_tokens
        self._own_points = worker.resume_points.points
        self._own_call_gaps = worker.call_gaps
        self._owners = fleet_cache.owners
        # The other workers that admit now (expired leases were dropped before the call).
        self._peers = {w.worker_id: w for w in workers if w is not worker and w.admitting}
        # Sequences assigned to each worker: the load the placement balances.
        self.own_load = len(worker.assigned)
        self.total_load = self.own_load + sum(len(w.assigned) for w in self._peers.values())
        self.num_workers = 1 + len(self._peers)
        self.num_queued = num_queued
        self.now = now
        self._found: dict[int, CacheSpread] = {}
        self._least_loaded: dict[str, str | None] = {}  # by adapter_id, for this decision
        self._backlog: dict[str, int] = {}

    def waited_seconds(self, seq: Sequence) -> float:
        """How long `seq` has been queued this time (since it last entered the queue)."""
        return max(0.0, self.now - seq.enqueued_at)

    def load(self, worker_id: str) -> int:
        """Sequences assigned to the peer `worker_id`."""
        return len(self._peers[worker_id].assigned)

    def called_since_queued(self, worker_id: str, seq: Sequence) -> bool:
        """Whether the peer `worker_id` has called since `seq` last entered the queue
        (so it had `seq` to take or leave)."""
        last = self._peers[worker_id].call_gaps.last_call_at
        return last is not None and last > seq.enqueued_at

    def call_gap_seconds(self, worker_id: str) -> float:
        """How long the peer `worker_id` may take to call again while busy (its measured
        gaps between calls: CallGaps.bound_seconds; 0 until measured)."""
        return self._peers[worker_id].call_gaps.bound_seconds()

    @property
    def own_mean_call_gap_seconds(self) -> float:
        """The asking worker's own mean gap between calls while busy (0 until measured)."""
        return self._own_call_gaps.mean_seconds

    def mean_call_gap_seconds(self, worker_id: str) -> float:
        """The peer `worker_id`'s mean gap between calls while busy (CallGaps; 0 until
        measured)."""
        return self._peers[worker_id].call_gaps.mean_seconds

    def backlog_tokens(self, worker_id: str) -> int:
        """Prompt tokens the peer `worker_id` has still to be handed (its assigned
        sequences' prompts past their cursors): prefill it runs before, or beside, any
        admission. O(its assigned sequences), memoized for this decision."""
        known = self._backlog.get(worker_id)
        if known is None:
            known = self._backlog[worker_id] = sum(
                max(0, seq.spec_prompt_len() - seq.cursor)
                for seq in self._peers[worker_id].assigned.values()
            )
        return known

    def least_loaded_peer(self, adapter_id: str) -> str | None:
        """Another admitting worker with room that can run `adapter_id`, with the least
        load; None: there is none. One pass over the peers per adapter and decision (the
        fleet does not change within one)."""
        if adapter_id in self._least_loaded:
            return self._least_loaded[adapter_id]
        best, best_load = None, None
        for worker_id, peer in self._peers.items():
            if (not adapter_id or peer.can_run(adapter_id)) and has_room(peer):
                load = len(peer.assigned)
                if best_load is None or load < best_load:
                    best, best_load = worker_id, load
        self._least_loaded[adapter_id] = best
        return best

    def least_peer_load(self, adapter_id: str) -> int | None:
        """The least load of another admitting worker with room that can run
        `adapter_id`; None: there is none."""
        best = self.least_loaded_peer(adapter_id)
        return None if best is None else len(self._peers[best].assigned)

    def spread(self, seq: Sequence) -> CacheSpread:
        """Where `seq`'s prefix is cached: one walk from its longest block strictly below
        its length (a first chunk computes at least one token) down to the first one the
        asking worker holds; memoized for this decision."""
        known = self._found.get(seq.seq_id)
        if known is not None:
            return known
        spread = COLD
        if self._owners and seq.may_use_prefix_cache():
            spread = self._walk(seq)
        self._found[seq.seq_id] = spread
        return spread

    def _walk(self, seq: Sequence) -> CacheSpread:
        block_tokens, owners_of, own_id = self.block_tokens, self._owners, self.worker_id
        hashes = sequence_hashes(seq, block_tokens)
        for i in range(min(len(hashes), (seq.num_tokens() - 1) // block_tokens) - 1, -1, -1):
            owners = owners_of.get(hashes[i])
            if owners is None:
                continue
            holders, least_load, holder, any_load, any_holder = 0, None, None, None, None
            for worker_id in owners:
                peer = self._peers.get(worker_id)
                if (
                    peer is not None
                    and peer.resume_points.block_tokens == block_tokens
                    and peer.can_run(seq.adapter_id)
                ):
                    holders += 1
                    load = len(peer.assigned)
                    if any_load is None or load < any_load:
                        any_load, any_holder = load, worker_id
                    if has_room(peer) and (least_load is None or load < least_load):
                        least_load, holder = load, worker_id
            tokens = (i + 1) * block_tokens
            room = least_load is not None
            if own_id in owners:
                # The asker's longest point; another worker's too (a tie) or not.
                return CacheSpread(
                    tokens,
                    tokens if holders else 0,
                    room,
                    holders,
                    least_load,
                    holder or any_holder,
                )
            if holders:
                # The best other point is this one; the asker's own, if any, lies below.
                own, own_points = 0, self._own_points
                for j in range(i - 1, -1, -1):
                    if hashes[j] in own_points:
                        own = (j + 1) * block_tokens
                        break
                return CacheSpread(own, tokens, room, holders, least_load, holder or any_holder)
        return COLD
