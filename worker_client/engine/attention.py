"""Qwen3.5's gated full attention (the "full_attention" layers; Qwen3-Next's are the same)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .batch import PackedBatch
from .config import ModelConfig
from .forward_cache import ForwardCache
from .layers import RMSNorm, apply_rotary

# The kernels attention may run on CUDA: not cuDNN's. Measured on an H200 (torch 2.11,
# CUDA 13): for this engine's calls (an explicit mask, a key length that grows by one
# each decode step) SDPA picked cuDNN, which spent about 55 ms of CPU per call preparing
# it against under a millisecond of GPU work, so a step of two decodes of the tiny demo
# model took 50-70 ms (docs/benchmarks.md, "The reference engine on an H200"). The others need no such
# preparation per shape; with a mask it is the memory-efficient kernel or the math one.
CUDA_ATTENTION_BACKENDS = [  # a list: sdpa_kernel refuses a tuple
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class GatedAttention(nn.Module):
    """GQA attention with per-head q/k RMSNorm, partial RoPE and a sigmoid output gate.

    q_proj emits, per head, the query followed by its gate. Parameter names
    match transformers' Qwen3_5Attention (and Qwen3NextAttention).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PackedBatch,
        cache: ForwardCache,
        attention_layer: int,
    ) -> torch.Tensor:
        """x [num_tokens, hidden] packed -> [num_tokens, hidden]; this step's keys/values go to `cache`.

        Projections and the gate run on the packed tokens; attention runs per row,
        each row's queries over its own keys: all rows at once when they are of
        equal length (decode), else row by row (no padding to the longest).
        """
        query, gate = self.q_proj(x).unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, -1)
        key = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        value = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        query = apply_rotary(self.q_norm(query), cos, sin)
        key = apply_rotary(self.k_norm(key), cos, sin)
        keys, values = cache.keys_values(attention_layer, key, value)
        if batch.is_rectangular:
            out = batch.unpad(self.attend(batch.pad(query), keys, values, batch.padded_positions))
        else:
            # Each row over its own keys only: positions up to its last query's.
            num_keys = (batch.positions[batch.last_token_index] + 1).tolist()
            out = torch.cat(
                [
                    self.attend(
                        query[rows][None],
                        keys[b : b + 1, : num_keys[b]],
                        values[b : b + 1, : num_keys[b]],
                        batch.positions[rows][None],
                    )[0]
                    for b, rows in enumerate(batch.row_slices())
                ]
            )
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of query [B, T, H, D] at `positions` [B, T] over keys/values [B, L, Hkv, D].

        Key index j is position j; a query sees keys j <= its position. Returns [B, T, H, D].
        """
        key_index = torch.arange(keys.shape[1], device=keys.device)
        mask = key_index[None, None, :] <= positions[:, :, None]  # [B, T, L]
        repeat = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(repeat, dim=2)
        values = values.repeat_interleave(repeat, dim=2)
        with sdpa_kernel(CUDA_ATTENTION_BACKENDS) if query.is_cuda else nullcontext():
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask[:, None],
                scale=self.head_dim**-0.5,
            )
        return out.transpose(1, 2)
