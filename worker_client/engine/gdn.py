"""The Gated DeltaNet token mixer (Qwen3.5's "linear_attention" layers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .forward_cache import GdnState
from .gdn_kernels import causal_conv1d, chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from .layers import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    """in_proj -> short causal conv -> gated delta rule -> gated RMSNorm -> out_proj.

    Parameter names match transformers' Qwen3_5GatedDeltaNet so checkpoints load as is.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        conv_dim = config.linear_conv_dim
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        self.in_proj_qkv = nn.Linear(config.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    def initial_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> GdnState:
        """The all-zeros state of a sequence before its first token."""
        conv_dim, kernel = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        return GdnState(
            conv=torch.zeros(batch_size, conv_dim, kernel - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(
                batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                device=device, dtype=torch.float32,
            ),
        )

    def forward(self, x: torch.Tensor, state: GdnState | None) -> tuple[torch.Tensor, GdnState]:
        """x [B, T, hidden] continuing from `state` (None: from token 0); returns (out, new state)."""
        batch, seq_len, _ = x.shape
        if state is None:
            state = self.initial_state(batch, x.device, x.dtype)
        mixed, new_conv = causal_conv1d(
            self.in_proj_qkv(x).transpose(1, 2), state.conv, self.conv1d.weight[:, 0, :]
        )
        query, key, value = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = (self._heads_fp32(t, self.head_k_dim) for t in (query, key))
        q, k = l2_normalize(q), l2_normalize(k)
        q = q * self.head_k_dim**-0.5
        v = self._heads_fp32(value, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid().float().transpose(1, 2)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        g = g.transpose(1, 2)
        rule = recurrent_gated_delta_rule if seq_len == 1 else chunked_gated_delta_rule
        core, new_recurrent = rule(q, k, v, g, beta, state.recurrent.float())
        core = core.transpose(1, 2).to(x.dtype)  # [B, T, Hv, Dv]
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        out = self.norm(core, z).flatten(2)
        return self.out_proj(out), GdnState(conv=new_conv, recurrent=new_recurrent)

    def _heads_fp32(self, t: torch.Tensor, head_dim: int) -> torch.Tensor:
        """[B, T, n*head_dim] -> [B, Hv, T, head_dim] fp32, key heads repeated to the value heads."""
        heads = t.unflatten(-1, (-1, head_dim))
        repeat = self.num_v_heads // heads.shape[2]
        if repeat > 1:
            heads = heads.repeat_interleave(repeat, dim=2)
        return heads.transpose(1, 2).float()
