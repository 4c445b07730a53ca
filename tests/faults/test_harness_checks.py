"""The checker itself: duplicated and missing tokens are counted, not just noticed."""

from __future__ import annotations

from bench.harness.fault_stack import count_duplicated_and_missing, make_jobs

REF = [10, 11, 12, 13, 14, 15]


def test_an_exact_output_has_nothing_duplicated_or_missing():
    assert count_duplicated_and_missing(REF, REF) == (0, 0)


def test_a_repeated_run_of_tokens_counts_each_repeated_token():
    assert count_duplicated_and_missing([10, 11, 12, 11, 12, 13, 14, 15], REF) == (2, 0)
    assert count_duplicated_and_missing([10, 10, 11, 12, 13, 14, 15, 15], REF) == (2, 0)


def test_a_short_or_diverging_output_counts_the_reference_tokens_it_lacks():
    assert count_duplicated_and_missing([10, 11, 12], REF) == (0, 3)
    assert count_duplicated_and_missing([10, 11, 99, 13, 14, 15], REF) == (0, 4)
    assert count_duplicated_and_missing([], REF) == (0, 6)


def test_jobs_are_deterministic_and_some_stop_on_a_stop_token():
    jobs = make_jobs(30, seed=9)
    assert [j.expected_tokens for j in jobs] == [j.expected_tokens for j in make_jobs(30, seed=9)]
    assert len({j.request_id for j in jobs}) == 30
    stopped = [j for j in jobs if j.stop_token_ids and j.expected_tokens[-1] in j.stop_token_ids]
    assert stopped and all(len(j.expected_tokens) <= j.max_new_tokens for j in jobs)
