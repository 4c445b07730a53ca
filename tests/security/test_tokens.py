"""Bearer tokens with roles: who may call what, and tokens never leak."""

from __future__ import annotations

import io
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.logs import JsonFormatter, TextFormatter
from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.session import WorkerSessionStream

from .conftest import RPC_TIMEOUT_SECONDS

OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _generate_first_event(stub, request, timeout):
    call = stub.Generate(request, timeout=timeout)
    try:
        return next(iter(call))
    finally:
        call.cancel()


def _session_answer(stub, request, timeout):
    session = WorkerSessionStream(stub)
    try:
        return session.exchange(request, timeout)
    finally:
        session.close()


# One call per Scheduler RPC; worker calls name w1. Allowed calls may still fail on
# their merits (NOT_FOUND for an unknown seq_id): only the auth codes matter here.
CALLS = {
    "Submit": lambda s, t: s.Submit(
        pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=1), timeout=t
    ),
    "Cancel": lambda s, t: s.Cancel(pb.CancelRequest(seq_id=999), timeout=t),
    "GetSequence": lambda s, t: s.GetSequence(pb.GetSequenceRequest(seq_id=999), timeout=t),
    "Generate": lambda s, t: _generate_first_event(
        s, pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=1), t
    ),
    "GetStatus": lambda s, t: s.GetStatus(pb.GetStatusRequest(), timeout=t),
    "RegisterWorker": lambda s, t: s.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id="w1", total_kv_pages=64, page_size=16, total_gdn_slots=8
        ),
        timeout=t,
    ),
    "SelectBatch": lambda s, t: s.SelectBatch(
        pb.SelectBatchRequest(worker_id="w1", kv_free_pages=64, gdn_free_slots=8), timeout=t
    ),
    "WorkerSession": lambda s, t: _session_answer(
        s, pb.SelectBatchRequest(worker_id="w1", kv_free_pages=64, gdn_free_slots=8), t
    ),
    "DeregisterWorker": lambda s, t: s.DeregisterWorker(
        pb.DeregisterWorkerRequest(worker_id="w1"), timeout=t
    ),
    "DrainWorker": lambda s, t: s.DrainWorker(pb.DrainWorkerRequest(worker_id="w1"), timeout=t),
}
CLIENT_RPCS = {"Submit", "Cancel", "GetSequence", "Generate", "GetStatus"}
WORKER_RPCS = {"RegisterWorker", "SelectBatch", "WorkerSession", "DeregisterWorker"}
ADMIN_ONLY_RPCS = {"DrainWorker"}


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return OK


def _auth_outcome(stub, method: str) -> str:
    code = _code(lambda method=method, stub=stub: CALLS[method](stub, RPC_TIMEOUT_SECONDS))
    return {DENIED: "denied", UNAUTHENTICATED: "unauthenticated"}.get(code, "allowed")


@pytest.mark.parametrize(
    "role, allowed",
    [
        ("client", CLIENT_RPCS),
        ("w1", WORKER_RPCS),
        ("admin", CLIENT_RPCS | WORKER_RPCS | ADMIN_ONLY_RPCS),
    ],
)
def test_each_role_may_call_its_rpcs_and_is_denied_the_others(secure_server, tokens, role, allowed):
    server = secure_server()
    stub = server.stub(getattr(tokens, role))
    # Worker RPCs in order, so SelectBatch and DeregisterWorker follow a registration.
    outcomes = {m: _auth_outcome(stub, m) for m in CALLS}
    assert outcomes == {m: "allowed" if m in allowed else "denied" for m in CALLS}


def test_permission_denied_names_what_is_needed_without_echoing_the_token(secure_server, tokens):
    server = secure_server()
    with pytest.raises(grpc.RpcError) as err:
        CALLS["Submit"](server.stub(tokens.w1), RPC_TIMEOUT_SECONDS)
    assert err.value.code() is DENIED
    assert "needs a client or admin token" in err.value.details()
    assert tokens.w1 not in err.value.details()


@pytest.mark.parametrize("role", ["client", "w1"])
def test_drain_worker_is_admin_only_even_for_a_worker_draining_itself(secure_server, tokens, role):
    server = secure_server()
    register = pb.RegisterWorkerRequest(
        worker_id="w1", total_kv_pages=64, page_size=16, total_gdn_slots=8
    )
    server.stub(tokens.w1).RegisterWorker(register, timeout=RPC_TIMEOUT_SECONDS)
    with pytest.raises(grpc.RpcError) as err:
        CALLS["DrainWorker"](server.stub(getattr(tokens, role)), RPC_TIMEOUT_SECONDS)
    assert err.value.code() is DENIED
    assert "may not call DrainWorker; it needs an admin token" in err.value.details()
    status = server.stub(tokens.admin).GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
    assert [w.draining for w in status.workers] == [False]
    admin = server.stub(tokens.admin)
    assert CALLS["DrainWorker"](admin, RPC_TIMEOUT_SECONDS).num_assigned == 0
    status = admin.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
    assert [w.draining for w in status.workers] == [True]


