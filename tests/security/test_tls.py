"""TLS and mutual TLS on the gRPC port, with certificates made at test time."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.credentials import channel_credentials
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.cli import main as cli
from service.core import SchedulerConfig

from .conftest import RPC_TIMEOUT_SECONDS

# A failed handshake surfaces as UNAVAILABLE at once; this only bounds a hang.
FAIL_TIMEOUT_SECONDS = 2.0


def _status(stub: pb_grpc.SchedulerStub, timeout: float = RPC_TIMEOUT_SECONDS):
    return stub.GetStatus(pb.GetStatusRequest(), timeout=timeout)


def _fails(stub: pb_grpc.SchedulerStub) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        _status(stub, FAIL_TIMEOUT_SECONDS)
    return err.value.code()


def test_tls_client_trusting_the_ca_is_served(secure_server):
    server = secure_server(tls=True, auth=False)
    assert _status(server.stub()).policy == SchedulerConfig().policy


def test_plaintext_client_against_a_tls_server_fails(secure_server):
    server = secure_server(tls=True, auth=False)
    assert _fails(server.stub(tls=False)) is grpc.StatusCode.UNAVAILABLE


def test_tls_client_trusting_another_ca_fails(secure_server, pki):
    server = secure_server(tls=True, auth=False)
    # The rogue client certificate is self-consistent but chains to an untrusted CA.
    wrong_ca = channel_credentials(pki.rogue_client.cert)
    stub = pb_grpc.SchedulerStub(grpc.secure_channel(server.target, wrong_ca))
    assert _fails(stub) is grpc.StatusCode.UNAVAILABLE


def test_mtls_server_refuses_a_client_without_a_certificate(secure_server):
    server = secure_server(tls=True, mtls=True, auth=False)
    assert _fails(server.stub(client_cert=False)) is grpc.StatusCode.UNAVAILABLE


def test_mtls_server_refuses_a_certificate_from_an_untrusted_ca(secure_server, pki):
    server = secure_server(tls=True, mtls=True, auth=False)
    rogue = channel_credentials(pki.ca.cert, pki.rogue_client.cert, pki.rogue_client.key)
    stub = pb_grpc.SchedulerStub(grpc.secure_channel(server.target, rogue))
    assert _fails(stub) is grpc.StatusCode.UNAVAILABLE


def test_mtls_server_accepts_a_client_certificate_signed_by_its_ca(secure_server):
    server = secure_server(tls=True, mtls=True, auth=False)
    assert _status(server.stub(client_cert=True)).policy == SchedulerConfig().policy


def test_health_is_served_over_tls(secure_server):
    server = secure_server(tls=True, auth=True)
    health = health_pb2_grpc.HealthStub(server.channel())
    response = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_SECONDS)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_client_command_against_a_tls_server_fails_at_once_with_a_hint(
    secure_server, capsys
):
    server = secure_server(tls=True, auth=False)
    started = time.monotonic()
    code = cli.main(["status", "--target", server.target, "--timeout", "60"])
    assert time.monotonic() - started < FAIL_TIMEOUT_SECONDS
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(
        f"lattice-scheduler status: cannot reach the scheduler at {server.target} ("
    )
    assert "a TLS scheduler needs --tls-ca" in err and err.count("\n") == 1


def test_client_command_with_the_ca_and_a_token_is_served(secure_server, pki, tokens, capsys):
    server = secure_server(tls=True, auth=True)
    code = cli.main(
        [
            "status",
            "--target",
            server.target,
            "--tls-ca",
            str(pki.ca.cert),
            "--token",
            tokens.client,
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert f"policy={SchedulerConfig().policy}" in capsys.readouterr().out


def test_client_command_without_a_token_reports_the_schedulers_refusal(secure_server, pki, capsys):
    server = secure_server(tls=True, auth=True)
    code = cli.main(["status", "--target", server.target, "--tls-ca", str(pki.ca.cert)])
    assert code == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
