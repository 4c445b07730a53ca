"""Every string a client or a worker sends, tried with what no store should be handed: a
NUL, a lone surrogate (bytes that are not UTF-8) and 64 KiB. Each is refused at the edge,
INVALID_ARGUMENT naming the field, the same way whatever the store; a worker's
error_message is kept with its control characters escaped; and the scheduler goes on
serving everyone else (a NUL once stopped a PostgreSQL replica).

Here on a SQLite --state-dir; tests/replicas/test_string_fields_replicas.py runs the same
tests on replicas over PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import RPC_TIMEOUT_SECONDS, Stream, Worker, admitted, get_sequence, rpc_error, submit

SERVICE = "/lattice.scheduler.v1.Scheduler/"
# A placeholder of four bytes, swapped in the serialized request for four that are not
# UTF-8 ("a" and a UTF-16 surrogate, U+D800, as UTF-8 would spell it), so that the length
# prefix stays right. No Python client can send these: its str would not encode.
PLACEHOLDER = "@@@@"
NOT_UTF8 = b"a\xed\xa0\x80"
NUL = "nul\x00byte"
HUGE = "x" * 65536


@dataclass(frozen=True)
class Field:
    """One string field of one RPC: how to send a request with `value` in it."""

    rpc: str
    kind: str  # unary_unary, unary_stream or stream_stream
    path: str  # as the refusal names it
    request: Callable[[str], object]

    def call(self, channel: grpc.Channel, payload: bytes) -> None:
        """Send the serialized request `payload`; raises the call's RpcError."""
        method = getattr(channel, self.kind)(SERVICE + self.rpc)  # bytes in, bytes out
        if self.kind == "unary_unary":
            method(payload, timeout=RPC_TIMEOUT_SECONDS)
        elif self.kind == "unary_stream":
            list(method(payload, timeout=RPC_TIMEOUT_SECONDS))
        else:
            list(method(iter([payload]), timeout=RPC_TIMEOUT_SECONDS))


def _submit_request(**fields) -> pb.SubmitRequest:
    return pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4, **fields)


def _registration(worker_id: str = "w-bad", adapters: tuple[str, ...] = ()):
    return pb.RegisterWorkerRequest(
        worker_id=worker_id,
        total_kv_pages=1000,
        page_size=16,
        total_gdn_slots=64,
        adapters=list(adapters),
    )


FIELDS = [
    *(
        Field(rpc, kind, name, lambda v, name=name: _submit_request(**{name: v}))
        for rpc, kind in (("Submit", "unary_unary"), ("Generate", "unary_stream"))
        for name in ("request_id", "tenant", "adapter_id")
    ),
    Field("RegisterWorker", "unary_unary", "worker_id", lambda v: _registration(worker_id=v)),
    Field(
        "RegisterWorker",
        "unary_unary",
        "adapters[1]",
        lambda v: _registration(adapters=("lora-a", v)),
    ),
    Field(
        "SelectBatch",
        "unary_unary",
        "worker_id",
        lambda v: pb.SelectBatchRequest(worker_id=v, kv_free_pages=10, gdn_free_slots=1),
    ),
    Field(
        "WorkerSession",
        "stream_stream",
        "worker_id",
        lambda v: pb.SelectBatchRequest(worker_id=v, kv_free_pages=10, gdn_free_slots=1),
    ),
    Field(
        "DeregisterWorker",
        "unary_unary",
        "worker_id",
        lambda v: pb.DeregisterWorkerRequest(worker_id=v),
    ),
    Field("DrainWorker", "unary_unary", "worker_id", lambda v: pb.DrainWorkerRequest(worker_id=v)),
]
FIELD_IDS = [f"{f.rpc}.{f.path}" for f in FIELDS]


def serialized(field: Field, value: str | bytes) -> bytes:
    """The request of `field` holding `value` (bytes: put in as they are)."""
    if isinstance(value, str):
        return field.request(value).SerializeToString()
    payload = field.request(PLACEHOLDER).SerializeToString()
    assert payload.count(PLACEHOLDER.encode()) == 1 and len(value) == len(PLACEHOLDER)
    return payload.replace(PLACEHOLDER.encode(), value)


@pytest.fixture
def server(start_server, tmp_path):
    """A scheduler on a SQLite --state-dir: the store that would have taken a NUL."""
    return start_server(str(tmp_path / "state"))


@pytest.fixture
def stub(server):
    return server.stub


