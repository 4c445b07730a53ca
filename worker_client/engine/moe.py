"""The sparse mixture-of-experts block of Qwen3.5 MoE and Qwen3-Next (transformers' *SparseMoeBlock).

Per token: a softmax router (in at least fp32) picks the top-k experts, their
weights optionally renormalised to sum to 1; the token's output is the
weighted sum of those experts' SwiGLU outputs plus the shared expert's output
scaled by sigmoid(shared_expert_gate(x)). Parameter names and layouts match
transformers: experts.gate_up_proj [E, 2 * I, H] (gate rows, then up rows) and
experts.down_proj [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoeConfig
from .layers import MLP, upcast


class TopKRouter(nn.Module):
    """Router logits, softmax, top-k and (optionally) renormalisation of the top-k weights."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (routing weights [N, k] in x's dtype, expert indices [N, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(upcast(logits), dim=-1)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights.to(logits.dtype), top_experts


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked along a leading expert dim."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        intermediate = moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.zeros(moe.num_experts, 2 * intermediate, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.zeros(moe.num_experts, hidden_size, intermediate))

    def forward(
        self, x: torch.Tensor, top_experts: torch.Tensor, top_weights: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(token); x [N, hidden] -> [N, hidden].

        Tokens are grouped by expert so that every expert hit runs one matmul
        over its tokens; experts no token chose cost nothing.
        """
        top_k = top_experts.shape[-1]
        flat_experts = top_experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        token_of = order // top_k
        weight_of = top_weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, rows, expert_out * weight_of[start : start + count])
            start += count
        return out


class SparseMoeBlock(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert; `mlp.*` of a MoE decoder layer."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, moe)
        self.experts = Experts(hidden_size, moe)
        self.shared_expert = MLP(hidden_size, moe.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] packed tokens -> [N, hidden]."""
        top_weights, top_experts = self.gate(x)
        routed = self.experts(x, top_experts, top_weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
