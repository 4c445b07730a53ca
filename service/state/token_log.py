"""PostgreSQL's token log: one row per group commit holds every append it saves.

A row of `token_log` is (id, seq_ids, entries): `seq_ids` the sequences it holds tokens
of (a GIN index finds a sequence's rows), `entries` each append as seq_id (int64),
start (int32), count (int32), then the tokens (uint32), all little-endian. One sequence
is written by one owner at a time, one commit at a time, so its rows' ids rise in the
order its tokens were committed. Rows written before schema 3 (`tokens`, one per
sequence per save) are read too.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from service.core.persist.store import StoreError, TokenAppend
from service.state.rows import pack_token_ids, unpack_token_ids

_HEAD = struct.Struct("<qii")


def pack_entries(appends: Iterable[TokenAppend]) -> bytes:
    return b"".join(
        _HEAD.pack(a.seq_id, a.start, len(a.token_ids)) + pack_token_ids(a.token_ids)
        for a in appends
    )


def unpack_entries(blob: bytes, wanted: set[int]) -> list[tuple[int, int, list[int]]]:
    """(seq_id, start, tokens) of the appends in `blob` of the sequences in `wanted`."""
    out = []
    offset, end = 0, len(blob)
    while offset < end:
        seq_id, start, count = _HEAD.unpack_from(blob, offset)
        offset += _HEAD.size
        if seq_id in wanted:
            out.append((seq_id, start, unpack_token_ids(blob[offset : offset + 4 * count])))
        offset += 4 * count
    return out


class Outputs:
    """Outputs assembled from appends in commit order, from index `start` on."""

    def __init__(self, start: int = 0) -> None:
        self._start = start
        self.tokens: dict[int, list[int]] = {}

    def add(self, seq_id: int, start: int, token_ids: list[int]) -> None:
        out = self.tokens.setdefault(seq_id, [])
        have = self._start + len(out)
        end = start + len(token_ids)
        if end <= have:
            return  # before what is wanted, or a retried commit's copy
        if start > have:
            raise StoreError(
                f"seq_id {seq_id}: tokens from {start} after {have} tokens; the database is damaged"
            )
        out.extend(token_ids[have - start :])
