"""The chained block hash of the prefix cache (a wire contract): one function for
the scheduler, the worker and the simulator.

Block i of a sequence is its tokens [i*b, (i+1)*b); only full blocks have a hash.
h_i = H(h_{i-1}, adapter_id, tokens of block i) with h_{-1} = 0, where H is BLAKE2b
(digest size 8) over h_{i-1} as 8 bytes little-endian, the adapter id's UTF-8 bytes
preceded by their length as 4 bytes little-endian, and the block's token ids as 4-byte
little-endian integers; the digest is read as a little-endian uint64.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "block_hashes", "next_block_hash"]

# h_{-1}: the hash "before" block 0.
ROOT_HASH = 0


def _adapter_bytes(adapter_id: str) -> bytes:
    encoded = adapter_id.encode("utf-8")
    return struct.pack("<I", len(encoded)) + encoded


def next_block_hash(previous_hash: int, adapter_id: str, block_token_ids: Sequence[int]) -> int:
    """h_i from h_{i-1} and block i's token ids (any length; callers pass full blocks)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<Q", previous_hash))
    digest.update(_adapter_bytes(adapter_id))
    digest.update(struct.pack(f"<{len(block_token_ids)}I", *block_token_ids))
    return int.from_bytes(digest.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    adapter_id: str,
    block_tokens: int,
    *,
    start_block: int = 0,
    previous_hash: int = ROOT_HASH,
) -> list[int]:
    """The hashes of the full blocks of `token_ids`, h_0 first.

    With `start_block` k and `previous_hash` h_{k-1} (as computed before), only h_k
    onwards are computed and returned: how a growing sequence extends its list.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    adapter = _adapter_bytes(adapter_id)
    hashes = []
    h = previous_hash
    for first in range(start_block * block_tokens, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[first : first + block_tokens]
        digest = hashlib.blake2b(struct.pack("<Q", h), digest_size=8)
        digest.update(adapter)
        digest.update(struct.pack(f"<{block_tokens}I", *block))
        h = int.from_bytes(digest.digest(), "little")
        hashes.append(h)
    return hashes