@pytest.mark.parametrize("method", sorted(WORKER_RPCS))
def test_worker_token_bound_to_w1_cannot_act_as_w2(secure_server, tokens, method):
    server = secure_server()
    as_w2 = {
        "RegisterWorker": pb.RegisterWorkerRequest(
            worker_id="w2", total_kv_pages=64, page_size=16, total_gdn_slots=8
        ),
        "SelectBatch": pb.SelectBatchRequest(worker_id="w2", kv_free_pages=64, gdn_free_slots=8),
        "WorkerSession": pb.SelectBatchRequest(worker_id="w2", kv_free_pages=64, gdn_free_slots=8),
        "DeregisterWorker": pb.DeregisterWorkerRequest(worker_id="w2"),
    }[method]
    call = (
        _session_answer
        if method == "WorkerSession"
        else lambda stub, request, timeout: getattr(stub, method)(request, timeout=timeout)
    )
    with pytest.raises(grpc.RpcError) as err:
        call(server.stub(tokens.w1), as_w2, RPC_TIMEOUT_SECONDS)
    assert err.value.code() is DENIED
    assert "bound to worker_id 'w1'" in err.value.details()


def test_a_session_of_w1_is_refused_at_the_first_report_naming_w2(secure_server, tokens):
    server = secure_server()
    stub = server.stub(tokens.w1)
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id="w1", total_kv_pages=64, page_size=16, total_gdn_slots=8
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    session = WorkerSessionStream(stub)
    try:
        as_w1 = pb.SelectBatchRequest(worker_id="w1", kv_free_pages=64, gdn_free_slots=8)
        assert session.exchange(as_w1, RPC_TIMEOUT_SECONDS).iteration == 1
        with pytest.raises(grpc.RpcError) as err:
            session.exchange(pb.SelectBatchRequest(worker_id="w2"), RPC_TIMEOUT_SECONDS)
    finally:
        session.close()
    assert err.value.code() is DENIED
    assert "bound to worker_id 'w1'" in err.value.details()


def test_denial_of_an_absurd_worker_id_does_not_echo_it_whole(secure_server, tokens):
    server = secure_server()
    with pytest.raises(grpc.RpcError) as err:
        server.stub(tokens.w1).SelectBatch(
            pb.SelectBatchRequest(worker_id="x" * 100_000), timeout=RPC_TIMEOUT_SECONDS
        )
    assert err.value.code() is DENIED
    assert "(100000 characters)" in err.value.details()
    assert len(err.value.details()) < 300


def test_worker_w1_cannot_see_or_take_w2s_sequences(secure_server, tokens):
    server = secure_server()
    w2, w1 = server.stub(tokens.w2), server.stub(tokens.w1)
    w2.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id="w2", total_kv_pages=64, page_size=16, total_gdn_slots=8
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    seq_id = (
        server.stub(tokens.client)
        .Submit(
            pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        .seq_id
    )
    decision = w2.SelectBatch(
        pb.SelectBatchRequest(worker_id="w2", kv_free_pages=64, gdn_free_slots=8),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    assert [c.seq_id for c in decision.prefill] == [seq_id]
    # w1 may neither read the sequence nor report it finished (or lost) in w2's name.
    assert (
        _code(
            lambda: w1.GetSequence(
                pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS
            )
        )
        is DENIED
    )
    steal = pb.SelectBatchRequest(
        worker_id="w2",
        kv_free_pages=64,
        gdn_free_slots=8,
        finished=[pb.FinishedSequence(seq_id=seq_id, reason=pb.FINISH_REASON_EOS)],
    )
    assert _code(lambda: w1.SelectBatch(steal, timeout=RPC_TIMEOUT_SECONDS)) is DENIED
    info = server.stub(tokens.client).GetSequence(
        pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS
    )
    assert info.worker_id == "w2" and info.state != pb.SEQUENCE_STATE_FINISHED


@pytest.mark.parametrize(
    "metadata",
    [None, "Bearer not-a-known-token-at-all", "Basic dXNlcjpwYXNz", "Bearer "],
    ids=["missing", "unknown", "wrong-scheme", "empty"],
)
def test_missing_or_garbage_token_is_unauthenticated(secure_server, metadata):
    server = secure_server()
    stub = server.stub()
    md = (("authorization", metadata),) if metadata else None
    with pytest.raises(grpc.RpcError) as err:
        stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS, metadata=md)
    assert err.value.code() is UNAUTHENTICATED
    assert "Bearer" in err.value.details() or "not one this scheduler knows" in err.value.details()


def test_streaming_generate_without_a_token_is_unauthenticated(secure_server):
    server = secure_server()
    assert _code(lambda: CALLS["Generate"](server.stub(), RPC_TIMEOUT_SECONDS)) is UNAUTHENTICATED


def test_health_and_reflection_need_no_token(secure_server):
    server = secure_server()
    channel = server.channel()
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="lattice.scheduler.v1.Scheduler"),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "lattice.scheduler.v1.Scheduler" in names


def test_tokens_never_appear_in_logs_or_metrics(secure_server, tokens, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    server = secure_server()
    for token in tokens.all():
        stub = server.stub(token)
        for method in CALLS:
            _code(lambda method=method, stub=stub: CALLS[method](stub, RPC_TIMEOUT_SECONDS))
    _code(
        lambda: server.stub(tokens.client + "x").GetStatus(
            pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS
        )
    )
    assert any(r.getMessage() == "call refused" for r in caplog.records), "denials are logged"
    logged = io.StringIO()
    for formatter in (TextFormatter(), JsonFormatter()):
        for record in caplog.records:
            logged.write(formatter.format(record) + "\n")
    captured = capfd.readouterr()
    exposed = logged.getvalue() + captured.out + captured.err + server.scrape()
    for token in tokens.all():
        assert token not in exposed