def assert_still_serving(stub, worker_id: str = "healthy") -> None:
    """A worker registers, a sequence is submitted, admitted, finished and read back."""
    worker = Worker(stub, worker_id)
    worker.register()
    seq_id = submit(stub, request_id=f"after-{worker_id}", tenant="t").seq_id
    decision = worker.select()
    for _ in range(50):  # a replica may claim from the shared queue on a later call
        if seq_id in admitted(decision):
            break
        decision = worker.select()
    assert seq_id in admitted(decision)
    worker.select(finished=[(seq_id, pb.FINISH_REASON_EOS, 1)], tokens={seq_id: [7]})
    assert get_sequence(stub, seq_id).state == pb.SEQUENCE_STATE_FINISHED
    worker.deregister()


@pytest.mark.parametrize("field", FIELDS, ids=FIELD_IDS)
@pytest.mark.parametrize(
    "value, refusal",
    [
        (NUL, "holds a NUL character (0x00) at index 3"),
        (NOT_UTF8, "is not valid UTF-8"),
        (HUGE, "is 65536 bytes; the limit is 256"),
    ],
    ids=["nul", "surrogate", "64KiB"],
)
def test_a_bad_string_is_refused_naming_its_field_and_the_scheduler_serves_on(
    server, stub, field, value, refusal
):
    err = rpc_error(lambda: field.call(server.channel, serialized(field, value)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert f"{field.path} {refusal}" in err.details(), err.details()
    assert len(err.details()) < 300, "the refusal must not echo the value"
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
    assert (status.queue_depth, list(status.workers)) == (0, []), "nothing was taken"
    assert_still_serving(stub)


def _fail(channel: grpc.Channel, worker: Worker, seq_id: int, error_message: str | bytes) -> None:
    request = pb.SelectBatchRequest(
        worker_id=worker.worker_id,
        kv_free_pages=1000,
        gdn_free_slots=64,
        finished=[
            pb.FinishedSequence(
                seq_id=seq_id,
                reason=pb.FINISH_REASON_FAILED,
                error_message=PLACEHOLDER if isinstance(error_message, bytes) else error_message,
            )
        ],
    )
    payload = request.SerializeToString()
    if isinstance(error_message, bytes):
        payload = payload.replace(PLACEHOLDER.encode(), error_message)
    channel.unary_unary(SERVICE + "SelectBatch")(payload, timeout=RPC_TIMEOUT_SECONDS)


@pytest.fixture
def failing(stub):
    """A registered worker holding one admitted sequence, and its Generate stream."""
    worker = Worker(stub, "w1")
    worker.register()
    stream = Stream(stub, _submit_request())
    seq_id = stream.next_event().seq_id
    decision = worker.select()
    for _ in range(50):
        if seq_id in admitted(decision):
            break
        decision = worker.select()
    assert seq_id in admitted(decision)
    return worker, seq_id, stream


@pytest.mark.parametrize(
    "message, kept",
    [
        (
            "CUDA error\x00: illegal\r\naddress\x1b[31m\x7f\u2028end",
            "CUDA error\\x00: illegal\\x0d\\x0aaddress\\x1b[31m\\x7f\\u2028end",
        ),
        ("é ü 中文 tab-free text stays as it is", "é ü 中文 tab-free text stays as it is"),
    ],
)
def test_a_workers_error_message_is_kept_with_control_characters_escaped(
    server, stub, failing, message, kept
):
    worker, seq_id, stream = failing
    _fail(server.channel, worker, seq_id, message)
    (last,) = stream.rest()
    assert (last.finish_reason, last.error_message) == (pb.FINISH_REASON_FAILED, kept)
    assert get_sequence(stub, seq_id).error_message == kept
    assert_still_serving(stub)


def test_a_64kib_error_message_of_nuls_is_escaped_and_cut(server, stub, failing):
    worker, seq_id, stream = failing
    _fail(server.channel, worker, seq_id, "\x00" * 65536)
    message = get_sequence(stub, seq_id).error_message
    assert "\x00" not in message and message.startswith("\\x00\\x00")
    assert len(message) <= 1000 and message.endswith("(65536 chars)")
    assert_still_serving(stub)


def test_an_error_message_that_is_not_utf8_is_refused_naming_it(server, stub, failing):
    worker, seq_id, _ = failing
    err = rpc_error(lambda: _fail(server.channel, worker, seq_id, NOT_UTF8))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "finished[0].error_message is not valid UTF-8" in err.details()
    assert get_sequence(stub, seq_id).state != pb.SEQUENCE_STATE_FINISHED, "nothing applied"
    worker.select(finished=[(seq_id, pb.FINISH_REASON_EOS, 1)], tokens={seq_id: [7]})
    assert get_sequence(stub, seq_id).finish_reason == pb.FINISH_REASON_EOS
    assert_still_serving(stub)
