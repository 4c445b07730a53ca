"""What a worker registers with: its own description, apart from any wire message."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerResources:
    """What a worker registers with (worker_client/convert.py makes the request)."""

    worker_id: str
    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    max_batch_size: int = 0
    adapters: tuple[str, ...] = ()
