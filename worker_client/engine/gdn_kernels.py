"""Pure functions of the Gated DeltaNet token mixer: short causal conv and the gated delta rule.

Layout: q, k [B, H, T, Dk], v [B, H, T, Dv], g and beta [B, H, T], state
[B, H, Dk, Dv], all fp32 (fp64 for a float64 reference model); q and k already
expanded to the value heads, L2-normalised, and q scaled by Dk**-0.5. Per head
the recurrence is

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T       (the delta rule)
    o_t = S_t^T q_t
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GDN_CHUNK_SIZE = 64


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU, continuing from `conv_state`.

    x [B, C, T]; conv_state [B, C, K-1] holds the K-1 inputs before x (zeros at
    the start of a sequence); weight [C, K]. With `lengths` [B], row b's inputs
    are its first lengths[b] columns and the rest is padding. Returns (out
    [B, C, T], the new conv state [B, C, K-1]: each row's last K-1 inputs).
    """
    history = torch.cat((conv_state.to(x.dtype), x), dim=-1)
    out = F.conv1d(history.to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
    width = conv_state.shape[-1]
    if lengths is None:
        new_state = history[:, :, history.shape[-1] - width :]
    else:
        # Row b's last K-1 inputs sit at history columns [lengths[b], lengths[b] + K-1).
        columns = lengths[:, None] + torch.arange(width, device=x.device)
        new_state = history.gather(2, columns[:, None, :].expand(-1, history.shape[1], -1))
    return F.silu(out).to(x.dtype), new_state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token; returns (out [B, H, T, Dv], final state). Best for T == 1."""
    outputs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outputs, dim=2), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = GDN_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence evaluated chunk by chunk (WY form); returns (out, final state).

    Inside a chunk with cumulative log-decay gamma, the corrections
    u_i = beta_i (v_i - exp(gamma_i) S0^T k_i - sum_{j<i} exp(gamma_i - gamma_j) (k_i.k_j) u_j)
    solve a unit lower-triangular system; outputs and the next state follow
    from u by matmuls. Zero padding (g = beta = k = 0) leaves the state unchanged.
    """
    seq_len = q.shape[2]
    pad = (-seq_len) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.unflatten(2, (-1, chunk_size)) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.unflatten(2, (-1, chunk_size)) for x in (g, beta))  # [B, H, N, C]

    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow).
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strictly_lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = strictly_lower + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u_from_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_from_state = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    chunk_decay = gamma[..., -1:]  # [B, H, N, 1]
    k_to_end = k * (chunk_decay - gamma).exp()[..., None]

    outputs = []
    for n in range(q.shape[2]):
        u = u_from_values[:, :, n] - u_from_state[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ u)
        state = state * chunk_decay[:, :, n, :, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :seq_len]
    return out, state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
