"""The pool of Gated DeltaNet state slots.

One slot per held sequence, taken on admission and returned on evict/finish.
A slot holds, for every linear-attention layer, the causal-conv state and the
recurrent (delta rule) state; these do not grow with the sequence.
"""

from __future__ import annotations

import torch

from .forward_cache import GdnState


class GdnStatePool:
    """Slots of conv state [layers, slots, conv_dim, kernel-1] and recurrent state (at least fp32)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.conv = torch.zeros(
            num_layers, num_slots, conv_dim, conv_kernel - 1, device=device, dtype=dtype
        )
        # The recurrent state accumulates over the whole sequence: kept in fp32 (fp64 for fp64 models).
        self.recurrent = torch.zeros(
            num_layers,
            num_slots,
            num_value_heads,
            key_head_dim,
            value_head_dim,
            device=device,
            dtype=torch.promote_types(dtype, torch.float32),
        )
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest

    def empty_like(self, num_slots: int) -> GdnStatePool:
        """A pool of `num_slots` slots of this pool's shapes, dtypes and device."""
        pool = GdnStatePool.__new__(GdnStatePool)
        pool.conv = self.conv.new_zeros((self.conv.shape[0], num_slots, *self.conv.shape[2:]))
        pool.recurrent = self.recurrent.new_zeros(
            (self.recurrent.shape[0], num_slots, *self.recurrent.shape[2:])
        )
        pool.num_slots = num_slots
        pool._free_slots = list(range(num_slots - 1, -1, -1))
        return pool

    def copy_slot(self, source: GdnStatePool, source_slot: int, slot: int) -> None:
        """Overwrite slot `slot`, every layer, with `source`'s slot `source_slot`."""
        self.conv[:, slot] = source.conv[:, source_slot]
        self.recurrent[:, slot] = source.recurrent[:, source_slot]

    @staticmethod
    def bytes_per_slot(
        num_layers: int,
        conv_dim: int,
        conv_kernel: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Device memory of one slot across all linear-attention layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        recurrent_itemsize = torch.empty(
            (), dtype=torch.promote_types(dtype, torch.float32)
        ).element_size()
        conv = conv_dim * (conv_kernel - 1) * itemsize
        recurrent = num_value_heads * key_head_dim * value_head_dim * recurrent_itemsize
        return num_layers * (conv + recurrent)

    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def acquire(self) -> int | None:
        """A zeroed slot (the state before token 0), or None when all are taken."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def read(self, layer: int, slots: torch.Tensor) -> GdnState:
        """The state of `slots` [B] in `layer` (a copy)."""
        return GdnState(conv=self.conv[layer, slots], recurrent=self.recurrent[layer, slots])

    def write(self, layer: int, slots: torch.Tensor, state: GdnState) -> None:
        self.conv[layer, slots] = state.conv.to(self.conv.dtype)
        self.recurrent[layer, slots] = state.recurrent.to(self.recurrent.dtype)
