"""Small builders for the simulator's tests."""

from __future__ import annotations

from common.step_table import StepLoad
from service.sim.engine import SimEngine
from worker_client.engine.api import ChunkWork, SequenceSpec


class LinearCost:
    """A cost model for tests: 10 ms per step plus 0.1 ms per token row."""

    def __init__(self) -> None:
        self.loads: list[StepLoad] = []

    def step_seconds(self, load: StepLoad) -> float:
        self.loads.append(load)
        return 0.01 + 0.0001 * (load.num_prefill_tokens + load.num_decodes)


def sim_engine(
    *,
    total_kv_pages: int = 64,
    page_size: int = 4,
    total_gdn_slots: int = 8,
    cost=None,
    cache_block_tokens: int = 0,
    snapshot_slots: int | None = None,
) -> SimEngine:
    return SimEngine(
        cost or LinearCost(),
        total_kv_pages=total_kv_pages,
        page_size=page_size,
        total_gdn_slots=total_gdn_slots,
        cache_block_tokens=cache_block_tokens,
        snapshot_slots=snapshot_slots,
    )


def first_chunk(seq_id: int, prompt_len: int, chunk_len: int, max_new_tokens: int) -> ChunkWork:
    spec = SequenceSpec(prompt_token_ids=(2,) * prompt_len, max_new_tokens=max_new_tokens)
    return ChunkWork(seq_id, 0, chunk_len, spec)


def prompt(*blocks: int, block_tokens: int) -> tuple[int, ...]:
    """A prompt of whole blocks, block `b` being `block_tokens` tokens of id 10 + b: prompts
    that share leading block numbers share that prefix."""
    return tuple(10 + b for b in blocks for _ in range(block_tokens))


def cached_chunk(
    seq_id: int,
    token_ids: tuple[int, ...],
    cached_tokens: int,
    chunk_len: int,
    max_new_tokens: int = 2,
) -> ChunkWork:
    """A first chunk of `token_ids` from the resume point at `cached_tokens` (0: none)."""
    return ChunkWork(
        seq_id, cached_tokens, chunk_len, SequenceSpec(token_ids, max_new_tokens), cached_tokens
    )


def chunk(seq_id: int, start: int, length: int) -> ChunkWork:
    return ChunkWork(seq_id, start, length, None)
