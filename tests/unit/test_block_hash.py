"""The chained block hash of the contract, against a hand-written computation."""

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.block_hash import ROOT_HASH, block_hashes, next_block_hash


def _by_hand(token_ids, adapter_id, block_tokens):
    """The contract's words, spelled out with bytes and int.to_bytes (no struct)."""
    out, h = [], 0
    for i in range(len(token_ids) // block_tokens):
        block = token_ids[i * block_tokens : (i + 1) * block_tokens]
        adapter = adapter_id.encode("utf-8")
        message = (
            h.to_bytes(8, "little")
            + len(adapter).to_bytes(4, "little")
            + adapter
            + b"".join(t.to_bytes(4, "little") for t in block)
        )
        h = int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little")
        out.append(h)
    return out


def test_block_hashes_match_the_contract_computed_by_hand():
    tokens = list(range(100, 140))
    assert block_hashes(tokens, "", 16) == _by_hand(tokens, "", 16)
    assert block_hashes(tokens, "tenant-lora/é", 8) == _by_hand(tokens, "tenant-lora/é", 8)


def test_a_known_vector_stays_the_same():
    # h_0 of tokens 0..3, no adapter, b = 4: BLAKE2b-8 of 8 zero bytes, 4 zero bytes,
    # then 00000000 01000000 02000000 03000000.
    message = bytes(12) + bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])
    expected = int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little")
    assert block_hashes([0, 1, 2, 3], "", 4) == [expected]
    assert next_block_hash(ROOT_HASH, "", [0, 1, 2, 3]) == expected


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), "", 16) == []
    assert len(block_hashes(list(range(33)), "", 16)) == 2


def test_the_adapter_and_every_earlier_block_change_the_hash():
    tokens = list(range(32))
    base = block_hashes(tokens, "", 16)
    assert block_hashes(tokens, "a", 16)[0] != base[0]
    changed_first = block_hashes([999, *tokens[1:]], "", 16)
    assert changed_first[1] != base[1]  # block 1's tokens are equal: the chain differs


def test_a_growing_sequence_extends_its_list():
    tokens = list(range(64))
    whole = block_hashes(tokens, "x", 16)
    tail = block_hashes(tokens, "x", 16, start_block=2, previous_hash=whole[1])
    assert whole[2:] == tail


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes([1, 2], "", 0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.text(max_size=5), st.integers(1, 9))
def test_block_hashes_equal_the_hand_computation(tokens, adapter_id, block_tokens):
    assert block_hashes(tokens, adapter_id, block_tokens) == _by_hand(
        tokens, adapter_id, block_tokens
    )
