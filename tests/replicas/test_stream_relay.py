"""A Generate stream of a sequence another replica owns, relayed from that replica
(FollowSequence, `--replica-streams owner`) instead of read from the database after each
of its commits (`database`); and what happens when the owner goes away mid-stream."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.replicas import servicer as replica_servicer
from service.replicas.peers import IDLE_SECONDS, Peers
from tests.server.wire import Stream, Worker, admit_until, admitted, get_sequence, submit
from worker_client.client import NotRegistered, RetryPolicy, SchedulerClient, WorkerResources

from .conftest import crash, stream_across

EOS = pb.FINISH_REASON_EOS
DECODING = pb.SEQUENCE_STATE_DECODING


def _follows(server, outcome: str) -> float:
    return server.metric("replica_follows_total", outcome=outcome) or 0.0


def _running_on(server) -> tuple[Worker, int]:
    """A worker of `server` running a new sequence submitted there: (the worker, its id)."""
    worker = Worker(server.stub, "w")
    worker.register()
    seq_id = submit(server.stub, max_new_tokens=8).seq_id
    wait_until(lambda: admitted(worker.select()) == [seq_id], "admission", 10)
    return worker, seq_id


@pytest.mark.parametrize("mode", ["owner", "database"])
def test_a_stream_of_another_replicas_sequence_is_relayed_not_read_at_each_commit(
    start_replicas, mode
):
    # 21 steps of one token, each its own commit on r0; a stream of that sequence on r1.
    # Relayed, r1 reads the database only until it knows the owner; reading the database,
    # it reads again after each of r0's commits. Either way no commit notifies (a NOTIFY
    # wakes every replica's listener): each step's token, the first (with the
    # admission's change) and the finish arrive well before the stream's one-second poll
    # would fetch them, 22 steps in far less than 22 s.
    r0, r1 = start_replicas(2, replica_streams=mode)
    worker, stream, seq_id, reads = stream_across(r0, r1)
    started = time.monotonic()
    for n in range(21):
        worker.select(running=[seq_id], tokens={seq_id: [100 + n]})
        assert stream.tokens_until(1, 10) == [100 + n]
    took = time.monotonic() - started
    time.sleep(1.5)  # the owner's heartbeats (empty events) reach no client
    worker.select(tokens={seq_id: [121]}, finished=[(seq_id, EOS, 22)])
    events = stream.rest(10)
    assert [list(e.token_ids) for e in events] == [[121]]
    assert events[-1].finished and events[-1].finish_reason == EOS
    assert took < 8.0
    if mode == "owner":
        assert reads[0] <= 4, reads[0]  # before the claim, and the one that found the owner
        assert _follows(r1, "finished") == 1
    else:
        assert reads[0] >= 21, reads[0]
        assert _follows(r1, "finished") == 0


def _logprob(value: float) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=value, top_token_ids=[9], top_logprobs=[value])


@pytest.mark.parametrize("mode", ["owner", "database"])
def test_the_owners_streams_carry_logprobs_and_a_read_of_the_database_none(start_replicas, mode):
    # The owner holds the logprobs its worker reported (they are not persisted): its own
    # stream, and a stream on another replica relayed from it, carry them; a stream that
    # reads the database gets the same tokens without.
    r0, r1 = start_replicas(2, replica_streams=mode)
    worker = Worker(r0.stub, "w")
    worker.register()
    asking = pb.SamplingParams(logprobs=1, prompt_logprobs=1)
    request = pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, sampling=asking)
    local, remote = Stream(r0.stub, request), Stream(r1.stub, request)
    ids = [local.next_event().seq_id, remote.next_event().seq_id]
    assert sorted(admit_until(worker, 2)) == sorted(ids)
    if mode == "owner":  # r1 follows r0 before any token is committed
        wait_until(lambda: r0.metric("streams_open", kind="generate") == 2, "r1's follow", 10)
    for n, value in enumerate((-0.5, -0.25)):
        updates = [
            pb.TokenUpdate(
                seq_id=seq_id,
                token_ids=[100 + n],
                logprobs=[_logprob(value)],
                prompt_logprobs=[_logprob(-1.0), _logprob(-2.0)] if n == 0 else [],
            )
            for seq_id in ids
        ]
        worker.send(pb.SelectBatchRequest(worker_id="w", running=ids, tokens=updates))
    worker.select(finished=[(seq_id, EOS, 2) for seq_id in ids])
    for stream, carries in ((local, True), (remote, mode == "owner")):
        events = [e for e in stream.rest(10) if e.token_ids]
        assert [t for e in events for t in e.token_ids] == [100, 101]
        logprobs = [lp.logprob for e in events for lp in e.logprobs]
        prompt = [lp.logprob for e in events for lp in e.prompt_logprobs]
        if carries:
            assert (logprobs, prompt) == ([-0.5, -0.25], [-1.0, -2.0])
            assert list(events[0].logprobs[0].top_token_ids) == [9]
        else:
            assert (logprobs, prompt) == ([], [])


def test_follow_sequence_streams_only_what_the_owner_holds_and_cancels_nothing(start_replicas):
    r0, r1 = start_replicas(2)
    worker, seq_id = _running_on(r0)
    worker.select(running=[seq_id], tokens={seq_id: [5, 6]})
    # r1 does not own it: FAILED_PRECONDITION, whatever the database says.
    with pytest.raises(grpc.RpcError) as refused:
        list(r1.stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id), timeout=5))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"does not own seq_id {seq_id}" in refused.value.details()
    # r0 does: from `start` on, committed tokens only.
    call = r0.stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id, start=1), timeout=10)
    first = next(call)
    assert (first.seq_id, list(first.token_ids), first.finished) == (seq_id, [6], False)
    call.cancel()  # the follower leaves: the sequence runs on
    time.sleep(0.2)
    worker.select(running=[seq_id], tokens={seq_id: [7]})
    assert get_sequence(r0.stub, seq_id).state == DECODING
    # A follow of a finished sequence ends with its last event.
    worker.select(tokens={seq_id: [8]}, finished=[(seq_id, EOS, 4)])
    events = list(r0.stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id), timeout=10))
    assert [t for e in events for t in e.token_ids] == [5, 6, 7, 8]
    assert events[-1].finished and events[-1].finish_reason == EOS


def test_a_follow_ends_as_soon_as_its_sequence_moves_not_at_the_next_keep_alive(
    start_replicas, monkeypatch
):
    # The worker registers on r1, which adopts what it holds; r0 hears of it (a disown)
    # and its follow of that sequence ends FAILED_PRECONDITION at once, not when its wait
    # for new tokens runs out (made 5 s here, so that the two cannot be confused).
    monkeypatch.setattr(replica_servicer, "_REMOTE_POLL_SECONDS", 5.0)
    r0, r1 = start_replicas(2)
    worker, seq_id = _running_on(r0)
    call = r0.stub.FollowSequence(pb.FollowSequenceRequest(seq_id=seq_id), timeout=20)
    time.sleep(0.3)  # the follow waits for tokens
    started = time.monotonic()
    Worker(r1.stub, "w").register()
    with pytest.raises(grpc.RpcError) as moved:
        next(call)
    took = time.monotonic() - started
    assert moved.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert took < 2.5, took
    assert get_sequence(r1.stub, seq_id).worker_id == "w"


def test_a_relayed_stream_survives_its_owner_crashing_with_no_token_lost_or_twice(
    start_replicas,
):
    r0, r1 = start_replicas(2)
    client = SchedulerClient(
        f"{r0.target},{r1.target}", call_timeout_seconds=2.0, retry=RetryPolicy(0.05, 0.2, 20.0)
    )
    resources = WorkerResources("w", 1000, 16, 64)
    client.register(resources)
    stream = Stream(r1.stub, pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8))
    seq_id = stream.next_event().seq_id

    def report(**fields):
        return pb.SelectBatchRequest(worker_id="w", kv_free_pages=1000, gdn_free_slots=64, **fields)

    def step(token: int, offset: int, **fields):
        update = pb.TokenUpdate(seq_id=seq_id, token_ids=[token], offset=offset)
        return client.select(report(tokens=[update], **fields))

    wait_until(
        lambda: [c.seq_id for c in client.select(report()).prefill] == [seq_id],
        "admission on r0",
        10,
    )
    step(5, 0, running=[seq_id])
    assert stream.tokens_until(1, 10) == [5]
    # r1 relays it from r0: r0 serves one FollowSequence stream.
    wait_until(lambda: r0.metric("streams_open", kind="generate") == 1, "the relay", 10)
    assert _follows(r1, "left") + _follows(r1, "finished") == 0
    crash(r0)  # mid-relay: r1 reads the database, then runs the sequence itself
    with pytest.raises(NotRegistered):
        client.select(report(running=[seq_id]))
    client.register(resources)  # r1 adopts what the worker holds
    step(6, 1, running=[seq_id])
    assert stream.tokens_until(1, 10) == [6]
    client.select(
        report(
            tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[7], offset=2)],
            finished=[pb.FinishedSequence(seq_id=seq_id, reason=EOS, generated_tokens=3)],
        )
    )
    events = stream.rest(10)
    assert [t for e in events for t in e.token_ids] == [7]
    assert events[-1].finished
    ended = sum(_follows(r1, o) for o in ("unreachable", "silent", "failed", "moved"))
    assert ended >= 1  # the relay from r0 ended, and the stream read on
    client.close()


class _Owner(pb_grpc.SchedulerServicer):
    """A replica's FollowSequence as scripted: `events` then silence, or an abort."""

    def __init__(self, events: list[pb.GenerateEvent], abort: grpc.StatusCode | None = None):
        self.events, self.abort, self.calls = events, abort, 0

    async def FollowSequence(self, request, context):
        self.calls += 1
        if self.abort is not None:
            await context.abort(self.abort, "scripted")
        for event in self.events[request.start :]:
            yield event
        await asyncio.sleep(30)  # silent: alive, sending nothing


