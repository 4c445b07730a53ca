"""Small building blocks shared by the decoder layers: norms, MLP and RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in the precision that norms, softmaxes and the GDN recurrence run in.

    float32 for bfloat16, float16 and float32 models, as transformers does;
    float64 stays float64, so a float64 model is a float64 reference throughout.
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: y = norm(x) * (1 + weight), computed in at least fp32.

    The stored weight is an offset from 1 (a fresh layer holds zeros), unlike
    Llama's RMSNorm whose weight is the scale itself.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = upcast(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + upcast(self.weight))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: y = weight * norm(x) * silu(gate).

    Here the weight is the scale itself (a fresh layer holds ones). The norm is
    taken in at least fp32 and cast back before the weight, as transformers does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = upcast(x)
        normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(upcast(gate))).to(x.dtype)


class MLP(nn.Module):
    """The dense SwiGLU feed-forward block (also each MoE block's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Partial RoPE: rotates the first `rotary_dim` dims of each head (half-split layout).

    Qwen3.5's multimodal RoPE reduces to this for text, where the temporal,
    height and width positions of every token are equal.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [*positions.shape, rotary_dim] for integer positions."""
        # Computed per call in at least fp32 rather than kept as a buffer a dtype cast could round.
        wide = torch.promote_types(dtype, torch.float32)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=wide, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.rotary_dim))
        freqs = positions.to(wide)[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., H, D] by cos/sin [..., R]; dims R..D pass through unchanged."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)
