"""Pure functions of the Gated DeltaNet token mixer: short causal conv and the gated delta rule.

Tokens are packed: row (sequence) b contributes seq_lens[b] consecutive tokens.
Layout: q, k [N, H, Dk], v [N, H, Dv], g and beta [N, H], state [B, H, Dk, Dv],
all fp32 (fp64 for a float64 reference model); q and k already expanded to the
value heads, L2-normalised, and q scaled by Dk**-0.5. Per row and head the
recurrence is

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T       (the delta rule)
    o_t = S_t^T q_t
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

GDN_CHUNK_SIZE = 64


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, seq_lens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU over packed rows, each continuing from its conv state.

    x [N, C]; conv_state [B, C, K-1] holds each row's K-1 inputs before its
    tokens (zeros at the start of a sequence); weight [C, K]. Returns (out
    [N, C], the new conv state [B, C, K-1]: each row's last K-1 inputs).
    """
    num_rows, channels, width = conv_state.shape
    device = x.device
    lengths = torch.tensor(seq_lens, device=device)
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    row_starts = torch.cumsum(lengths, 0) - lengths
    # One timeline: row b's state block, then its tokens, then row b + 1's state block...
    history = x.new_zeros(channels, x.shape[0] + num_rows * width)
    state_starts = (
        row_starts + torch.arange(num_rows, device=device) * width
    )  # where row b's block begins
    window = torch.arange(width, device=device)
    history[:, (state_starts[:, None] + window).flatten()] = (
        conv_state.to(x.dtype).permute(1, 0, 2).flatten(1)
    )
    history[:, torch.arange(x.shape[0], device=device) + (rows + 1) * width] = x.T
    out = F.conv1d(history[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]
    # Token i of row b ends the window that starts at history column i + b * width.
    out = out[:, torch.arange(x.shape[0], device=device) + rows * width].T
    new_state = history[:, state_starts[:, None] + lengths[:, None] + window].permute(1, 0, 2)
    return F.silu(out).to(x.dtype), new_state


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (decode): q, k [B, H, Dk], v [B, H, Dv]; returns (out [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_lens: Sequence[int],
    chunk_size: int = GDN_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over packed rows, chunk by chunk (WY form); returns (out [N, H, Dv], final states).

    Each row is cut into chunks of `chunk_size` from its first token (its last
    chunk zero-padded: g = beta = k = 0 leaves the state unchanged). Inside a
    chunk with cumulative log-decay gamma, the corrections
    u_i = beta_i (v_i - exp(gamma_i) S0^T k_i - sum_{j<i} exp(gamma_i - gamma_j) (k_i.k_j) u_j)
    solve a unit lower-triangular system; outputs and the next state follow
    from u by matmuls. Every chunk of every row is prepared at once; only the
    pass from state to state runs chunk index by chunk index.
    """
    device = q.device
    chunks_per_row = [math.ceil(n / chunk_size) for n in seq_lens]
    lengths = torch.tensor(seq_lens, device=device)
    first_chunk = torch.tensor([0, *chunks_per_row[:-1]], device=device).cumsum(0)  # [B]
    rows = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lengths)
    offsets = torch.arange(q.shape[0], device=device) - (torch.cumsum(lengths, 0) - lengths)[rows]
    slot_of_token = first_chunk[rows] * chunk_size + offsets  # [N] in the chunked layout
    num_slots = sum(chunks_per_row) * chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] -> [chunks, H, C, ...], zeros after each row's last token."""
        slots = x.new_zeros(num_slots, *x.shape[1:])
        slots[slot_of_token] = x
        return slots.unflatten(0, (-1, chunk_size)).transpose(1, 2)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))  # [M, H, C, D] and [M, H, C]
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow).
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strictly_lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = strictly_lower + torch.eye(chunk_size, dtype=q.dtype, device=device)
    u_from_values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    u_from_state = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    chunk_decay = gamma[..., -1:].exp()[..., None]  # [M, H, 1, 1]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]

    out = torch.empty_like(u_from_values)
    state = state.clone()
    for n in range(max(chunks_per_row)):
        rows_here = [b for b, count in enumerate(chunks_per_row) if count > n]
        row_index = torch.tensor(rows_here, device=device)
        here = first_chunk[row_index] + n
        row_state = state[row_index]
        u = u_from_values[here] - u_from_state[here] @ row_state
        out[here] = q_decayed[here] @ row_state + intra[here] @ u
        state[row_index] = row_state * chunk_decay[here] + k_to_end[here].transpose(-1, -2) @ u
    return out.transpose(1, 2).flatten(0, 1)[slot_of_token], state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
