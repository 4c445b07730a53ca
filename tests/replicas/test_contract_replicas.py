"""The wire contract suite (tests/server/test_contract.py), run against each of two
replicas sharing one PostgreSQL database: every test talks to one replica while the
other runs beside it on the same database."""

from __future__ import annotations

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

# The fake-worker fixtures, here on the replica's `stub` below.
from tests.server.conftest import make_worker, worker  # noqa: F401
from tests.server.test_contract import *  # noqa: F403 - the same tests, re-collected
from tests.server.test_contract import queue_depth, submit, submit_many
from tests.server.wire import RPC_TIMEOUT_SECONDS


@pytest.fixture(params=[0, 1], ids=["replica0", "replica1"])
def replica_index(request) -> int:
    return request.param


@pytest.fixture
def start_server(start_replicas):
    """The contract suite's factory: a deployment of two replicas, the first returned."""

    def factory(state_dir: str = "", **config):
        assert not state_dir, "replicas keep their state in PostgreSQL"
        return start_replicas(2, **config)[0]

    return factory


@pytest.fixture
def server(request, start_replicas, replica_index):
    return start_replicas(2, **getattr(request, "param", {}))[replica_index]


@pytest.fixture
def stub(server):
    return server.stub


# Replaces the suite's test of the same name: on a replica the queue_depth gauge counts
# its local queue (claimed, not yet admitted), so the shared queue's depth that the
# original follows is GetStatus's queue_depth (docs/replicas.md).
def test_metric_queue_depth_follows_submit_admission_and_cancel(stub, worker):
    assert queue_depth(stub) == 0
    ids = submit_many(stub, 3)
    assert queue_depth(stub) == 3
    worker.register(max_batch_size=2)
    worker.select()
    assert queue_depth(stub) == 1
    stub.Cancel(pb.CancelRequest(seq_id=ids[2]), timeout=RPC_TIMEOUT_SECONDS)
    assert queue_depth(stub) == 0
    worker.select(draining=True)  # both lost: back in the queue
    assert queue_depth(stub) == 2


# Replaces the suite's test of the same name: a replica streams only sequences it owns,
# and cannot tell an unknown one from another replica's without reading the database.
def test_follow_sequence_of_an_unknown_seq_id_is_not_found(stub):
    seq_id = submit(stub).seq_id
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id + 100), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
