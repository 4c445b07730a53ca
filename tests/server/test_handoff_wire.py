"""Handoffs over the wire: fake workers registered as prefill and decode speak the proto
to a real server (docs/contract.md, "Prefill/decode disaggregation")."""

from __future__ import annotations

import threading

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import RPC_TIMEOUT_SECONDS, admitted, get_sequence, submit

LONG = 1100
FIRST = 42
CONFIG = {"chunk_size": 2048}


def register(stub, worker_id: str, role: int) -> None:
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id=worker_id,
            total_kv_pages=1000,
            page_size=16,
            total_gdn_slots=64,
            role=role,
            transfer_bytes_per_second=1e9,
            handoff_address=f"{worker_id}.local:7000",
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )


def select(stub, worker_id: str, **fields) -> pb.SchedulerDecision:
    fields.setdefault("kv_free_pages", 1000)
    fields.setdefault("gdn_free_slots", 64)
    return stub.SelectBatch(
        pb.SelectBatchRequest(worker_id=worker_id, **fields), timeout=RPC_TIMEOUT_SECONDS
    )


def fleet(stub) -> None:
    register(stub, "p0", pb.WORKER_ROLE_PREFILL)
    for worker_id in ("d0", "d1"):
        register(stub, worker_id, pb.WORKER_ROLE_DECODE)
    for worker_id in ("p0", "d0", "d1"):
        select(stub, worker_id)


def prefilled(stub) -> tuple[int, pb.Handoff]:
    seq_id = submit(stub, prompt=range(1, LONG + 1), max_new_tokens=8).seq_id
    assert admitted(select(stub, "p0")) == [seq_id]
    first = pb.TokenUpdate(seq_id=seq_id, token_ids=[FIRST], offset=0)
    decision = select(stub, "p0", running=[seq_id], tokens=[first])
    assert list(decision.decode) == []
    (send,) = decision.handoffs
    return seq_id, send


@pytest.mark.parametrize("server", [CONFIG], indirect=True)
def test_a_handoff_end_to_end_on_the_wire_with_its_metrics(server):
    stub = server.stub
    fleet(stub)
    seq_id, send = prefilled(stub)
    assert send.direction == pb.HANDOFF_DIRECTION_SEND and send.peer_worker_id == "d0"
    (receive,) = select(stub, "d0").handoffs
    assert receive.direction == pb.HANDOFF_DIRECTION_RECEIVE
    assert receive.transfer_id == send.transfer_id
    assert receive.peer_address == "p0.local:7000"
    assert list(receive.spec.prompt_token_ids) == [*range(1, LONG + 1), FIRST]
    assert (receive.num_tokens, receive.num_generated) == (LONG, 1)

    done = pb.HandoffResult(
        seq_id=seq_id,
        transfer_id=send.transfer_id,
        status=pb.HANDOFF_STATUS_DONE,
        num_bytes=123_456,
        transfer_us=4_000,
    )
    decision = select(stub, "d0", running=[seq_id], handoffs=[done])
    assert decision.decode_all_running or list(decision.decode) == [seq_id]
    assert get_sequence(stub, seq_id).worker_id == "d0"
    assert list(select(stub, "p0", running=[seq_id]).evict) == [seq_id]
    second = pb.TokenUpdate(seq_id=seq_id, token_ids=[43], offset=1)
    select(stub, "d0", running=[seq_id], tokens=[second])
    assert get_sequence(stub, seq_id).generated_tokens == 2

    assert server.metric("handoffs_started_total") == 1
    assert server.metric("handoffs_total", end="done") == 1
    receiver = {"worker_id": "d0", "side": "receiver"}
    assert server.metric("worker_handoff_bytes_total", **receiver) == 123_456
    assert server.metric("worker_handoff_seconds_total", **receiver) == pytest.approx(0.004)
    computed = {"worker_id": "p0", "source": "computed"}
    assert server.metric("worker_prefill_tokens_total", **computed) == LONG


@pytest.mark.parametrize("server", [CONFIG], indirect=True)
def test_a_result_for_an_unknown_transfer_is_evicted_on_the_wire(server):
    stub = server.stub
    fleet(stub)
    seq_id, send = prefilled(stub)
    stray = pb.HandoffResult(
        seq_id=seq_id, transfer_id=send.transfer_id + 7, status=pb.HANDOFF_STATUS_DONE
    )
    assert list(select(stub, "d1", handoffs=[stray]).evict) == [seq_id]
    assert get_sequence(stub, seq_id).worker_id == "p0"


@pytest.mark.parametrize("server", [CONFIG], indirect=True)
def test_a_receiver_parked_on_a_long_poll_wakes_for_its_receive(server):
    stub = server.stub
    fleet(stub)
    answers: list[pb.SchedulerDecision] = []
    parked = threading.Thread(
        target=lambda: answers.append(select(stub, "d0", idle_wait_ms=4_000)), daemon=True
    )
    parked.start()
    seq_id = submit(stub, prompt=range(1, LONG + 1), max_new_tokens=8).seq_id
    assert admitted(select(stub, "p0")) == [seq_id]
    first = pb.TokenUpdate(seq_id=seq_id, token_ids=[FIRST], offset=0)
    decision = select(stub, "p0", running=[seq_id], tokens=[first])
    parked.join(RPC_TIMEOUT_SECONDS)
    (send,) = decision.handoffs
    assert send.peer_worker_id == "d0"
    (answer,) = answers
    (receive,) = answer.handoffs
    assert receive.transfer_id == send.transfer_id
