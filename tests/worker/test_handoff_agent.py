"""The worker's handoff ends (HandoffAgent) over a fake engine: which transfers it
serves when SENDs repeat or replace one another, and which receives an evict leaves."""

from __future__ import annotations

import threading

from common.waiting import wait_until
from worker_client.engine.api import SequenceSpec, StateChunk, StateKind
from worker_client.handoff_channel import Fetched, OfferBook
from worker_client.handoffs import HandoffAgent, HandoffEnd, HandoffOrder, max_transfer_bytes

NUM_TOKENS = 10


class FakeEngine:
    can_hand_off = True

    def __init__(self) -> None:
        self.num_exports = 0
        self.imported: list[int] = []

    def export_sequence(self, seq_id, first_token=0):
        self.num_exports += 1
        data = b"\0" * (2 * NUM_TOKENS)
        return (StateChunk(StateKind.ATTENTION_KV, 0, data, 0, NUM_TOKENS),)

    def import_sequence(self, seq_id, spec, chunks, cached_tokens=0):
        self.imported.append(seq_id)


def _send(transfer_id: int, seq_id: int = 5) -> HandoffOrder:
    return HandoffOrder(seq_id, True, transfer_id, "d0", num_tokens=NUM_TOKENS)


def test_a_repeated_send_is_served_once_without_a_second_export():
    engine, offers = FakeEngine(), OfferBook()
    agent = HandoffAgent(engine, offers, fetcher=lambda order, seconds: None)
    agent.start([_send(100)])
    agent.start([_send(100)])  # the scheduler repeats it while the transfer runs
    assert engine.num_exports == 1 and agent.num_sent_offers == 1
    assert offers.get(100, 5) is not None and len(offers) == 1
    assert agent.holding_back == frozenset({5})


def test_a_send_with_a_new_transfer_id_replaces_the_old_offer():
    offers = OfferBook()
    agent = HandoffAgent(FakeEngine(), offers, fetcher=lambda order, seconds: None)
    agent.start([_send(100)])
    agent.start([_send(200)])  # a restarted scheduler hands it off anew
    assert offers.get(100, 5) is None  # the contract: the new id only
    assert offers.get(200, 5) is not None and len(offers) == 1


def test_an_evict_of_a_stale_import_leaves_a_newer_receive_under_way():
    engine, release = FakeEngine(), threading.Event()

    def fetcher(order, seconds):
        release.wait(5)
        return Fetched((), 0)

    agent = HandoffAgent(engine, None, fetcher=fetcher)
    spec = SequenceSpec(tuple(range(1, 12)), max_new_tokens=4)
    agent.start([HandoffOrder(5, False, 200, "p0", "p0:7000", NUM_TOKENS, 1, spec)])
    # The decision evicts 5: the import of the old transfer the scheduler forgot.
    agent.dropped([5])
    release.set()
    wait_until(lambda: agent.num_fetching() == 0, "the fetch ends", 5)
    outcomes = agent.finish_ready()
    agent.close()
    assert [(o.transfer_id, o.end) for o in outcomes] == [(200, HandoffEnd.DONE)]
    assert engine.imported == [5]


def test_a_receive_expects_the_bytes_its_own_engine_would_export():
    engine = FakeEngine()
    engine.handoff_bytes_per_token, engine.handoff_fixed_bytes = 2.0, 30.0
    order = HandoffOrder(5, False, 200, "p0", num_tokens=NUM_TOKENS, cached_tokens=4)
    assert max_transfer_bytes(engine, order) == 2 * (NUM_TOKENS - 4) + 30
    engine.handoff_bytes_per_token = 0.0  # no sizes registered: no bound
    assert max_transfer_bytes(engine, order) is None


def test_a_repeated_send_it_could_not_serve_is_not_exported_again():
    class Moved(FakeEngine):
        def export_sequence(self, seq_id, first_token=0):
            self.num_exports += 1
            data = b"\0" * (2 * (NUM_TOKENS + 1))  # one token past what the SEND books
            return (StateChunk(StateKind.ATTENTION_KV, 0, data, 0, NUM_TOKENS + 1),)

    engine, offers = Moved(), OfferBook()
    agent = HandoffAgent(engine, offers, fetcher=lambda order, seconds: None)
    agent.start([_send(100)])
    agent.start([_send(100)])
    assert engine.num_exports == 1 and len(offers) == 0
    assert agent.holding_back == frozenset()


def test_a_receive_started_when_its_decision_arrives_is_fetched_and_reported_once():
    # The loop starts a RECEIVE's fetch while its step runs; applying the decision after
    # the step then starts nothing more: one fetch, one import, one outcome.
    engine, fetches = FakeEngine(), []

    def fetcher(order, seconds):
        fetches.append(order.transfer_id)
        return Fetched((), 0)

    agent = HandoffAgent(engine, None, fetcher=fetcher)
    spec = SequenceSpec(tuple(range(1, 12)), max_new_tokens=4)
    receive = HandoffOrder(5, False, 200, "p0", "p0:7000", NUM_TOKENS, 1, spec)
    agent.receive_early([receive, _send(100, seq_id=6)])  # a SEND waits for the step
    assert agent.busy
    agent.wait_for_fetch(5)
    agent.start([receive])
    wait_until(lambda: agent.num_fetching() == 0, "the fetch ends", 5)
    outcomes = agent.finish_ready()
    agent.close()
    assert fetches == [200] and engine.imported == [5] and engine.num_exports == 0
    assert [(o.transfer_id, o.end) for o in outcomes] == [(200, HandoffEnd.DONE)]
