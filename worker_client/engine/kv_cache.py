"""The paged KV cache of the full-attention layers.

A fixed pool of pages of `page_size` tokens. Page p holds the same token
positions in every full-attention layer, so one page table per sequence covers
all layers and "a page" is counted once, whatever the number of layers.
Pages are taken on demand as a sequence grows and returned when it is freed.

The books (free list, tables, pages shared by count) live in page_tables.PageTables.
"""

from __future__ import annotations

import torch

from .page_tables import PageTables


class PagedKVCache(PageTables):
    """Page pool, page tables and the K/V tensors [layers, pages, page_size, kv_heads, head_dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        super().__init__(num_pages=num_pages, page_size=page_size)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Device memory of one page across all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    def slot_indices(
        self, seq_ids: list[int], rows: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat indices (page * page_size + offset) of reserved `positions` [N]; token i belongs to seq_ids[rows[i]]."""
        tables = self.page_tables(seq_ids, positions.device)
        pages = tables[rows, positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def page_tables(self, seq_ids: list[int], device: torch.device) -> torch.Tensor:
        """Page tables [B, max pages], padded with page 0 (padding is masked by position)."""
        width = max(len(self._page_tables[s]) for s in seq_ids)
        rows = [self._page_tables[s] + [0] * (width - len(self._page_tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store keys/values [N, H, D] at flat `slots` [N] of `layer`."""
        flat_shape = (-1, *self.keys.shape[-2:])
        self.keys[layer].view(flat_shape)[slots] = keys.to(self.keys.dtype)
        self.values[layer].view(flat_shape)[slots] = values.to(self.values.dtype)

    def gather(
        self, layer: int, tables: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, length, H, D] of positions [0, length) through page `tables` [B, P]."""
        keys = self.keys[layer][tables].flatten(1, 2)[:, :length]
        values = self.values[layer][tables].flatten(1, 2)[:, :length]
        return keys, values
