"""The Gated DeltaNet token mixer (the "linear_attention" layers of Qwen3.5 and Qwen3-Next)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import PackedBatch
from .config import GdnProjection, ModelConfig
from .forward_cache import GdnState
from .gdn_kernels import causal_conv1d, chunked_gated_delta_rule, gated_delta_step, l2_normalize
from .layers import GatedRMSNorm, upcast


class GatedDeltaNet(nn.Module):
    """in_proj -> short causal conv -> gated delta rule -> gated RMSNorm -> out_proj.

    Parameter names match transformers' Qwen3_5GatedDeltaNet (GdnProjection.SPLIT)
    or Qwen3NextGatedDeltaNet (FUSED), so checkpoints load as they are.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        self.projection = config.gdn_projection
        conv_dim = config.linear_conv_dim
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        hidden = config.hidden_size
        if self.projection is GdnProjection.SPLIT:
            self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def initial_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> GdnState:
        """The all-zeros state of a sequence before its first token."""
        conv_dim, kernel = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        return GdnState(
            conv=torch.zeros(batch_size, conv_dim, kernel - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(
                batch_size,
                self.num_v_heads,
                self.head_k_dim,
                self.head_v_dim,
                device=device,
                dtype=torch.promote_types(dtype, torch.float32),
            ),
        )

    def forward(
        self, x: torch.Tensor, state: GdnState | None, batch: PackedBatch
    ) -> tuple[torch.Tensor, GdnState]:
        """x [num_tokens, hidden] packed, each row continuing from its `state` (None: from token 0).

        Returns (out [num_tokens, hidden], the rows' new state). Everything runs on the
        packed tokens; the conv and the recurrence keep each row's own state.
        """
        if state is None:
            state = self.initial_state(batch.num_rows, x.device, x.dtype)
        qkv, z, b, a = self._project(x)
        mixed, new_conv = causal_conv1d(
            qkv, state.conv, self.conv1d.weight[:, 0, :], batch.seq_lens
        )
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = l2_normalize(
            upcast(self._value_heads(query.unflatten(-1, (self.num_k_heads, self.head_k_dim))))
        )
        k = l2_normalize(
            upcast(self._value_heads(key.unflatten(-1, (self.num_k_heads, self.head_k_dim))))
        )
        q = q * self.head_k_dim**-0.5
        v = upcast(value.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        beta = upcast(b.sigmoid())
        g = -upcast(self.A_log).exp() * F.softplus(upcast(a) + upcast(self.dt_bias))
        if batch.max_len == 1:  # decode: one token per row
            core, new_recurrent = gated_delta_step(q, k, v, g, beta, upcast(state.recurrent))
        else:
            core, new_recurrent = chunked_gated_delta_rule(
                q, k, v, g, beta, upcast(state.recurrent), batch.seq_lens
            )
        core = core.to(x.dtype)  # [num_tokens, Hv, Dv]
        out = self.norm(core, z.unflatten(-1, (self.num_v_heads, self.head_v_dim))).flatten(1)
        return self.out_proj(out), GdnState(conv=new_conv, recurrent=new_recurrent)

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (qkv [N, conv_dim] as q|k|v of all heads, z [N, value_dim], b and a [N, Hv])."""
        if self.projection is GdnProjection.SPLIT:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups rows by key head: per key head q, k, then its value heads' v and z
        # (and b then a). Value head h belongs to key head h // (Hv / Hk), as in the split layout.
        per_key_head = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.num_k_heads, -1))
        q, k, v, z = qkvz.split(
            [
                self.head_k_dim,
                self.head_k_dim,
                per_key_head * self.head_v_dim,
                per_key_head * self.head_v_dim,
            ],
            dim=-1,
        )
        b, a = self.in_proj_ba(x).unflatten(-1, (self.num_k_heads, -1)).split(per_key_head, dim=-1)
        qkv = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)
        return qkv, z.flatten(-2), b.flatten(-2), a.flatten(-2)

    def _value_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """[N, Hk, D] -> [N, Hv, D], each key head repeated for its value heads."""
        repeat = self.num_v_heads // self.num_k_heads
        return heads.repeat_interleave(repeat, dim=1) if repeat > 1 else heads
