"""TLS material and bearer tokens, read from files and flags, for the server and its clients.

Insecure is the default at both ends. A file that cannot be read stops the program with
a ConfigError naming the flag that gave it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from common.errors import ConfigError

TOKEN_ENV = "LATTICE_SCHEDULER_TOKEN"


def read_pem(path: str | Path, flag: str) -> bytes:
    """The bytes of a PEM file; ConfigError naming `flag` if it is unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str = ""
) -> grpc.ServerCredentials | None:
    """TLS for the server (None: plaintext); with a client CA, client certificates are required."""
    if not cert_file:
        return None
    pair = (read_pem(key_file, "--tls-key"), read_pem(cert_file, "--tls-cert"))
    client_ca = read_pem(client_ca_file, "--tls-client-ca") if client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(
    ca_file: str | None,
    cert_file: str | None = None,
    key_file: str | None = None,
    ca_flag: str = "--tls-ca",
) -> grpc.ChannelCredentials | None:
    """TLS for a client (None: plaintext). The client pair is for servers that require mTLS
    (sent only to a server that asks for one). `ca_flag` names the CA file in errors."""
    if bool(cert_file) != bool(key_file):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    if not ca_file and not cert_file:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, ca_flag) if ca_file else None,
        private_key=read_pem(key_file, "--tls-key") if key_file else None,
        certificate_chain=read_pem(cert_file, "--tls-cert") if cert_file else None,
    )


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key and --token, for a command that calls the scheduler."""
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="connect with TLS, trusting this CA (PEM); without it, plaintext",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="client certificate (PEM), for a scheduler that requires mTLS",
    )
    parser.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=f"bearer token, for a scheduler with --auth-tokens "
        f"(env {TOKEN_ENV}; the env keeps it out of `ps`)",
    )


def client_args_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    return channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)


def aio_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list
) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS when `credentials` are given, else plaintext."""
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None, token: str | None
) -> grpc.Channel:
    """A channel to `target`, TLS when `credentials` are given, sending `token` on every call.

    `target` may list several replicas (HOST:PORT,HOST:PORT or dns:///NAME:PORT): calls
    then go round robin to those that are up (common/targets.py)."""
    from common.targets import channel_target

    target, options = channel_target(target)
    channel = (
        grpc.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(target, options)
    )
    # Metadata rather than call credentials: gRPC sends call credentials over TLS only,
    # and a token on a private plaintext network is a supported (if weaker) set-up.
    return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = token_metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
