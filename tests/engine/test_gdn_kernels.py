"""The packed GDN kernels equal their definitions, row by row, token by token (float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_client.engine.gdn_kernels import (
    causal_conv1d,
    chunked_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
)

SEQ_LENS = (
    1,
    70,
    64,
    5,
    129,
)  # a single token, across one and two chunk boundaries, exactly one chunk
HEADS, KEY_DIM, VALUE_DIM, CHANNELS, KERNEL = 3, 8, 6, 5, 4


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_chunked_rule_over_packed_rows_equals_the_recurrence_token_by_token():
    num_tokens, num_rows = sum(SEQ_LENS), len(SEQ_LENS)
    q = l2_normalize(random(num_tokens, HEADS, KEY_DIM, seed=1)) * KEY_DIM**-0.5
    k = l2_normalize(random(num_tokens, HEADS, KEY_DIM, seed=2))
    v = random(num_tokens, HEADS, VALUE_DIM, seed=3)
    g = -F.softplus(random(num_tokens, HEADS, seed=4))
    beta = torch.sigmoid(random(num_tokens, HEADS, seed=5))
    state = random(num_rows, HEADS, KEY_DIM, VALUE_DIM, seed=6)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, SEQ_LENS)
    start = 0
    for row, length in enumerate(SEQ_LENS):
        row_state = state[row : row + 1]
        for t in range(start, start + length):
            expected, row_state = gated_delta_step(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], row_state
            )
            torch.testing.assert_close(out[t : t + 1], expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(final[row : row + 1], row_state, rtol=1e-10, atol=1e-12)
        start += length


def test_causal_conv_over_packed_rows_equals_each_row_alone():
    x = random(sum(SEQ_LENS), CHANNELS, seed=7)
    state = random(len(SEQ_LENS), CHANNELS, KERNEL - 1, seed=8)
    weight = random(CHANNELS, KERNEL, seed=9)
    out, new_state = causal_conv1d(x, state, weight, SEQ_LENS)
    start = 0
    for row, length in enumerate(SEQ_LENS):
        history = torch.cat((state[row], x[start : start + length].T), dim=-1)  # [C, K-1 + length]
        windows = history.unfold(-1, KERNEL, 1)  # [C, length, K]
        expected = F.silu((windows * weight[:, None, :]).sum(-1)).T
        torch.testing.assert_close(out[start : start + length], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(new_state[row], history[:, -(KERNEL - 1) :], rtol=0, atol=0)
        start += length
