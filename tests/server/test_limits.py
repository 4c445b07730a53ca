"""Input limits against a real server: message size, strings and repeated fields.

Each limit answers with a status naming the field and the limit, and the rejected call
changes nothing. The limits are the named constants of service/server/convert.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import start
from service.server.convert import (
    MAX_ADAPTERS,
    MAX_REPORT_SEQ_IDS,
    MAX_REPORT_TOKENS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRING_BYTES,
)
from service.settings import DEFAULT_MAX_MESSAGE_BYTES, ServeSettings

from .conftest import LOOPBACK
from .wire import RPC_TIMEOUT_SECONDS, Worker, rpc_error, submit

INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_LONG = "x" * (MAX_STRING_BYTES + 1)
# 129 characters, 258 bytes: the limit counts UTF-8 bytes, not characters.
TOO_LONG_UTF8 = "é" * (MAX_STRING_BYTES // 2 + 1)


def queue_depth(stub) -> int:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).queue_depth


def workers(stub) -> list[str]:
    return [
        w.worker_id
        for w in stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers
    ]


def assert_names_limit(err: grpc.RpcError, *words: str) -> None:
    assert err.code() == INVALID, err.details()
    for word in words:
        assert word in err.details(), err.details()


# ===================================================================== strings


@pytest.mark.parametrize("field_name", ["request_id", "tenant", "adapter_id"])
@pytest.mark.parametrize("value", [TOO_LONG, TOO_LONG_UTF8], ids=["ascii", "utf8"])
def test_submit_string_over_the_limit_is_invalid_argument_naming_field_and_limit(
    stub, field_name, value
):
    err = rpc_error(lambda: submit(stub, **{field_name: value}))
    size = len(value.encode())
    assert_names_limit(err, f"{field_name} is {size} bytes; the limit is {MAX_STRING_BYTES}")
    assert queue_depth(stub) == 0


def test_generate_request_id_over_the_limit_is_invalid_argument(stub):
    call = stub.Generate(
        pb.SubmitRequest(prompt_token_ids=[1], max_new_tokens=1, request_id="r" * 5000),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    err = rpc_error(lambda: list(call))
    assert_names_limit(err, "request_id is 5000 bytes; the limit is 256")
    assert queue_depth(stub) == 0


def test_strings_of_exactly_the_limit_are_accepted(stub):
    at_limit, at_limit_utf8 = "x" * MAX_STRING_BYTES, "é" * (MAX_STRING_BYTES // 2)
    assert submit(stub, request_id=at_limit, tenant=at_limit_utf8).seq_id > 0
    worker = Worker(stub, at_limit)
    worker.register(adapters=(at_limit, at_limit_utf8))
    assert worker.select().iteration == 1


def test_register_worker_id_over_the_limit_is_invalid_argument(stub):
    err = rpc_error(lambda: Worker(stub, TOO_LONG).register())
    assert_names_limit(err, f"worker_id is {MAX_STRING_BYTES + 1} bytes")
    assert workers(stub) == []


def test_register_adapter_name_over_the_limit_is_invalid_argument_naming_its_index(stub):
    err = rpc_error(lambda: Worker(stub, "w1").register(adapters=("lora-a", TOO_LONG)))
    assert_names_limit(
        err, f"adapters[1] is {MAX_STRING_BYTES + 1} bytes", f"the limit is {MAX_STRING_BYTES}"
    )
    assert workers(stub) == []


@pytest.mark.parametrize(
    "rpc, request_type",
    [
        ("SelectBatch", pb.SelectBatchRequest),
        ("DeregisterWorker", pb.DeregisterWorkerRequest),
        ("DrainWorker", pb.DrainWorkerRequest),
    ],
)
def test_worker_id_over_the_limit_is_invalid_argument_on_every_worker_rpc(stub, rpc, request_type):
    call = getattr(stub, rpc)
    err = rpc_error(
        lambda: call(request_type(worker_id="w" * 100_000), timeout=RPC_TIMEOUT_SECONDS)
    )
    assert_names_limit(err, "worker_id is 100000 bytes; the limit is 256")
    assert len(err.details()) < 200, "the status must not echo the id"


# ===================================================================== repeated fields


def test_stop_token_ids_over_the_limit_are_invalid_argument(stub):
    assert submit(stub, stop_token_ids=[2] * MAX_STOP_TOKEN_IDS).seq_id > 0
    err = rpc_error(lambda: submit(stub, stop_token_ids=[2] * (MAX_STOP_TOKEN_IDS + 1)))
    assert_names_limit(
        err, f"stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} ids; the limit is {MAX_STOP_TOKEN_IDS}"
    )
    assert queue_depth(stub) == 1


def test_adapters_over_the_limit_are_invalid_argument(stub):
    names = [f"lora-{i}" for i in range(MAX_ADAPTERS + 1)]
    err = rpc_error(lambda: Worker(stub, "w1").register(adapters=names))
    assert_names_limit(err, f"adapters holds {MAX_ADAPTERS + 1} names; the limit is {MAX_ADAPTERS}")
    assert workers(stub) == []
    Worker(stub, "w1").register(adapters=names[:MAX_ADAPTERS])
    assert workers(stub) == ["w1"]


def test_select_batch_naming_too_many_seq_ids_in_all_is_rejected_and_not_applied(stub, worker):
    worker.register()
    seq_id = submit(stub).seq_id
    worker.select()
    quarter = MAX_REPORT_SEQ_IDS // 4
    # Over the limit only together: each field alone is well within it.
    err = rpc_error(
        lambda: worker.select(
            waiting=range(10**6, 10**6 + quarter),
            running=range(2 * 10**6, 2 * 10**6 + quarter),
            finished=[(3 * 10**6 + i, pb.FINISH_REASON_EOS) for i in range(quarter)],
            preempted=range(4 * 10**6, 4 * 10**6 + quarter + 1),
        )
    )
    assert_names_limit(
        err,
        "waiting, running, finished and preempted hold "
        f"{MAX_REPORT_SEQ_IDS + 1} seq ids in all; "
        f"the limit is {MAX_REPORT_SEQ_IDS}",
    )
    # Not applied: the sequence the report omitted was not taken as lost.
    info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)
    assert info.state == pb.SEQUENCE_STATE_PREFILLING
    assert worker.select(waiting=[seq_id]).iteration == 2


@pytest.mark.parametrize(
    "updates, words",
    [
        ({1: [5] * (MAX_REPORT_TOKENS + 1)}, f"tokens carry {MAX_REPORT_TOKENS + 1} token ids"),
        (
            {i: [] for i in range(MAX_REPORT_TOKENS + 1)},
            f"tokens holds {MAX_REPORT_TOKENS + 1} updates",
        ),
    ],
    ids=["token-ids", "updates"],
)
def test_select_batch_with_too_many_tokens_is_invalid_argument(stub, worker, updates, words):
    worker.register()
    err = rpc_error(lambda: worker.select(tokens=updates))
    assert_names_limit(err, words, f"the limit is {MAX_REPORT_TOKENS}")


# ===================================================================== message size


@pytest.fixture
def start_with_settings(server_stoppers) -> Iterator:
    """Factory: a scheduler with these ServeSettings overrides, and a stub to it."""
    running_servers, channels = [], []

    def factory(**overrides) -> pb_grpc.SchedulerStub:
        settings = ServeSettings(host=LOOPBACK, port=0, metrics_port=0, **overrides).validate()
        running_servers.append(start(settings, CollectorRegistry()))
        channels.append(grpc.insecure_channel(f"{LOOPBACK}:{running_servers[-1].port}"))
        return pb_grpc.SchedulerStub(channels[-1])

    yield factory
    for channel in channels:
        channel.close()
    for running in running_servers:  # stopped on threads, as in conftest.start_server
        stopper = threading.Thread(target=running.stop, args=(0.0,), name="stop-test-server")
        stopper.start()
        server_stoppers.append(stopper)


def test_message_over_max_message_bytes_is_resource_exhausted_and_the_server_carries_on(
    start_with_settings,
):
    stub = start_with_settings(max_message_bytes=64 * 1024)
    # Token ids of 1_000_000 take 3 bytes each on the wire: about 90 KiB.
    err = rpc_error(lambda: submit(stub, prompt=[1_000_000] * 30_000))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(64 * 1024) in err.details()
    assert submit(stub, prompt=[1_000_000] * 1000).queue_position == 0
    assert queue_depth(stub) == 1


def test_default_max_message_bytes_is_grpcs_four_mib(stub):
    assert DEFAULT_MAX_MESSAGE_BYTES == 4 * 1024 * 1024
    over = rpc_error(lambda: submit(stub, request_id="r" * DEFAULT_MAX_MESSAGE_BYTES))
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(DEFAULT_MAX_MESSAGE_BYTES) in over.details()
    # Below it, the message reaches the service, whose own string limit answers.
    under = rpc_error(lambda: submit(stub, request_id="r" * (3 * 1024 * 1024)))
    assert_names_limit(under, f"request_id is {3 * 1024 * 1024} bytes")
    assert queue_depth(stub) == 0


# ===================================================================== decisions fit


@pytest.mark.parametrize("policy", ["fifo", "budget", "fair"])
def test_a_decision_never_exceeds_the_message_limit_and_the_rest_waits(start_with_settings, policy):
    # The outside probe: a worker of max_batch_size 512 and 400 queued 4,000-token
    # prompts got a 4.8 MB decision on every call, which its channel refused (4 MiB).
    stub = start_with_settings(
        scheduler=SchedulerConfig(policy=policy, max_batch_size=512, max_num_batched_tokens=10**7)
    )
    worker = Worker(stub, "big")
    worker.register(max_batch_size=512, total_kv_pages=10**6, total_gdn_slots=512)
    prompt = [1_000_000 + i for i in range(4000)]  # 3 bytes a token id on the wire
    for _ in range(400):
        submit(stub, prompt=prompt, max_new_tokens=8)
    held, rounds = [], 0
    while queue_depth(stub) and rounds < 10:
        decision = worker.select(waiting=held, kv_free_pages=10**6, gdn_free_slots=512)
        assert decision.ByteSize() <= DEFAULT_MAX_MESSAGE_BYTES
        held += [c.seq_id for c in decision.prefill if c.HasField("spec")]
        rounds += 1
    assert len(held) == 400 and rounds >= 2
