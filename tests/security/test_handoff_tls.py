"""The handoff channel between workers under TLS (the certificates the scheduler's
channel uses; tests/security/pki.py): a receiver that trusts the sender's CA fetches the
transfer; one without TLS, or trusting another CA, gets nothing."""

from __future__ import annotations

import pytest

from common.credentials import channel_credentials, server_credentials
from worker_client.engine.api import StateChunk, StateKind
from worker_client.handoff_channel import (
    FetchFailed,
    FetchProblem,
    HandoffServer,
    OfferBook,
    fetch_sequence,
)

CHUNKS = (StateChunk(StateKind.GDN_CONV, 0, b"state"),)


@pytest.fixture
def tls_sender(pki):
    offers = OfferBook()
    offers.offer(5, 1, CHUNKS)
    server = HandoffServer(
        offers,
        host="127.0.0.1",
        credentials=server_credentials(str(pki.server.cert), str(pki.server.key)),
        token="fleet-token",
    )
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


def _fetch(address, credentials, token="fleet-token"):
    return fetch_sequence(
        address, 5, 1, 0, timeout_seconds=10, credentials=credentials, token=token
    )


def test_a_receiver_trusting_the_senders_ca_fetches_over_tls(pki, tls_sender):
    fetched = _fetch(tls_sender, channel_credentials(str(pki.ca.cert)))
    assert fetched.chunks == CHUNKS


def test_a_plaintext_or_untrusting_receiver_gets_nothing(pki, tls_sender):
    for credentials in (None, channel_credentials(str(pki.rogue_client.cert))):
        with pytest.raises(FetchFailed) as failed:
            _fetch(tls_sender, credentials)
        assert failed.value.problem is FetchProblem.SENDER_UNREACHABLE