async def _serve(owner: _Owner) -> tuple[grpc.aio.Server, int]:
    """A fake owner serving on loopback: (its server, its port)."""
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(owner, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _relay(owner: _Owner, address: str | None = "", silent_seconds: float = 5.0):
    """Relay seq 1 from a fake owner at `address` ("": a server of its own, started here):
    (the events relayed, the outcomes counted, whether streams may follow it after)."""

    async def run():
        server, port = await _serve(owner)
        outcomes: list[str] = []
        peers = Peers(
            lambda _owner: f"127.0.0.1:{port}" if address == "" else address,
            max_message_bytes=1 << 20,
            on_follow=outcomes.append,
            silent_seconds=silent_seconds,
        )
        try:
            events = [e async for e in peers.follow(7, 1, 0, [])]
            return events, outcomes, peers.may_follow(7)
        finally:
            await peers.close()
            await server.stop(0)

    return asyncio.run(run())


def _event(*tokens: int, finished: bool = False) -> pb.GenerateEvent:
    return pb.GenerateEvent(seq_id=1, token_ids=tokens, finished=finished)


def test_a_relay_ends_with_the_finish_and_follows_on():
    events, outcomes, may_follow = _relay(_Owner([_event(1), _event(2, finished=True)]))
    assert [list(e.token_ids) for e in events] == [[1], [2]] and events[-1].finished
    assert outcomes == ["finished"] and may_follow


def test_a_silent_owner_ends_the_relay_and_is_left_alone_a_while():
    events, outcomes, may_follow = _relay(_Owner([_event(1)]), silent_seconds=0.5)
    assert [list(e.token_ids) for e in events] == [[1]]
    assert outcomes == ["silent"] and not may_follow


def test_an_owner_that_does_not_hold_it_ends_the_relay_but_is_followed_again():
    events, outcomes, may_follow = _relay(_Owner([], grpc.StatusCode.FAILED_PRECONDITION))
    assert events == [] and outcomes == ["moved"] and may_follow


@pytest.mark.parametrize("listening", [False, True])
def test_an_owner_with_no_address_or_none_listening_is_unreachable(listening):
    owner = _Owner([_event(1, finished=True)])
    address = None
    if listening:  # a port bound, then closed: nothing listens there
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{closed.getsockname()[1]}"
    events, outcomes, may_follow = _relay(owner, address)
    assert events == [] and outcomes == ["unreachable"] and not may_follow
    assert owner.calls == 0


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND])
def test_an_owner_that_refuses_one_call_is_followed_again(code):
    events, outcomes, may_follow = _relay(_Owner([], code))
    assert events == [] and outcomes == ["refused"] and may_follow


