"""Mooncake's trace format (kvcache-ai/Mooncake, FAST25-release/traces): one JSON object a
line, `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the hashes of the
prompt's blocks of TRACE_BLOCK_TOKENS tokens (equal ids at the same position: the same
prefix up to that block; the last block may be partial).

Reading one with `block_tokens` b scales every prompt to b tokens a trace block
(ceil(input_length * b / 512) tokens, so it keeps its number of blocks) and keeps the
hash ids: the reuse pattern is Mooncake's, the lengths fit a smaller profile. Output
lengths are kept as they are.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

# Tokens per block of the traces' hash ids.
TRACE_BLOCK_TOKENS = 512


def is_mooncake(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def read_rows(path: Path, block_tokens: int, error: type[ValueError]):
    """(prompt_len, output_len, arrived_at seconds, hash_ids) of every line, scaled to
    `block_tokens` a trace block; `error` (a message naming the file and line) for a bad one."""
    if block_tokens < 1:
        raise error(f"--block-tokens must be at least 1, got {block_tokens}")
    opener = gzip.open if path.name.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                input_length = int(raw["input_length"])
                output_length = int(raw["output_length"])
                arrived_at = float(raw["timestamp"]) / 1000.0
                hash_ids = tuple(int(h) for h in raw["hash_ids"])
            except (ValueError, TypeError, KeyError) as err:
                raise error(
                    f"{path}:{line_number}: not a Mooncake trace line "
                    f"(timestamp, input_length, output_length, hash_ids): {err}"
                ) from None
            if input_length < 1 or output_length < 1:
                raise error(
                    f"{path}:{line_number}: input_length and output_length must be at least 1"
                )
            if len(hash_ids) != -(-input_length // TRACE_BLOCK_TOKENS):
                raise error(
                    f"{path}:{line_number}: hash_ids has {len(hash_ids)} blocks for "
                    f"input_length {input_length} (ceil(input_length / "
                    f"{TRACE_BLOCK_TOKENS}) expected)"
                )
            if any(h < 0 for h in hash_ids):
                raise error(f"{path}:{line_number}: hash_ids must not be negative")
            prompt_len = -(-input_length * block_tokens // TRACE_BLOCK_TOKENS)
            rows.append((prompt_len, output_length, arrived_at, hash_ids))
    return rows
