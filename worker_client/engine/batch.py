"""Tokens of several sequences packed end to end into one forward pass.

A forward runs on `num_tokens` packed tokens: row (sequence) b contributes
`seq_lens[b]` consecutive tokens, rows in order. Token-wise work (projections,
norms, MLP/MoE) runs on the packed tokens as they are; the work that must stay
per sequence (the GDN recurrence and its conv, attention) sees a padded view
[num_rows, max_len, ...] where row b holds its tokens first and zeros after.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class PackedBatch:
    """Where each packed token sits: its row, its absolute position, its padded slot.

    Immutable once built; every index tensor lives on the positions' device.
    """

    def __init__(self, seq_lens: Sequence[int], positions: torch.Tensor) -> None:
        """`positions` [num_tokens]: the absolute position of every packed token in its sequence."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"every row needs at least one token, got lengths {list(seq_lens)}")
        if positions.dim() != 1 or positions.shape[0] != sum(seq_lens):
            raise ValueError(
                f"positions {tuple(positions.shape)} do not match lengths summing to {sum(seq_lens)}"
            )
        self.seq_lens = tuple(int(n) for n in seq_lens)
        self.positions = positions
        self.num_rows = len(self.seq_lens)
        self.max_len = max(self.seq_lens)
        self.num_tokens = positions.shape[0]
        # Rows of equal length need no padding: the padded view is a reshape.
        self.is_rectangular = min(self.seq_lens) == self.max_len
        device = positions.device
        lengths = torch.tensor(self.seq_lens, dtype=torch.long, device=device)
        self.lengths = lengths
        self.row_of_token = torch.repeat_interleave(
            torch.arange(self.num_rows, device=device), lengths
        )
        row_starts = torch.cumsum(lengths, 0) - lengths
        offsets = torch.arange(self.num_tokens, device=device) - row_starts[self.row_of_token]
        self._padded_index = self.row_of_token * self.max_len + offsets  # [num_tokens]
        self.last_token_index = row_starts + lengths - 1  # [num_rows]
        # Padded positions: a padding slot takes position 0, which every row may attend to
        # (its output is discarded; a position with no visible key would give NaN).
        self.padded_positions = self.pad(positions)

    @classmethod
    def rectangular(cls, positions: torch.Tensor) -> PackedBatch:
        """Rows of equal length from positions [num_rows, seq_len]."""
        num_rows, seq_len = positions.shape
        return cls([seq_len] * num_rows, positions.reshape(-1))

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[num_tokens, ...] -> [num_rows, max_len, ...], zeros after each row's tokens."""
        if self.is_rectangular:
            return packed.reshape(self.num_rows, self.max_len, *packed.shape[1:])
        padded = packed.new_zeros(self.num_rows * self.max_len, *packed.shape[1:])
        padded[self._padded_index] = packed
        return padded.unflatten(0, (self.num_rows, self.max_len))

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[num_rows, max_len, ...] -> [num_tokens, ...], dropping the padding."""
        flat = padded.flatten(0, 1)
        return flat if self.is_rectangular else flat[self._padded_index]

    def row_slices(self) -> list[slice]:
        """Each row's tokens in the packed order."""
        ends = list(itertools.accumulate(self.seq_lens))
        return [slice(end - n, end) for end, n in zip(ends, self.seq_lens)]

    def last_tokens(self, packed: torch.Tensor) -> torch.Tensor:
        """[num_tokens, ...] -> [num_rows, ...]: each row's last token."""
        return packed[self.last_token_index]