def test_an_owner_that_fails_otherwise_is_left_alone_a_while():
    events, outcomes, may_follow = _relay(_Owner([], grpc.StatusCode.UNIMPLEMENTED))
    assert events == [] and outcomes == ["failed"] and not may_follow


def test_channels_unused_for_ten_minutes_are_closed_and_those_in_use_kept():
    # Replicas come and go (a restart is a new id, maybe a new address): a channel no
    # relay used for IDLE_SECONDS is closed, and its owner's address read again when
    # followed after; a channel a relay is reading from stays, however long.
    finished = _Owner([_event(1, finished=True)])
    silent = _Owner([_event(1)])  # sends one event, then nothing for 30 s

    async def run():
        servers, ports = [], {}
        for owner, servicer in ((7, finished), (8, finished), (9, silent)):
            server, ports[owner] = await _serve(servicer)
            servers.append(server)
        now = [0.0]

        def address_of(owner: int) -> str:
            return f"127.0.0.1:{ports[owner]}"

        peers = Peers(address_of, max_message_bytes=1 << 20, clock=lambda: now[0])
        try:
            assert [e.finished async for e in peers.follow(7, 1, 0, [])] == [True]
            held = peers.follow(9, 1, 0, [])  # a relay in flight on 9's channel
            assert not (await anext(held)).finished
            now[0] += IDLE_SECONDS - 1
            assert [e.finished async for e in peers.follow(8, 1, 0, [])] == [True]
            assert len(peers.open_addresses()) == 3  # none idle that long yet
            now[0] += 2  # 7's channel unused for IDLE_SECONDS + 1; 8's for 2 s
            assert [e.finished async for e in peers.follow(8, 1, 0, [])] == [True]
            assert peers.open_addresses() == {address_of(8), address_of(9)}
            # 7 followed again: a new channel (the closed one is not reused).
            assert [e.finished async for e in peers.follow(7, 1, 0, [])] == [True]
            assert len(peers.open_addresses()) == 3
            await held.aclose()
        finally:
            await peers.close()
            for server in servers:
                await server.stop(0)

    asyncio.run(run())


