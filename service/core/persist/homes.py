"""Where a conversation's prefix is cached, across replicas: prefix keys.

A sequence that finishes on a replica leaves its tokens (prompt and output) in the cache
of that replica's worker, so the next turn of its conversation, whose prompt starts with
those tokens, is best run there. A key names a prefix: a digest of the first k x
HOME_BLOCK_TOKENS tokens. The replica where a sequence finished publishes the key of its
whole text (`finished_key`); a new prompt is looked up by the keys of all its prefixes
(`prompt_keys`, deepest first), and the deepest one published names its home replica.
Claims then prefer what is homed on the claiming replica (service/state/postgres.py
`claim`, bounded by `--replica-affinity-ms`).

A later shared pricing rule (issue 32: affinity only where the hit pays against waiting)
fits here: whether a claim should wait for a home at all, from the matched depth in
tokens and the home replica's load; the store only carries out the preference.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HOME_BLOCK_TOKENS = 16  # tokens per key step (a worker's smallest cache block here)
MAX_PROMPT_KEYS = 256  # the deepest prefixes looked up (4,096 tokens back from the end)


def _key(digest: hashlib._Hash) -> int:
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def prompt_keys(token_ids: Sequence[int]) -> list[int]:
    """Keys of every prefix of `token_ids` that ends on a block boundary, deepest first
    (at most MAX_PROMPT_KEYS)."""
    digest = hashlib.md5(usedforsecurity=False)
    keys = []
    num_blocks = len(token_ids) // HOME_BLOCK_TOKENS
    for block in range(num_blocks):
        start = block * HOME_BLOCK_TOKENS
        digest.update(_pack(token_ids[start : start + HOME_BLOCK_TOKENS]))
        if num_blocks - block <= MAX_PROMPT_KEYS:
            keys.append(_key(digest))
    keys.reverse()
    return keys


def finished_key(prompt: Sequence[int], output: Sequence[int]) -> int | None:
    """The key of a finished sequence's whole text, to its last block boundary (None:
    shorter than one block)."""
    tokens = [*prompt, *output]
    num_tokens = len(tokens) // HOME_BLOCK_TOKENS * HOME_BLOCK_TOKENS
    if not num_tokens:
        return None
    return _key(hashlib.md5(_pack(tokens[:num_tokens]), usedforsecurity=False))


def _pack(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
