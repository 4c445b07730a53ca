"""Principals on PostgreSQL replicas: the principal is saved with the
sequence, request_id is unique per principal, and a Cancel, GetSequence or Generate
re-attach on another replica than the one submitted to sees only the principal's own,
and a stream relayed from the owner replica is followed with its client's own token.
Also the schema change this needs (version 2), from a version 1 database.
"""

from __future__ import annotations

import secrets

import grpc
import psycopg
import pytest

from common.credentials import open_channel
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SEES_ALL, Caller, ConfigError, NotFound
from service.state.postgres import SCHEMA_VERSION, PostgresState
from tests.server.wire import RPC_TIMEOUT_SECONDS as T
from tests.server.wire import Stream, Worker, admitted
from tests.unit.factories import params

from .conftest import start_replica

ALICE, MALLORY = Caller("alice"), Caller("mallory")
QUEUED = pb.SequenceState.Value("SEQUENCE_STATE_QUEUED")


@pytest.fixture
def store(database_url):
    state = PostgresState(database_url, name="a")
    yield state
    state.close()


def test_request_id_is_unique_per_principal_in_the_shared_queue(store):
    alice = store.submit(params(request_id="r1", principal="alice"), 1000, 0).seq_id
    mallory = store.submit(params(request_id="r1", principal="mallory"), 1000, 0).seq_id
    assert alice != mallory
    assert store.submit(params(request_id="r1", principal="alice"), 1000, 0).seq_id == alice
    assert store.queue_depth() == 2


def test_another_principals_sequence_is_not_found_in_the_database(store):
    seq_id = store.submit(params(principal="alice"), 1000, 0).seq_id
    calls = (
        lambda s, c: store.sequence_info(s, c),
        lambda s, c: store.read_output(s, 0, c),
        lambda s, c: store.cancel(s, c),
    )
    for call in calls:
        with pytest.raises(NotFound) as theirs:
            call(seq_id, MALLORY)
        with pytest.raises(NotFound) as unknown:
            call(seq_id + 100, MALLORY)
        assert str(theirs.value) == str(unknown.value).replace(str(seq_id + 100), str(seq_id))
    assert store.sequence_info(seq_id, ALICE).seq_id == seq_id
    assert store.sequence_info(seq_id, SEES_ALL).seq_id == seq_id
    assert store.cancel(seq_id, ALICE)


def test_a_version_1_database_is_migrated_and_its_sequences_are_anonymous(database_url):
    first = PostgresState(database_url, name="a")
    old = first.submit(params(request_id="old", adapter_id="lora-x"), 1000, 0).seq_id
    first.leave()  # no replica of the old version runs during the migration
    first.close()
    with psycopg.connect(database_url, autocommit=True) as conn:  # back to version 1
        conn.execute("DROP TABLE token_log")  # version 3 added it
        conn.execute("DROP INDEX sequences_request")
        conn.execute(
            "DROP FUNCTION lattice_submit(text, text, text, text, bytea, integer, "
            "text, integer, bigint, bigint, boolean)"
        )
        conn.execute("ALTER TABLE sequences DROP COLUMN principal")
        conn.execute("ALTER TABLE sequences DROP COLUMN adapter_id")
        conn.execute(
            "ALTER TABLE sequences ADD CONSTRAINT sequences_request_id_key UNIQUE (request_id)"
        )
        conn.execute(
            "CREATE FUNCTION lattice_submit(p_request_id text, p_params text, "
            "p_prompt bytea, p_priority integer, p_tenant text, p_max_new_tokens "
            "integer, p_max_queue bigint, p_max_per_tenant bigint, p_sync boolean, "
            "OUT status integer, OUT seq_id bigint, OUT queue_position bigint) "
            "LANGUAGE sql AS $$ SELECT 0, 0::bigint, 0::bigint $$"
        )
        conn.execute("UPDATE lattice_meta SET value = 1 WHERE key = 'schema_version'")
    migrated = PostgresState(database_url, name="b")
    try:
        assert migrated.submit(params(request_id="old"), 1000, 0).seq_id == old
        assert migrated.submit(params(request_id="old", principal="alice"), 1000, 0).seq_id != old
        with pytest.raises(NotFound):
            migrated.sequence_info(old, ALICE)
        with psycopg.connect(database_url) as conn:
            assert conn.execute(
                "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
            ).fetchone() == (SCHEMA_VERSION,)
            assert conn.execute(
                "SELECT count(*) FROM pg_proc WHERE proname = 'lattice_submit'"
            ).fetchone() == (1,)
            # The adapter of a sequence saved before the column is copied out of params.
            assert conn.execute(
                "SELECT adapter_id FROM sequences WHERE seq_id = %s", (old,)
            ).fetchone() == ("lora-x",)
    finally:
        migrated.close()


