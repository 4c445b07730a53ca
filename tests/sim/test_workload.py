"""Workloads: shipped traces, arrivals at a rate, a seed, lengths capped at max_seq_len."""

from __future__ import annotations

import pytest

from service.sim.workload import WorkloadError, load_trace, make_requests, shipped_traces


def test_the_shipped_traces_load_with_their_columns():
    assert shipped_traces() == [
        "mooncake_conversation",
        "mooncake_synthetic",
        "sharegpt",
        "splitwise_code",
        "splitwise_conv",
    ]
    sharegpt = load_trace("sharegpt")
    assert len(sharegpt.rows) == 5000 and not sharegpt.has_arrivals
    conv = load_trace("splitwise_conv")
    assert conv.has_arrivals and conv.rows[0].arrived_at == 0.0


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    trace = load_trace("sharegpt")

    def make(seed):
        return make_requests(
            trace, num_requests=50, qps=4, arrivals="poisson", seed=seed, max_seq_len=4096
        )

    assert make(1) == make(1)
    assert make(1) != make(2)


def test_poisson_arrivals_come_at_the_rate_asked():
    trace = load_trace("sharegpt")
    reqs = make_requests(
        trace, num_requests=4000, qps=5, arrivals="poisson", seed=0, max_seq_len=4096
    )
    assert len(reqs) == 4000
    assert reqs[-1].arrival_seconds == pytest.approx(4000 / 5, rel=0.05)
    assert all(a.arrival_seconds < b.arrival_seconds for a, b in zip(reqs, reqs[1:]))


def test_trace_arrivals_keep_the_trace_gaps_scaled_to_the_rate(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n10,5,1\n11,6,2\n13,7,3\n")
    trace = load_trace(str(path))
    reqs = make_requests(trace, num_requests=5, qps=2, arrivals="trace", seed=0, max_seq_len=100)
    # mean gap 1.5 s in the trace; 0.5 s at 2 QPS: scale 1/3; past the end it starts over
    assert [r.arrival_seconds for r in reqs] == pytest.approx([0, 1 / 3, 1, 1.5, 1.5 + 1 / 3])
    assert [r.prompt_len for r in reqs] == [5, 6, 7, 5, 6]


def test_prompt_and_output_are_capped_at_max_seq_len(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n5000,10\n100,5000\n30,20\n")
    reqs = make_requests(
        load_trace(str(path)), num_requests=3, qps=1, arrivals="poisson", seed=0, max_seq_len=64
    )
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(30, 20), (63, 1), (63, 1)]


def test_a_trace_without_the_length_columns_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("prompt,output\n1,2\n")
    with pytest.raises(WorkloadError, match="missing the columns"):
        load_trace(str(path))
