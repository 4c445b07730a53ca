"""What a worker registers with: its own description, apart from any wire message."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from worker_client.engine.api import Engine


class WorkerRole(enum.Enum):
    """What a worker runs (docs/disaggregation.md)."""

    BOTH = "both"  # prompts and decodes: today's behaviour, the default
    PREFILL = "prefill"  # prompts only; each sequence is handed off after its first token
    DECODE = "decode"  # decodes only; sequences arrive by handoff


@dataclass(frozen=True)
class WorkerResources:
    """What a worker registers with (worker_client/convert.py makes the request)."""

    worker_id: str
    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    max_batch_size: int = 0
    adapters: tuple[str, ...] = ()
    cache_block_tokens: int = 0  # tokens per prefix-cache block; 0 = no prefix cache
    total_snapshot_slots: int = 0  # GDN snapshots for resume points, besides the GDN slots
    role: WorkerRole = WorkerRole.BOTH
    transfer_bytes_per_second: float = 0.0  # how fast it moves a sequence to a peer; 0: unknown
    handoff_address: str = ""  # HOST:PORT of its handoff channel; empty: it cannot send
    max_step_tokens: int = 0  # most tokens its engine runs in one step; 0 = no limit
    # What one handoff moves: attention KV bytes per token (every attention layer) and
    # the GDN states' bytes (whatever the length); 0: unknown.
    handoff_bytes_per_token: float = 0.0
    handoff_fixed_bytes: float = 0.0

    @classmethod
    def of(
        cls, worker_id: str, engine: Engine, max_batch_size: int = 0, adapters: tuple[str, ...] = ()
    ) -> WorkerResources:
        """What `engine` has, registered as `worker_id`."""
        return cls(
            worker_id,
            engine.total_kv_pages,
            engine.page_size,
            engine.total_gdn_slots,
            max_batch_size,
            adapters,
            engine.cache_block_tokens,
            engine.total_snapshot_slots,
            max_step_tokens=getattr(engine, "max_step_tokens", 0),
        )