def test_a_relay_still_open_when_its_peers_close_ends_quietly():
    # At shutdown Peers.close() may run before a relay's generator is closed: the relay
    # then ends as left, with no error from its bookkeeping.
    silent = _Owner([_event(1)])

    async def run():
        server, port = await _serve(silent)
        outcomes: list[str] = []
        peers = Peers(
            lambda _owner: f"127.0.0.1:{port}", max_message_bytes=1 << 20, on_follow=outcomes.append
        )
        try:
            held = peers.follow(7, 1, 0, [])
            assert not (await anext(held)).finished
            await peers.close()
            await held.aclose()
            return outcomes
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == ["left"]


def test_an_owner_that_has_not_renewed_its_lease_for_a_lease_stops_serving_follows(
    start_replicas,
):
    # Cut off from the database that long, others may own its sequences by now: its
    # followers read the database instead of its heartbeats.
    (r0,) = start_replicas(1)
    _, seq_id = _running_on(r0)
    follow = pb.FollowSequenceRequest(seq_id=seq_id)
    assert next(r0.stub.FollowSequence(follow, timeout=10)).seq_id == seq_id
    r0.running._serving.servicer._renewed_at -= 60.0
    with pytest.raises(grpc.RpcError) as err:
        list(r0.stub.FollowSequence(follow, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
