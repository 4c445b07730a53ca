"""Small builders for the simulator's tests."""
from __future__ import annotations

from service.sim.engine import SimEngine
from worker_client.engine.api import ChunkWork, SequenceSpec
from common.step_table import StepLoad


class LinearCost:
    """A cost model for tests: 10 ms per step plus 0.1 ms per token row."""

    def __init__(self) -> None:
        self.loads: list[StepLoad] = []

    def step_seconds(self, load: StepLoad) -> float:
        self.loads.append(load)
        return 0.01 + 0.0001 * (load.num_prefill_tokens + load.num_decodes)


def sim_engine(*, total_kv_pages: int = 64, page_size: int = 4, total_gdn_slots: int = 8,
               cost=None) -> SimEngine:
    return SimEngine(cost or LinearCost(), total_kv_pages=total_kv_pages, page_size=page_size,
                     total_gdn_slots=total_gdn_slots)


def first_chunk(seq_id: int, prompt_len: int, chunk_len: int, max_new_tokens: int) -> ChunkWork:
    spec = SequenceSpec(prompt_token_ids=(2,) * prompt_len, max_new_tokens=max_new_tokens)
    return ChunkWork(seq_id, 0, chunk_len, spec)


def chunk(seq_id: int, start: int, length: int) -> ChunkWork:
    return ChunkWork(seq_id, start, length, None)
