"""Valid requests with flipped, inserted, deleted or cut bytes, sent as raw bytes.

Every call ends with an expected status within its deadline (no hang), and the server
keeps serving valid calls. Bytes that do not parse are INVALID_ARGUMENT, answered by
service/server/interceptors/decode_errors.py: grpc's own answer (INTERNAL) leaks memory per call.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .raw import DOES_NOT_PARSE, GRPC_DECODE_FAILURE, mutate, mutations, raw_call
from .strategies import FUZZ, requests_for
from .target import EXPECTED_CODES, METHODS, SERVICE_NAME, FuzzTarget

_NOT_UTF8 = b"\xff\xfe\xc3\x28"  # not UTF-8 in any reading


def _check_raw(target: FuzzTarget, method: str, payload: bytes) -> None:
    """Call; assert the answer is expected; count how it ended."""
    outcome = raw_call(target.server.channel, f"/{SERVICE_NAME}/{method}", payload)
    assert outcome.code in EXPECTED_CODES, (
        f"{method} answered {outcome.code.name}: {outcome.details[:300]!r}"
    )
    assert GRPC_DECODE_FAILURE not in outcome.details
    parse = " (does not parse)" if DOES_NOT_PARSE in outcome.details else ""
    target.codes[f"raw {method}", outcome.code.name + parse] += 1


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_mutated_request_bytes_get_a_status_and_the_server_keeps_serving(target, data):
    method = data.draw(st.sampled_from(METHODS), label="method")
    valid = data.draw(requests_for(method, target.known_ids), label="valid")
    payload = mutate(valid.SerializeToString(), data.draw(mutations(), label="edits"))
    _check_raw(target, method, payload)
    target.assert_serving()


def _field(number: int, data: bytes) -> bytes:
    """Field `number` as wire type 2 (length-delimited) holding `data`."""
    return bytes([number << 3 | 2, len(data)]) + data


@pytest.mark.parametrize(
    "path, message_type, payload, streaming",
    [
        (f"/{SERVICE_NAME}/Submit", "SubmitRequest", _field(1, _NOT_UTF8), ""),
        (f"/{SERVICE_NAME}/Submit", "SubmitRequest", _field(6, _NOT_UTF8), ""),
        (f"/{SERVICE_NAME}/Generate", "SubmitRequest", _field(4, _NOT_UTF8), "response"),
        (f"/{SERVICE_NAME}/RegisterWorker", "RegisterWorkerRequest", _field(6, _NOT_UTF8), ""),
        (f"/{SERVICE_NAME}/SelectBatch", "SelectBatchRequest", _field(1, _NOT_UTF8), ""),
        (f"/{SERVICE_NAME}/DeregisterWorker", "DeregisterWorkerRequest", b"\x0a\x05ab", ""),
        (f"/{SERVICE_NAME}/GetStatus", "GetStatusRequest", b"\xff\xff\xff", ""),
        ("/grpc.health.v1.Health/Check", "HealthCheckRequest", _field(1, _NOT_UTF8), ""),
        (
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "ServerReflectionRequest",
            _field(1, _NOT_UTF8),
            "both",
        ),
    ],
    ids=[
        "submit-request-id",
        "submit-tenant",
        "generate-adapter",
        "register-adapters",
        "select-batch-worker-id",
        "truncated-string",
        "bad-tag",
        "health",
        "reflection",
    ],
)
def test_bytes_that_do_not_parse_are_invalid_argument_naming_the_message(
    target, path, message_type, payload, streaming
):
    outcome = raw_call(target.server.channel, path, payload, streaming)
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert DOES_NOT_PARSE in outcome.details and message_type in outcome.details
    target.assert_serving()


def test_well_formed_bytes_of_another_message_type_get_an_expected_status(target):
    """Bytes that parse, but as another message: unknown fields are skipped, and type
    confusions (a varint where a string is expected) do not parse."""
    others = [
        pb.SelectBatchRequest(worker_id="w0", waiting=[1, 2], kv_free_pages=5),
        pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4, priority=-1),
        pb.RegisterWorkerRequest(worker_id="w0", total_kv_pages=10, page_size=16),
        pb.SchedulerDecision(iteration=7, decode=[1, 2, 3]),
        health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING),
        reflection_pb2.ServerReflectionRequest(list_services=""),
    ]
    for method in METHODS:
        for other in others:
            _check_raw(target, method, other.SerializeToString())
    target.assert_serving()


def test_an_empty_payload_is_the_default_message(target):
    """Zero bytes parse as the all-defaults message, which each RPC judges on its own."""

    def code(method: str) -> grpc.StatusCode:
        return raw_call(target.server.channel, f"/{SERVICE_NAME}/{method}", b"").code

    assert code("GetStatus") is grpc.StatusCode.OK
    assert code("Submit") is grpc.StatusCode.INVALID_ARGUMENT
    assert code("SelectBatch") is grpc.StatusCode.FAILED_PRECONDITION
    target.assert_serving()