@pytest.fixture
def tokens_file(tmp_path):
    values = {name: f"{name}-{secrets.token_urlsafe(24)}" for name in ("alice", "mallory", "admin")}
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\ntoken = "{values["alice"]}"\nrole = "client"\nname = "alice"\n\n'
        f'[[tokens]]\ntoken = "{values["mallory"]}"\nrole = "client"\nname = "mallory"\n\n'
        f'[[tokens]]\ntoken = "{values["admin"]}"\nrole = "admin"\n'
    )
    return path, values


def _stub(server, token: str) -> pb_grpc.SchedulerStub:
    return pb_grpc.SchedulerStub(open_channel(server.target, None, token))


def test_across_replicas_a_client_sees_and_cancels_only_its_own(database_url, tokens_file):
    path, token = tokens_file
    servers = [start_replica(database_url, auth_tokens=str(path)) for _ in range(2)]
    try:
        a, b = servers
        alice_a, alice_b = _stub(a, token["alice"]), _stub(b, token["alice"])
        mallory_b, admin_b = _stub(b, token["mallory"]), _stub(b, token["admin"])
        seq_id = alice_a.Submit(
            pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=2, request_id="alice-req-1"),
            timeout=T,
        ).seq_id
        for call in (
            lambda: mallory_b.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T),
            lambda: mallory_b.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=T),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.NOT_FOUND
            assert err.value.details() == (
                f"seq_id {seq_id} is unknown (never submitted, or long finished)"
            )
        stream = mallory_b.Generate(
            pb.SubmitRequest(prompt_token_ids=[9], max_new_tokens=2, request_id="alice-req-1"),
            timeout=T,
        )
        theirs = next(iter(stream)).seq_id
        stream.cancel()
        assert theirs != seq_id
        assert (
            alice_b.Submit(
                pb.SubmitRequest(
                    prompt_token_ids=[1, 2], max_new_tokens=2, request_id="alice-req-1"
                ),
                timeout=T,
            ).seq_id
            == seq_id
        )
        info = alice_b.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T)
        assert info.state == QUEUED and info.finish_reason == 0
        assert admin_b.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=T).seq_id
        assert alice_b.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=T).cancelled
    finally:
        for server in servers:
            server.stop()


def test_a_version_2_database_is_not_migrated_while_a_version_2_replica_runs(database_url):
    old = PostgresState(database_url, name="a")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE lattice_meta SET value = 2 WHERE key = 'schema_version'")
    try:
        with pytest.raises(ConfigError, match="stop every version-2 replica"):
            PostgresState(database_url, name="b")
    finally:
        old.leave()
        old.close()
    migrated = PostgresState(database_url, name="b")
    try:
        with psycopg.connect(database_url) as conn:
            assert conn.execute(
                "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
            ).fetchone() == (SCHEMA_VERSION,)
    finally:
        migrated.close()


def test_a_relayed_stream_is_followed_as_its_client_and_no_one_else(database_url, tokens_file):
    # Alice's stream on b of a sequence a owns is relayed from a with alice's own token;
    # mallory following it on a is told only what a replica that does not own it says.
    path, token = tokens_file
    servers = [start_replica(database_url, auth_tokens=str(path)) for _ in range(2)]
    try:
        a, b = servers
        worker = Worker(_stub(a, token["admin"]), "w")
        worker.register()
        stream = Stream(
            _stub(b, token["alice"]), pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=3)
        )
        seq_id = stream.next_event().seq_id
        wait_until(lambda: admitted(worker.select()) == [seq_id], "admission on a", 10)
        worker.select(running=[seq_id], tokens={seq_id: [7, 8]})
        assert stream.tokens_until(2, 10) == [7, 8]
        # Mallory is told what a replica that does not own it would say: nothing about
        # whose it is or where it runs.
        details = []
        for follow in (pb.FollowSequenceRequest(seq_id=seq_id), pb.FollowSequenceRequest()):
            with pytest.raises(grpc.RpcError) as err:
                list(_stub(a, token["mallory"]).FollowSequence(follow, timeout=T))
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            details.append(err.value.details().replace(f"seq_id {follow.seq_id};", "seq_id N;"))
        assert details[0] == details[1]
        worker.select(tokens={seq_id: [9]}, finished=[(seq_id, pb.FINISH_REASON_EOS, 3)])
        assert [t for e in stream.rest(10) for t in e.token_ids] == [9]
        assert b.metric("replica_follows_total", outcome="finished") == 1
    finally:
        for server in servers:
            server.stop()
