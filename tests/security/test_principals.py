"""Sequences belong to who submitted them: with tokens on, a client
token's principal scopes request_id, and Cancel, GetSequence and a Generate re-attach see
only that principal's sequences; admin sees all; a token bound to a tenant submits as it.
"""

from __future__ import annotations

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .conftest import RPC_TIMEOUT_SECONDS

T = RPC_TIMEOUT_SECONDS
QUEUED = pb.SequenceState.Value("SEQUENCE_STATE_QUEUED")
FINISHED = pb.SequenceState.Value("SEQUENCE_STATE_FINISHED")
UNKNOWN_SEQ_ID = 999_999


def _submit(stub, request_id: str = "", **fields) -> int:
    return stub.Submit(
        pb.SubmitRequest(
            prompt_token_ids=[1, 2, 3], max_new_tokens=4, request_id=request_id, **fields
        ),
        timeout=T,
    ).seq_id


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details().replace(str(UNKNOWN_SEQ_ID), "<id>")


def _not_found_as_unknown(call_with_id, seq_id: int) -> None:
    """`call_with_id(seq_id)` fails exactly as it does for an id never handed out."""
    code, details = _refusal(lambda: call_with_id(seq_id))
    unknown_code, unknown_details = _refusal(lambda: call_with_id(UNKNOWN_SEQ_ID))
    assert code is grpc.StatusCode.NOT_FOUND and unknown_code is grpc.StatusCode.NOT_FOUND
    assert details.replace(str(seq_id), "<id>") == unknown_details


def test_another_client_cannot_get_or_cancel_a_sequence_and_learns_nothing(secure_server, tokens):
    server = secure_server()
    alice, mallory = server.stub(tokens.client), server.stub(tokens.client2)
    seq_id = _submit(alice, "alice-req-1")
    _not_found_as_unknown(
        lambda s: mallory.GetSequence(pb.GetSequenceRequest(seq_id=s), timeout=T), seq_id
    )
    _not_found_as_unknown(lambda s: mallory.Cancel(pb.CancelRequest(seq_id=s), timeout=T), seq_id)
    info = alice.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T)
    assert info.state == QUEUED, "mallory's cancel must not have touched it"
    assert alice.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=T).cancelled


def test_a_generate_with_another_clients_request_id_is_a_new_sequence_of_its_own(
    secure_server, tokens
):
    server = secure_server()
    alice, mallory = server.stub(tokens.client), server.stub(tokens.client2)
    seq_id = _submit(alice, "alice-req-1")
    stream = mallory.Generate(
        pb.SubmitRequest(prompt_token_ids=[9], max_new_tokens=2, request_id="alice-req-1"),
        timeout=T,
    )
    first = next(iter(stream))
    stream.cancel()  # mallory leaves: that cancels mallory's sequence, not alice's
    assert first.seq_id != seq_id and not first.token_ids
    assert _submit(alice, "alice-req-1") == seq_id, "alice still re-attaches to her own"
    info = alice.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T)
    assert info.state == QUEUED and info.finish_reason == 0
    _not_found_as_unknown(
        lambda s: alice.GetSequence(pb.GetSequenceRequest(seq_id=s), timeout=T), first.seq_id
    )


def test_two_unnamed_client_tokens_are_two_principals(secure_server, tokens):
    server = secure_server()
    one, two = server.stub(tokens.unnamed1), server.stub(tokens.unnamed2)
    seq_id = _submit(one, "same-id")
    assert _submit(two, "same-id") != seq_id
    assert _submit(one, "same-id") == seq_id
    _not_found_as_unknown(
        lambda s: two.GetSequence(pb.GetSequenceRequest(seq_id=s), timeout=T), seq_id
    )


def test_admin_sees_and_cancels_every_principals_sequences(secure_server, tokens):
    server = secure_server()
    alice, admin = server.stub(tokens.client), server.stub(tokens.admin)
    seq_id = _submit(alice, "alice-req-1")
    assert admin.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T).state == QUEUED
    assert admin.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=T).cancelled
    info = alice.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T)
    assert info.state == FINISHED
    # Admin's own request_ids are its own: it does not re-attach to alice's.
    assert _submit(admin, "alice-req-1") != seq_id


def test_a_token_bound_to_a_tenant_submits_as_that_tenant_whatever_it_writes(secure_server, tokens):
    server = secure_server(max_queue_per_tenant=1)
    acme, alice = server.stub(tokens.tenanted), server.stub(tokens.client)
    _submit(acme, tenant="someone-else")
    code, details = _refusal(lambda: _submit(acme, tenant="yet-another"))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'acme'" in details
    # An unbound token's tenant is the request's: "someone-else" has nothing queued.
    _submit(alice, tenant="someone-else")


def test_without_tokens_every_client_is_one_principal_as_before(secure_server):
    server = secure_server(auth=False)
    one, two = server.stub(), server.stub()
    seq_id = _submit(one, "shared-id")
    assert _submit(two, "shared-id") == seq_id
    assert two.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T).state == QUEUED
    assert two.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=T).cancelled
