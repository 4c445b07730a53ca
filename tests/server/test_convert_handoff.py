"""The server parses and writes the disaggregation fields: roles, transfer rates,
handoff instructions and results (docs/contract.md, "Prefill/decode disaggregation")."""

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import (
    Decision,
    HandoffDirection,
    HandoffInstruction,
    HandoffStatus,
    InvalidArgument,
    SamplingParams,
    SequenceSpec,
    WorkerRole,
)
from service.server import convert


def registration(**fields) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        worker_id="w", total_kv_pages=10, page_size=16, total_gdn_slots=2, **fields
    )


def test_a_worker_that_says_nothing_of_roles_runs_both():
    reg = convert.worker_registration(registration())
    assert (reg.role, reg.transfer_bytes_per_second, reg.handoff_address) == (
        WorkerRole.BOTH,
        0.0,
        "",
    )


def test_a_registration_carries_role_rate_and_address():
    reg = convert.worker_registration(
        registration(
            role=pb.WORKER_ROLE_PREFILL,
            transfer_bytes_per_second=12.5e9,
            handoff_address="10.0.0.5:7070",
        )
    )
    assert reg.role is WorkerRole.PREFILL
    assert reg.transfer_bytes_per_second == 12.5e9
    assert reg.handoff_address == "10.0.0.5:7070"


@pytest.mark.parametrize("rate", [-1.0, float("nan"), float("inf")])
def test_a_nonsense_transfer_rate_is_refused(rate):
    with pytest.raises(InvalidArgument, match="transfer_bytes_per_second"):
        convert.worker_registration(registration(transfer_bytes_per_second=rate))


def test_a_registration_carries_the_handoff_sizes():
    assert convert.worker_registration(registration()).handoff_bytes_per_token == 0.0
    reg = convert.worker_registration(
        registration(handoff_bytes_per_token=4096.0, handoff_fixed_bytes=1.5e6)
    )
    assert (reg.handoff_bytes_per_token, reg.handoff_fixed_bytes) == (4096.0, 1.5e6)


@pytest.mark.parametrize("name", ["handoff_bytes_per_token", "handoff_fixed_bytes"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_nonsense_handoff_size_is_refused(name, value):
    with pytest.raises(InvalidArgument, match=name):
        convert.worker_registration(registration(**{name: value}))


def test_an_unknown_role_is_refused():
    with pytest.raises(InvalidArgument, match="role must be"):
        convert.worker_registration(registration(role=9))


def test_a_report_carries_handoff_results():
    msg = pb.SelectBatchRequest(
        worker_id="d0",
        handoffs=[
            pb.HandoffResult(seq_id=3, transfer_id=77, status=pb.HANDOFF_STATUS_DONE),
            pb.HandoffResult(
                seq_id=4,
                transfer_id=78,
                status=pb.HANDOFF_STATUS_CHECKSUM_MISMATCH,
                error_message="page 12: crc32 0x1 != 0x2",
            ),
        ],
    )
    done, bad = convert.worker_report(msg).handoffs
    assert (done.seq_id, done.transfer_id, done.status) == (3, 77, HandoffStatus.DONE)
    assert bad.status is HandoffStatus.CHECKSUM_MISMATCH and "crc32" in bad.error_message


def test_a_report_with_an_unknown_handoff_status_is_refused():
    msg = pb.SelectBatchRequest(worker_id="d0", handoffs=[pb.HandoffResult(seq_id=3, status=42)])
    with pytest.raises(InvalidArgument, match=r"handoffs\[0\].status"):
        convert.worker_report(msg)


def test_a_report_without_handoffs_reads_as_before():
    assert convert.worker_report(pb.SelectBatchRequest(worker_id="w")).handoffs == ()


def test_a_report_carries_the_decision_it_applied_and_an_old_client_none():
    msg = pb.SelectBatchRequest(worker_id="w", applied_iteration=12)
    assert convert.worker_report(msg).applied_iteration == 12
    assert convert.worker_report(pb.SelectBatchRequest(worker_id="w")).applied_iteration == 0


def test_a_decision_carries_both_ends_of_a_handoff():
    spec = SequenceSpec((1, 2, 3, 42), 7, "", SamplingParams(), ())
    send = HandoffInstruction(3, HandoffDirection.SEND, 77, "d0", 3, 1, 5000)
    receive = HandoffInstruction(
        3, HandoffDirection.RECEIVE, 77, "p0", 3, 1, 5000, "10.0.0.5:7070", spec, 0
    )
    sent, received = convert.decision(Decision(handoffs=(send, receive))).handoffs
    assert sent.direction == pb.HANDOFF_DIRECTION_SEND and not sent.HasField("spec")
    assert received.direction == pb.HANDOFF_DIRECTION_RECEIVE
    assert received.peer_address == "10.0.0.5:7070"
    assert list(received.spec.prompt_token_ids) == [1, 2, 3, 42]
    assert (received.num_tokens, received.num_generated, received.deadline_ms) == (3, 1, 5000)


def test_a_decision_without_handoffs_is_byte_for_byte_as_before():
    assert convert.decision(Decision(decode=(1, 2))).SerializeToString() == (
        pb.SchedulerDecision(decode=[1, 2]).SerializeToString()
    )
