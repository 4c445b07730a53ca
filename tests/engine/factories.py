"""Small builders shared by the engine tests."""

from __future__ import annotations

import torch

from worker_client.engine.api import ChunkWork, SequenceSpec, StepOutput
from worker_client.engine.batch import PackedBatch
from worker_client.engine.engine import ModelEngine
from worker_client.engine.forward_cache import ForwardCache
from worker_client.engine.kv_cache import PagedKVCache
from worker_client.engine.model import Qwen35ForCausalLM
from worker_client.engine.paged_forward_cache import PagedForwardCache
from worker_client.engine.state_pool import GdnStatePool

# One preset of each model family (dense, MoE, Qwen3-Next): the float64 equivalence tests
# run each. "small" is the dense family again, larger, for benchmarks (and slow in float64).
FAMILY_PRESETS = ("tiny", "tiny-moe", "tiny-next")


def random_prompt(length: int, seed: int, vocab_size: int = 512) -> tuple[int, ...]:
    # Token ids from 2 up: the tiny configs use 1 as EOS.
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(2, vocab_size, (length,), generator=generator).tolist())


def make_engine(
    model: Qwen35ForCausalLM,
    *,
    total_kv_pages: int = 128,
    page_size: int = 4,
    total_gdn_slots: int = 8,
    max_batch_size: int | None = None,
    max_prefill_sequences: int | None = None,
    max_prefill_tokens: int = 8192,
    cache_block_tokens: int = 0,
    total_snapshot_slots: int = 0,
    max_cached_blocks: int | None = None,
    device: str | torch.device | None = None,
) -> ModelEngine:
    """An engine on `device` (default: the model's; the model must be there already)."""
    return ModelEngine(
        model,
        total_kv_pages=total_kv_pages,
        page_size=page_size,
        total_gdn_slots=total_gdn_slots,
        device=model.device if device is None else device,
        max_batch_size=max_batch_size,
        max_prefill_sequences=max_prefill_sequences,
        max_prefill_tokens=max_prefill_tokens,
        cache_block_tokens=cache_block_tokens,
        total_snapshot_slots=total_snapshot_slots,
        max_cached_blocks=max_cached_blocks,
    )


def chunks_for(seq_id: int, spec: SequenceSpec, lengths: list[int]) -> list[ChunkWork]:
    """The prefill chunks of `spec`'s prompt with these lengths (the first carries the spec)."""
    chunks, start = [], 0
    for length in lengths:
        chunks.append(ChunkWork(seq_id, start, length, spec if start == 0 else None))
        start += length
    return chunks


def tokens_of(out: StepOutput, seq_id: int) -> list[int]:
    return [t for s, ids in out.tokens if s == seq_id for t in ids]


def run_to_completion(
    engine: ModelEngine, seq_id: int, spec: SequenceSpec, chunk_lengths: list[int] | None = None
) -> list[int]:
    """Prefill `spec` (one chunk each step), then decode it alone until it finishes."""
    generated = []
    for chunk in chunks_for(seq_id, spec, chunk_lengths or [len(spec.prompt_token_ids)]):
        generated += tokens_of(engine.step([chunk], []), seq_id)
    while seq_id in engine.running_ids():
        generated += tokens_of(engine.step([], [seq_id]), seq_id)
    return generated


class PagedPools:
    """The engine's caches without the engine, to read full logits through the paged path
    (on the model's device)."""

    def __init__(
        self, model: Qwen35ForCausalLM, *, num_pages: int, page_size: int, num_slots: int
    ) -> None:
        config = model.config
        self.kv_cache = PagedKVCache(
            num_layers=config.num_full_attention_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            device=model.device,
            dtype=model.dtype,
        )
        self.state_pool = GdnStatePool(
            num_layers=config.num_linear_attention_layers,
            num_slots=num_slots,
            conv_dim=config.linear_conv_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            device=model.device,
            dtype=model.dtype,
        )

    def forward_cache(
        self, seq_ids: list[int], slots: list[int], positions: torch.Tensor
    ) -> ForwardCache:
        """The cache of rows of equal length at `positions` [B, T], reserving those positions first."""
        return self.packed_cache(seq_ids, slots, PackedBatch.rectangular(positions))

    def packed_cache(
        self, seq_ids: list[int], slots: list[int], batch: PackedBatch
    ) -> ForwardCache:
        for seq_id, length in zip(seq_ids, batch.seq_lens):
            self.kv_cache.append(seq_id, length)
        return PagedForwardCache(self.kv_cache, self.state_pool, seq_ids, slots, batch)
