"""How many KV pages and GDN slots a device holds, and the check that requested pools fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import ModelDoesNotFit
from .kv_cache import PagedKVCache
from .model import Qwen35ForCausalLM
from .state_pool import GdnStatePool

DEFAULT_PAGE_SIZE = 16
_GIB = 1 << 30
# CPU defaults: a modest reference setup, not a serving configuration.
_CPU_NUM_GDN_SLOTS = 8
_CPU_MAX_TOKENS_PER_SEQUENCE = 4096
_CPU_BUDGET_BYTES = 1 * _GIB
# CUDA: leave room for activations, logits and the allocator's fragmentation.
_CUDA_RESERVED_BYTES = 2 * _GIB
_CUDA_USABLE_FRACTION = 0.9
_CUDA_MAX_GDN_SLOTS = 256
_CUDA_GDN_SHARE = 0.25
# With a prefix cache: GDN snapshots (resume points) get a share of their own.
_CPU_SNAPSHOTS_PER_GDN_SLOT = 4
_CUDA_SNAPSHOT_SHARE = 0.10
_CUDA_MAX_SNAPSHOT_SLOTS = 4096
DEFAULT_CACHE_BLOCK_PAGES = 4  # tokens per cache block: this many pages


@dataclass(frozen=True)
class PoolSizes:
    """The engine's pools: KV pages of `page_size` tokens and GDN state slots."""

    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    total_snapshot_slots: int = 0  # GDN snapshots of the prefix cache, sized as GDN slots


def kv_page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    return PagedKVCache.bytes_per_page(
        config.num_full_attention_layers,
        page_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
    )


def gdn_slot_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return GdnStatePool.bytes_per_slot(
        config.num_linear_attention_layers,
        config.linear_conv_dim,
        config.linear_conv_kernel_dim,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        dtype,
    )


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Device memory of the model's weights in `dtype`, every expert of every MoE block included."""
    return num_parameters(config) * torch.empty((), dtype=dtype).element_size()


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the model `config` describes (tied embeddings counted once)."""
    with torch.device("meta"):
        model = Qwen35ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def pool_bytes(config: ModelConfig, sizes: PoolSizes, dtype: torch.dtype) -> int:
    return sizes.total_kv_pages * kv_page_bytes(config, sizes.page_size, dtype) + (
        sizes.total_gdn_slots + sizes.total_snapshot_slots
    ) * gdn_slot_bytes(config, dtype)


def available_bytes(device: torch.device) -> int:
    """Free memory on `device` now: CUDA free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * _GIB  # no /proc: assume a small host


def default_pool_sizes(
    config: ModelConfig,
    device: str | torch.device,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    dtype: torch.dtype | None = None,
    weights_on_device: bool = True,
    prefix_cache: bool = False,
) -> PoolSizes:
    """Sensible pools for `device`.

    `dtype` is the model's; None means the usual one for the device (bfloat16
    on CUDA, float32 on CPU). The free memory counted is what the device has
    now, less the weights (weight_bytes: embeddings, every layer, every expert
    of every MoE block) when `weights_on_device` is False, i.e. when sizing
    before loading. CPU: 8 slots and pages for 8 x 4096 tokens, within 1 GiB
    or a quarter of that memory. CUDA: 90% of it minus 2 GiB, a quarter of it
    (at most 256 slots) for GDN slots and the rest for pages. Raises
    ModelDoesNotFit when not even one slot and one page fit. With `prefix_cache`
    (and a model with GDN layers), GDN snapshot slots too: CPU 4 per GDN slot,
    CUDA a tenth of the budget (at most 4096), taken before the pages.
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    page_bytes = kv_page_bytes(config, page_size, dtype)
    slot_bytes = gdn_slot_bytes(config, dtype)
    weights = 0 if weights_on_device else weight_bytes(config, dtype)
    free = available_bytes(device) - weights
    snapshots = prefix_cache and config.num_linear_attention_layers > 0
    if device.type == "cuda":
        budget = int(free * _CUDA_USABLE_FRACTION) - _CUDA_RESERVED_BYTES
        num_slots = min(_CUDA_MAX_GDN_SLOTS, int(budget * _CUDA_GDN_SHARE) // max(slot_bytes, 1))
        num_snapshots = (
            min(_CUDA_MAX_SNAPSHOT_SLOTS, int(budget * _CUDA_SNAPSHOT_SHARE) // max(slot_bytes, 1))
            if snapshots
            else 0
        )
        num_pages = (budget - (num_slots + num_snapshots) * slot_bytes) // max(page_bytes, 1)
    else:
        budget = min(_CPU_BUDGET_BYTES, free // 4)
        num_slots = _CPU_NUM_GDN_SLOTS
        num_snapshots = num_slots * _CPU_SNAPSHOTS_PER_GDN_SLOT if snapshots else 0
        wanted_pages = num_slots * _CPU_MAX_TOKENS_PER_SEQUENCE // page_size
        num_pages = min(
            wanted_pages, (budget - (num_slots + num_snapshots) * slot_bytes) // max(page_bytes, 1)
        )
    if num_slots < 1 or num_pages < 1:
        weights_note = "" if weights_on_device else f" after {weights / _GIB:.2f} GiB of weights"
        raise ModelDoesNotFit(
            f"{device}: about {max(budget, 0) / _GIB:.2f} GiB left for caches{weights_note}, but one GDN slot "
            f"takes {slot_bytes / _GIB:.3f} GiB and one KV page {page_bytes / _GIB:.3f} GiB; "
            "use a smaller dtype, a larger device or a smaller model"
        )
    return PoolSizes(
        total_kv_pages=int(num_pages),
        page_size=page_size,
        total_gdn_slots=int(num_slots),
        total_snapshot_slots=int(num_snapshots),
    )


def check_pools_fit(
    config: ModelConfig, sizes: PoolSizes, device: torch.device, dtype: torch.dtype
) -> None:
    """Raise ModelDoesNotFit if the pools need more memory than `device` has free."""
    needed = pool_bytes(config, sizes, dtype)
    free = available_bytes(device)
    if needed > free:
        raise ModelDoesNotFit(
            f"{sizes.total_kv_pages} KV pages of {sizes.page_size} tokens, {sizes.total_gdn_slots} GDN "
            f"slots and {sizes.total_snapshot_slots} GDN snapshot slots need {needed / _GIB:.2f} GiB "
            f"on {device}, only {free / _GIB:.2f} GiB is free; "
            "ask for fewer (see default_pool_sizes)"
        )
