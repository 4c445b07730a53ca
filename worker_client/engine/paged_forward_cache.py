"""The ForwardCache of one engine forward: rows are sequences held by the engine."""

from __future__ import annotations

import torch

from .batch import PackedBatch
from .forward_cache import GdnState
from .kv_cache import PagedKVCache
from .state_pool import GdnStatePool


class PagedForwardCache:
    """Reads and writes the pages and GDN slots of `seq_ids` (one per row of `batch`).

    The batch's positions must already be reserved in `kv_cache` (PagedKVCache.append).
    """

    def __init__(
        self,
        kv_cache: PagedKVCache,
        state_pool: GdnStatePool,
        seq_ids: list[int],
        slots: list[int],
        batch: PackedBatch,
    ) -> None:
        device = batch.positions.device
        self._kv_cache = kv_cache
        self._state_pool = state_pool
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        self._write_slots = kv_cache.slot_indices(seq_ids, batch.row_of_token, batch.positions)
        self._page_tables = kv_cache.page_tables(seq_ids, device)
        self._length = int(batch.positions.max().item()) + 1

    def gdn_state(self, linear_layer: int) -> GdnState | None:
        return self._state_pool.read(linear_layer, self._slots)

    def store_gdn_state(self, linear_layer: int, state: GdnState) -> None:
        self._state_pool.write(linear_layer, self._slots, state)

    def keys_values(
        self, attention_layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._kv_cache.write(attention_layer, self._write_slots, keys, values)
        return self._kv_cache.gather(attention_layer, self._page_tables, self._length)
