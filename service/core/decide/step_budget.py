"""What one worker iteration may still take: the capacity questions, asked in pairs.

Mechanism only: a policy sets the limits (`Policy.budget`), spends them while it plans
(`fits_*` / `take_*`), and the mechanism charges the finished plan to a fresh budget
to check it (service/core/decide/plan_check.py, service/core/decide/batcher.py): the decodes in one
sum, the rest one by one. Nothing here reads the config.

KV pages follow the reference engine's accounting: a sequence holds
ceil(positions / page_size) pages; a prefill chunk adds its tokens' positions; a decode
adds one position, the KV of the sequence's last token (so a running sequence of
n tokens holds n - 1 positions before its next decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.vocabulary import BlockReason, SequenceView


def pages_for(num_positions: int, page_size: int) -> int:
    """Pages that hold `num_positions` KV positions."""
    return -(-num_positions // page_size)


def decode_pages(seq: SequenceView, page_size: int) -> int:
    """New pages one decode of a running `seq` needs: 1 when the position it writes
    (its token count - 1) starts a page, else 0."""
    return 0 if (seq.num_tokens() - 1) % page_size else 1


def held_pages(seq: SequenceView, page_size: int, running: bool) -> int:
    """Pages a sequence of the worker holds, as far as the scheduler knows."""
    positions = seq.num_tokens() - 1 if running else seq.cursor
    return pages_for(max(0, positions), page_size)


@dataclass
class StepBudget:
    """Limits of one iteration; each `take_*` spends, each `fits_*` asks first.

    `tokens` None: no token budget (fifo). `kv_pages` None: pages are the worker's
    business (fifo); otherwise the pages free for this iteration's growth after the
    watermark, which may start below zero (then nothing that needs a page fits).
    """

    new_seqs: int
    gdn_slots: int
    decision_bytes: int
    page_size: int
    # Why new_seqs is what it is, for when it runs out (batch full, draining, reserve).
    new_seqs_reason: BlockReason = BlockReason.BATCH_FULL
    tokens: int | None = None
    kv_pages: int | None = None
    max_loras: int = 0  # 0: no limit
    adapters: set[str] = field(default_factory=set)
    kv_pages_taken: int = 0

    # Decodes and preemptions.

    def take_decodes(self, num_decodes: int, new_pages: int) -> None:
        """`num_decodes` decodes, which need `new_pages` new pages together."""
        if self.tokens is not None:
            self.tokens -= num_decodes
        if new_pages:
            self._take_pages(new_pages)

    def give_back(self, num_pages: int) -> None:
        """Pages a preempted sequence frees before the step."""
        if self.kv_pages is not None:
            self.kv_pages += num_pages

    # Prefill chunks.

    def chunk_pages(self, start: int, length: int) -> int:
        return pages_for(start + length, self.page_size) - pages_for(start, self.page_size)

    def max_chunk(self, start: int, wanted: int) -> int:
        """The longest chunk from prompt position `start`, up to `wanted` tokens, that
        the token budget and the free pages allow."""
        length = wanted if self.tokens is None else min(wanted, self.tokens)
        if self.kv_pages is not None:
            room = pages_for(start, self.page_size) * self.page_size - start
            length = min(length, room + max(0, self.kv_pages) * self.page_size)
        return max(0, length)

    def take_chunk(self, start: int, length: int) -> None:
        if self.tokens is not None:
            self.tokens -= length
        self._take_pages(self.chunk_pages(start, length))

    # Admissions.

    def admission_blocker(
        self, seq: SequenceView, chunk_len: int, cached_tokens: int = 0
    ) -> BlockReason | None:
        """What keeps `seq` from being admitted with a first chunk of `chunk_len` after
        `cached_tokens` from the worker's cache; None if it fits. A LoRA limit is not a
        blocker: check `fits_adapter`.

        Only `chunk_len` counts against the token budget. The cached tokens' pages count
        as taken: the worker counts unused cache pages as free, and the sequence maps
        them (pages another running sequence maps already were not free: over-counted,
        which is safe)."""
        if self.new_seqs <= 0:
            return self.new_seqs_reason
        if self.gdn_slots <= 0:
            return BlockReason.GDN_SLOTS
        if self.tokens is not None and chunk_len > self.tokens:
            return BlockReason.TOKEN_BUDGET
        pages = self.chunk_pages(0, cached_tokens + chunk_len)
        if self.kv_pages is not None and pages > 0 and pages > self.kv_pages:
            return BlockReason.KV_RESERVE
        if seq.spec_wire_bytes() > self.decision_bytes:
            return BlockReason.MESSAGE_SIZE
        return None

    def fits_adapter(self, adapter_id: str) -> bool:
        return (
            not adapter_id
            or not self.max_loras
            or adapter_id in self.adapters
            or len(self.adapters) < self.max_loras
        )

    def take_admission(self, seq: SequenceView, chunk_len: int, cached_tokens: int = 0) -> None:
        self.new_seqs -= 1
        self.gdn_slots -= 1
        self.decision_bytes -= seq.spec_wire_bytes()
        if seq.adapter_id:
            self.adapters.add(seq.adapter_id)
        if self.tokens is not None:
            self.tokens -= chunk_len  # computed tokens only
        self._take_pages(self.chunk_pages(0, cached_tokens + chunk_len))

    # Checking.

    def overdrawn(self, pages_may_overdraw: bool = False) -> str | None:
        """Which limit was overspent, in words; None if none was."""
        if self.new_seqs < 0:
            return "more admissions than the batch allows"
        if self.gdn_slots < 0:
            return "more admissions than free GDN slots"
        if self.decision_bytes < 0:
            return "a decision larger than the message limit"
        if self.tokens is not None and self.tokens < 0:
            return f"the token budget overspent by {-self.tokens}"
        if (
            self.kv_pages is not None
            and self.kv_pages < 0
            and self.kv_pages_taken > 0
            and not pages_may_overdraw
        ):
            return f"{-self.kv_pages} KV pages more than are free"
        if self.max_loras and len(self.adapters) > self.max_loras:
            return f"{len(self.adapters)} adapters where max_loras is {self.max_loras}"
        return None

    def _take_pages(self, num_pages: int) -> None:
        if self.kv_pages is not None and num_pages:
            self.kv_pages -= num_pages
            self.kv_pages_taken += num_pages
