"""Mooncake traces: read, scaled by --block-tokens, prompts that share prefixes exactly
where their hash ids do; and the hit-rate bound."""

from __future__ import annotations

import json

import pytest

from common.block_hash import block_hashes
from service.sim.bound import hit_rate_bound
from service.sim.workload import (
    Request,
    WorkloadError,
    load_trace,
    make_requests,
    prompt_token_ids,
)


def write_trace(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(timestamp, input_length, output_length, hash_ids):
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def test_the_shipped_mooncake_traces_load_with_their_hash_ids():
    conv = load_trace("mooncake_conversation")
    assert len(conv.rows) == 12031 and conv.has_prefixes and conv.has_arrivals
    first = conv.rows[0]
    assert (first.prompt_len, first.output_len, first.arrived_at) == (6758, 500, 0.0)
    assert first.hash_ids == tuple(range(14))
    assert len(load_trace("mooncake_synthetic").rows) == 3993


def test_block_tokens_scales_every_prompt_and_keeps_its_blocks():
    conv = load_trace("mooncake_conversation", block_tokens=64)
    first = conv.rows[0]
    assert first.prompt_len == -(-6758 * 64 // 512) and first.hash_ids == tuple(range(14))
    assert -(-first.prompt_len // 64) == len(first.hash_ids)
    assert conv.rows[-1].arrived_at == pytest.approx(3536.999)


def test_prompts_share_a_prefix_exactly_where_their_hash_ids_agree(tmp_path):
    path = write_trace(
        tmp_path,
        [
            row(0, 1536, 5, [7, 8, 9]),
            row(10, 1400, 5, [7, 8, 4]),
            row(15, 1536, 5, [7, 8, 4]),
            row(20, 1024, 5, [3, 8]),
        ],
    )
    trace = load_trace(str(path), block_tokens=16)
    reqs = make_requests(trace, num_requests=4, qps=1, arrivals="trace", seed=0, max_seq_len=4096)
    a, partial, b, c = (block_hashes(prompt_token_ids(r), "", 16) for r in reqs)
    assert [len(prompt_token_ids(r)) for r in reqs] == [48, 44, 48, 32]
    assert a[:2] == b[:2] == partial and a[2] != b[2]
    assert c[1] != a[1]  # the same id after another first block: another prefix


def test_trace_arrivals_keep_the_order_and_poisson_arrivals_keep_the_turns_in_order(tmp_path):
    path = write_trace(tmp_path, [row(t * 1000, 500, 3, [t]) for t in range(6)])
    trace = load_trace(str(path))
    for arrivals in ("trace", "poisson"):
        reqs = make_requests(
            trace, num_requests=8, qps=2, arrivals=arrivals, seed=1, max_seq_len=4096
        )
        assert [r.hash_ids[0] for r in reqs] == [0, 1, 2, 3, 4, 5, 0, 1], arrivals


def test_a_capped_prompt_keeps_the_blocks_it_still_has(tmp_path):
    path = write_trace(tmp_path, [row(0, 5000, 10, list(range(10)))])
    (req,) = make_requests(
        load_trace(str(path)), num_requests=1, qps=1, arrivals="trace", seed=0, max_seq_len=1024
    )
    assert req.prompt_len == 1023 and len(prompt_token_ids(req)) == 1023


def test_requests_of_a_csv_trace_share_no_prefix():
    a, b = Request(0, 0.0, 64, 1), Request(1, 0.0, 64, 1)
    assert (
        block_hashes(prompt_token_ids(a), "", 16)[0] != block_hashes(prompt_token_ids(b), "", 16)[0]
    )


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 600}', "not a Mooncake trace line"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}',
            "hash_ids has 1 blocks for input_length 600",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}',
            "must be at least 1",
        ),
        ("not json", "not a Mooncake trace line"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, 10, 1, [0])) + "\n" + line + "\n")
    with pytest.raises(WorkloadError, match=f"bad.jsonl:2: .*{message}"):
        load_trace(str(path))


def test_the_bound_reuses_repeated_prefixes_and_shrinks_with_the_cache():
    # Three prompts of 4 blocks of 16 sharing the first 3 blocks: the 2nd and 3rd reuse 48.
    reqs = [Request(i, float(i), 64, 1, (0, 1, 2, 10 + i), 16) for i in range(3)]
    assert hit_rate_bound(reqs, block_tokens=16, num_blocks=100) == pytest.approx(96 / 192)
    # Room for one prompt's 4 blocks: still the shared 3 stay (most recently used).
    assert hit_rate_bound(reqs, block_tokens=16, num_blocks=4) == pytest.approx(96 / 192)
    assert hit_rate_bound(reqs, block_tokens=16, num_blocks=2) < 96 / 192
    # A prompt never reuses its own last token's block: a first chunk computes one token.
    same = [Request(i, float(i), 64, 1, (0, 1, 2, 3), 16) for i in range(2)]
    assert hit_rate_bound(same, block_tokens=16, num_blocks=100) == pytest.approx(48 / 128)


def test_the_workers_cache_bound_gives_generated_blocks_room_but_never_reuses_them():
    # Two prompts of 4 blocks sharing 3, each generating 33 tokens (2 more full blocks).
    reqs = [Request(i, float(i), 64, 33, (0, 1, 2, 10 + i), 16) for i in range(2)]
    kwargs = dict(block_tokens=16, cache_generated=True)
    # With room for everything the answers change nothing: 48 of 128 reused.
    assert hit_rate_bound(reqs, num_blocks=100, **kwargs) == pytest.approx(48 / 128)
    # Room for 4 blocks: the first's 2 generated blocks are older than its prompt's,
    # so its 3 shared blocks still stay, as without them.
    assert hit_rate_bound(reqs, num_blocks=4, **kwargs) == pytest.approx(48 / 128)
    # An unrelated prompt between them: 7 blocks keep the shared 3 behind its 4 prompt
    # blocks, but not behind its 6 generated ones too.
    three = [
        Request(0, 0.0, 64, 33, (0, 1, 2, 10), 16),
        Request(1, 1.0, 64, 97, (20, 21, 22, 23), 16),
        Request(2, 2.0, 64, 1, (0, 1, 2, 12), 16),
    ]
    assert hit_rate_bound(three, block_tokens=16, num_blocks=7) == pytest.approx(48 / 192)
    assert hit_rate_bound(three, num_blocks=7, **kwargs) == 0.0
