"""What a vLLM worker is started with (`lattice-worker --engine vllm` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmSettings:
    """vLLM's engine settings the adapter passes through; None takes vLLM's default."""

    model: str  # a Hugging Face checkpoint directory
    dtype: str = "auto"  # vLLM's: auto, bfloat16, float16, float32 (its CPU GDN kernel: bf16)
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None  # the KV pool's bytes (else the fraction below)
    gpu_memory_utilization: float | None = None
    num_blocks: int | None = None  # the pool's blocks, overriding the two above (tests)
    block_size: int | None = None  # tokens per block (with prefix caching vLLM picks it)
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    enforce_eager: bool = True  # False: CUDA graphs
    max_num_seqs: int = 64  # sequences at once: the GDN slots the worker registers
    max_num_batched_tokens: int = 8192  # the most tokens one step may run
    seed: int = 0
