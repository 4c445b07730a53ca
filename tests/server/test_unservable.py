"""A sequence whose adapter no registered worker has says so on one
scheduler too: GetSequence's error_message, and lattice_scheduler_unservable_queued."""

from __future__ import annotations

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.server.wire import RPC_TIMEOUT_SECONDS, get_sequence


def test_a_sequence_no_worker_can_serve_says_so_until_a_worker_with_its_adapter_joins(
    server, make_worker
):
    make_worker("plain").register()
    seq_id = server.stub.Submit(
        pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=2, adapter_id="lora-x"),
        timeout=RPC_TIMEOUT_SECONDS,
    ).seq_id
    assert "'lora-x'" in get_sequence(server.stub, seq_id).error_message
    wait_until(lambda: server.metric("unservable_queued") == 1, "the gauge", 10)
    make_worker("lora").register(adapters=("lora-x",))
    assert get_sequence(server.stub, seq_id).error_message == ""
    wait_until(lambda: server.metric("unservable_queued") == 0, "the gauge to clear", 10)
