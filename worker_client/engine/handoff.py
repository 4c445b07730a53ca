"""A held sequence's KV positions and GDN states as StateChunks, and back (handoffs).

The bytes are the pools' own layout and dtypes, copied to the host: keys then values
[num_tokens, kv_heads, head_dim] of one attention layer per chunk (split so that a chunk
stays under `MAX_CHUNK_BYTES`, well inside gRPC's default 4 MiB message), then per GDN
layer its recurrent state [value_heads, key_dim, value_dim] and its convolution state
[conv_dim, kernel - 1]. `parse_chunks` checks every chunk against the receiver's pools
before anything is written, so a refused import changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .api import ImportProblem, ImportRefused, StateChunk, StateKind
from .kv_cache import PagedKVCache
from .state_pool import GdnStatePool

MAX_CHUNK_BYTES = 1 << 20


def to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of `tensor` (any dtype, bfloat16 included), copied to the host."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A host tensor of `shape` and `dtype` from `data` (its size checked by the caller)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def export_state(
    kv: PagedKVCache,
    states: GdnStatePool,
    seq_id: int,
    slot: int,
    first_token: int,
    num_tokens: int,
) -> tuple[StateChunk, ...]:
    """Chunks of `seq_id`'s KV positions [first_token, num_tokens) and of GDN `slot`."""
    chunks: list[StateChunk] = []
    table = torch.tensor(kv.pages_of(seq_id, 0, kv.num_pages_held(seq_id)), dtype=torch.long)
    table = table.to(kv.keys.device)
    num_layers, _, _, num_heads, head_dim = kv.keys.shape
    token_bytes = 2 * num_heads * head_dim * kv.keys.element_size()
    step = max(1, MAX_CHUNK_BYTES // token_bytes)
    for layer in range(num_layers):
        keys = kv.keys[layer][table].flatten(0, 1)
        values = kv.values[layer][table].flatten(0, 1)
        for start in range(first_token, num_tokens, step):
            end = min(num_tokens, start + step)
            data = to_bytes(keys[start:end]) + to_bytes(values[start:end])
            chunks.append(StateChunk(StateKind.ATTENTION_KV, layer, data, start, end - start))
    for layer in range(states.conv.shape[0]):
        chunks.append(
            StateChunk(StateKind.GDN_RECURRENT, layer, to_bytes(states.recurrent[layer, slot]))
        )
        chunks.append(StateChunk(StateKind.GDN_CONV, layer, to_bytes(states.conv[layer, slot])))
    return tuple(chunks)


@dataclass
class ParsedState:
    """Chunks checked against the receiver's pools, as host tensors."""

    kv: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (layer, first token, keys, values)
    recurrent: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]


def parse_chunks(
    kv: PagedKVCache,
    states: GdnStatePool,
    chunks: Iterable[StateChunk],
    first_token: int,
    num_tokens: int,
) -> ParsedState:
    """Check that `chunks` cover KV positions [first_token, num_tokens) of every attention
    layer exactly once and hold every GDN layer's two states, each of the size this
    engine's pools hold; raises ImportRefused(MALFORMED) otherwise."""
    num_layers, _, _, num_heads, head_dim = kv.keys.shape
    parsed = ParsedState([], {}, {})
    covered = [0] * num_layers
    recurrent_shape = tuple(states.recurrent.shape[2:])
    conv_shape = tuple(states.conv.shape[2:])
    for chunk in chunks:
        if chunk.kind is StateKind.ATTENTION_KV:
            _check(0 <= chunk.layer < num_layers, f"attention layer {chunk.layer} out of range")
            start, end = chunk.first_token, chunk.first_token + chunk.num_tokens
            _check(
                first_token <= start < end <= num_tokens,
                f"KV positions [{start}, {end}) outside [{first_token}, {num_tokens})",
            )
            shape = (chunk.num_tokens, num_heads, head_dim)
            half = _num_bytes(shape, kv.keys.dtype)
            _check(len(chunk.data) == 2 * half, f"attention layer {chunk.layer}: wrong size")
            keys = from_bytes(chunk.data[:half], kv.keys.dtype, shape)
            values = from_bytes(chunk.data[half:], kv.values.dtype, shape)
            parsed.kv.append((chunk.layer, start, keys, values))
            covered[chunk.layer] += chunk.num_tokens
        else:
            is_recurrent = chunk.kind is StateKind.GDN_RECURRENT
            pool = states.recurrent if is_recurrent else states.conv
            shape = recurrent_shape if is_recurrent else conv_shape
            target = parsed.recurrent if is_recurrent else parsed.conv
            _check(0 <= chunk.layer < pool.shape[0], f"GDN layer {chunk.layer} out of range")
            _check(chunk.layer not in target, f"GDN layer {chunk.layer}: {chunk.kind.value} twice")
            _check(
                len(chunk.data) == _num_bytes(shape, pool.dtype),
                f"GDN layer {chunk.layer}: {chunk.kind.value} of the wrong size",
            )
            target[chunk.layer] = from_bytes(chunk.data, pool.dtype, shape)
    # Disjoint chunks within the range whose sizes add up to it cover it exactly.
    _check(
        all(n == num_tokens - first_token for n in covered) and _disjoint(parsed.kv),
        f"KV positions [{first_token}, {num_tokens}) not covered exactly once in every layer",
    )
    num_gdn = states.conv.shape[0]
    _check(
        len(parsed.recurrent) == num_gdn and len(parsed.conv) == num_gdn,
        f"GDN states of {len(parsed.recurrent)} and {len(parsed.conv)} layers, not {num_gdn}",
    )
    return parsed


def write_state(
    kv: PagedKVCache, states: GdnStatePool, seq_id: int, slot: int, parsed: ParsedState
) -> None:
    """Write checked state into `seq_id`'s reserved KV positions and GDN `slot`."""
    device = kv.keys.device
    for layer, start, keys, values in parsed.kv:
        positions = torch.arange(start, start + keys.shape[0], device=device)
        rows = torch.zeros_like(positions)
        slots = kv.slot_indices([seq_id], rows, positions)
        kv.write(layer, slots, keys.to(device), values.to(device))
    for layer, state in parsed.recurrent.items():
        states.recurrent[layer, slot] = state.to(device)
    for layer, state in parsed.conv.items():
        states.conv[layer, slot] = state.to(device)


def _disjoint(kv: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> bool:
    spans = sorted((layer, start, start + keys.shape[0]) for layer, start, keys, _ in kv)
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def _num_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * torch.empty((), dtype=dtype).element_size()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ImportRefused(ImportProblem.MALFORMED, f"handoff state refused: {message}")
