"""WorkerSession under fuzzing: random report sequences over one stream, and raw bytes.

Each request gets exactly one answer, in order, or the session ends with one of
EXPECTED_CODES (never UNKNOWN or INTERNAL); the server stays SERVING and a session opened
after an error works.
"""

from __future__ import annotations

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .raw import DOES_NOT_PARSE, GRPC_DECODE_FAILURE, mutate, mutations, raw_call
from .strategies import FUZZ, requests_for
from .target import DETAILS_BOUND_CHARS, EXPECTED_CODES, SERVICE_NAME, FuzzTarget

REPORTS_PER_SESSION = 12


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_random_reports_over_a_session_are_answered_in_order_or_end_it_with_an_expected_status(
    target: FuzzTarget, data
):
    requests = data.draw(
        st.lists(
            requests_for("WorkerSession", target.known_ids),
            min_size=1,
            max_size=REPORTS_PER_SESSION,
        ),
        label="reports",
    )
    outcomes = target.session_calls(requests)
    assert len(outcomes) == len(requests)
    for outcome in outcomes:
        assert outcome.code in EXPECTED_CODES, (
            f"WorkerSession answered {outcome.code.name}: {outcome.details[:300]!r}"
        )
        assert len(outcome.details) <= DETAILS_BOUND_CHARS, outcome.details[:300]
    # A registered worker's session still answers, iteration after iteration.
    plain = pb.SelectBatchRequest(worker_id="w0", kv_free_pages=1000, gdn_free_slots=64)
    target.call(
        "RegisterWorker",
        pb.RegisterWorkerRequest(
            worker_id="w0", total_kv_pages=1000, page_size=16, total_gdn_slots=64
        ),
    )
    answers = target.session_calls([plain, plain])
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 2
    assert answers[1].response.iteration == answers[0].response.iteration + 1
    target.assert_serving()


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_mutated_bytes_on_a_session_get_a_status_and_the_server_keeps_serving(target, data):
    valid = data.draw(requests_for("WorkerSession", target.known_ids), label="valid")
    payload = mutate(valid.SerializeToString(), data.draw(mutations(), label="edits"))
    outcome = raw_call(
        target.server.channel, f"/{SERVICE_NAME}/WorkerSession", payload, streaming="both"
    )
    assert outcome.code in EXPECTED_CODES, (
        f"WorkerSession answered {outcome.code.name}: {outcome.details[:300]!r}"
    )
    assert GRPC_DECODE_FAILURE not in outcome.details
    parse = " (does not parse)" if DOES_NOT_PARSE in outcome.details else ""
    target.codes["raw WorkerSession", outcome.code.name + parse] += 1
    target.assert_serving()
