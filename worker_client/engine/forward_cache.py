"""How one forward pass reads and writes per-sequence state.

The model never owns state: each forward gets a `ForwardCache` whose rows are
the rows of its PackedBatch. `NoCache` runs whole sequences from token 0 and
keeps nothing (the reference path); the engine's `PagedForwardCache` reads and
writes the paged KV cache and the GDN state pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .batch import PackedBatch


@dataclass(frozen=True)
class GdnState:
    """The state of one Gated DeltaNet layer for the rows of a batch."""

    conv: torch.Tensor  # [B, conv_dim, kernel - 1], the last inputs of the causal conv
    recurrent: torch.Tensor  # [B, num_value_heads, key_head_dim, value_head_dim], at least fp32


class ForwardCache(Protocol):
    """Per-layer state of the rows of one forward pass."""

    def gdn_state(self, linear_layer: int) -> GdnState | None:
        """The state before this step's tokens; None when every row starts at token 0."""
        ...

    def store_gdn_state(self, linear_layer: int, state: GdnState) -> None:
        """Keep the state after this step's tokens."""
        ...

    def keys_values(
        self, attention_layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's packed keys/values [num_tokens, Hkv, D]; return those of positions [0, L).

        Row b of the result [B, L, Hkv, D] holds position j at index j, for every
        position up to the row's last query; indices past that may hold anything
        (the attention masks key j > query position).
        """
        ...


class NoCache:
    """A forward over whole sequences from position 0 that keeps no state."""

    def __init__(self, batch: PackedBatch) -> None:
        self._batch = batch

    def gdn_state(self, linear_layer: int) -> GdnState | None:
        return None

    def store_gdn_state(self, linear_layer: int, state: GdnState) -> None:
        pass

    def keys_values(
        self, attention_layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch.pad(keys), self._batch.pad(values)
