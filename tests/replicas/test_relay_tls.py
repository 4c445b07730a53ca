"""Streams relayed between replicas that serve TLS (`--replica-peer-ca`), and mutual TLS
(each replica shows its own certificate to the others)."""

from __future__ import annotations

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.replicas.build import start
from service.settings import ConfigError, ServeSettings
from tests.security.pki import make_pki

from .conftest import stream_across

EOS = pb.FINISH_REASON_EOS


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki, *, mtls: bool, peer_ca: str) -> dict:
    """TLS settings of a replica, and its test client's credentials. `peer_ca`: "ca"
    (the CA that signed the replicas' certificates), "rogue" (another), or "" (none)."""
    settings = {"tls_cert": str(pki.replica.cert), "tls_key": str(pki.replica.key)}
    if mtls:
        settings["tls_client_ca"] = str(pki.ca.cert)
    if peer_ca:
        rogue = pki.rogue_client.cert.parent / "rogue-ca.crt"  # make_pki's other CA
        settings["replica_peer_ca"] = str(pki.ca.cert if peer_ca == "ca" else rogue)
    ca = pki.ca.cert.read_bytes()
    settings["client_credentials"] = (
        grpc.ssl_channel_credentials(ca, pki.client.key.read_bytes(), pki.client.cert.read_bytes())
        if mtls
        else grpc.ssl_channel_credentials(ca)
    )
    return settings


@pytest.mark.parametrize(
    "mtls, peer_ca",
    [(False, "ca"), (True, "ca"), (False, ""), (True, "rogue")],
    ids=["tls", "mtls", "no-ca", "wrong-ca"],
)
def test_replicas_that_serve_tls_relay_streams_when_given_the_peers_ca(
    start_replicas, pki, mtls, peer_ca
):
    # A stream on r1 of a sequence r0 runs: relayed over TLS (a few reads of the database
    # until the owner is known); without --replica-peer-ca, read from the database after
    # each of r0's commits; with a CA that did not sign r0's certificate, the handshake
    # fails (no token sent), r0 counts as unreachable, and the stream reads the database.
    # The client gets the same tokens every way.
    r0, r1 = start_replicas(2, tls=_tls(pki, mtls=mtls, peer_ca=peer_ca))
    worker, stream, seq_id, reads = stream_across(r0, r1)
    for n in range(8):
        worker.select(running=[seq_id], tokens={seq_id: [100 + n]})
        assert stream.tokens_until(1, 10) == [100 + n]
    worker.select(tokens={seq_id: [108]}, finished=[(seq_id, EOS, 9)])
    events = stream.rest(10)
    assert [list(e.token_ids) for e in events] == [[108]] and events[-1].finished
    relayed = r1.metric("replica_follows_total", outcome="finished") or 0.0
    unreachable = r1.metric("replica_follows_total", outcome="unreachable") or 0.0
    if peer_ca == "ca":
        assert relayed == 1 and reads[0] <= 4, reads[0]
    else:
        assert relayed == 0 and reads[0] >= 8, reads[0]
        assert (unreachable >= 1) == (peer_ca == "rogue")


def test_a_peer_ca_without_tls_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="replica_peer_ca is for replicas that serve TLS"):
        ServeSettings(state="postgresql://x@h/db", replica_peer_ca="ca.pem").validate()


def test_an_unreadable_peer_ca_is_refused_before_the_database_is_opened(pki, tmp_path):
    # No database listens at this URL: the error names the flag, not the connection.
    settings = ServeSettings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        state="postgresql://lattice@127.0.0.1:1/none",
        tls_cert=str(pki.replica.cert),
        tls_key=str(pki.replica.key),
        replica_peer_ca=str(tmp_path / "missing.pem"),
    ).validate()
    with pytest.raises(ConfigError, match=r"^--replica-peer-ca .*missing\.pem: cannot read it"):
        start(settings)
