"""Security settings that are wrong stop the server, or the client, with a clear message."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import threading

import pytest
from prometheus_client import CollectorRegistry

from common.credentials import channel_credentials
from service import settings
from service.cli import main as cli
from service.core import ConfigError
from service.server.app import start
from service.server.interceptors.auth import Role, load_tokens
from service.settings import ServeSettings

TOKEN = "a-long-enough-test-token-0123456789"


def _resolve(*flags: str, environ=None) -> ServeSettings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return settings.resolve(parser.parse_args(list(flags)), environ or {})


def _serve(capsys, monkeypatch, *flags: str) -> tuple[int, str]:
    """`lattice-scheduler serve FLAGS` that is expected to fail before listening."""
    monkeypatch.setattr("common.logs.configure", lambda *args: None)  # keep pytest's logging
    code = cli.main(["serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *flags])
    return code, capsys.readouterr().err


def test_cert_without_key_is_refused_naming_both_flags(pki):
    with pytest.raises(ConfigError, match="--tls-cert FILE --tls-key FILE"):
        _resolve("--tls-cert", str(pki.server.cert))


def test_client_ca_without_a_server_certificate_is_refused(pki):
    with pytest.raises(ConfigError, match=r"^tls_client_ca \(mTLS, --tls-client-ca\) needs TLS"):
        _resolve("--tls-client-ca", str(pki.ca.cert))


def test_tls_settings_come_from_the_environment_too(pki):
    resolved = _resolve(
        environ={
            "LATTICE_SCHEDULER_TLS_CERT": str(pki.server.cert),
            "LATTICE_SCHEDULER_TLS_KEY": str(pki.server.key),
        }
    )
    assert resolved.tls_cert == str(pki.server.cert) and resolved.tls_key == str(pki.server.key)


def test_serve_with_a_missing_certificate_exits_2_naming_the_flag(
    pki, tmp_path, capsys, monkeypatch
):
    missing = tmp_path / "nope.crt"
    code, err = _serve(
        capsys, monkeypatch, "--tls-cert", str(missing), "--tls-key", str(pki.server.key)
    )
    assert code == 2
    assert f"--tls-cert {missing}: cannot read it (No such file or directory)" in err


def test_serve_with_a_key_that_is_not_pem_exits_2_naming_the_flag(
    pki, tmp_path, capsys, monkeypatch
):
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    code, err = _serve(
        capsys, monkeypatch, "--tls-cert", str(pki.server.cert), "--tls-key", str(junk)
    )
    assert code == 2 and f"--tls-key {junk}: not a PEM file" in err


def test_serve_with_a_missing_tokens_file_exits_2_naming_the_flag(tmp_path, capsys, monkeypatch):
    code, err = _serve(capsys, monkeypatch, "--auth-tokens", str(tmp_path / "none.toml"))
    assert code == 2 and "--auth-tokens" in err and "cannot read it" in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("tokens = [", "not valid TOML"),
        ("", "expected a non-empty list `tokens`"),
        (f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "root"\n', "role must be client, worker or admin"),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "worker"\n',
            "a worker token needs the worker_id it is bound to",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\nworker_id = "w1"\n',
            "only worker tokens take a worker_id",
        ),
        ('[[tokens]]\ntoken = "short"\nrole = "client"\n', "at least 16 characters"),
        ('[[tokens]]\nrole = "client"\n', "exactly one of token and token_sha256"),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\nscope = "all"\n',
            "unknown keys ['scope']",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\n[[tokens]]\ntoken = "{TOKEN}"\n'
            f'role = "admin"\n',
            "tokens[1] repeats an earlier token",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "worker"\nworker_id = "w1"\ntenant = "t"\n',
            "only client tokens take a tenant",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\ntenant = ""\n',
            "tenant must be a non-empty string",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\ntenant = "{"t" * 257}"\n',
            "at most 256 bytes",
        ),
        (
            f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\nname = "a\\u0000b"\n',
            "name must be a non-empty string without control characters",
        ),
    ],
    ids=[
        "bad-toml",
        "empty",
        "unknown-role",
        "worker-without-id",
        "client-with-id",
        "short",
        "no-token",
        "unknown-key",
        "duplicate",
        "worker-with-tenant",
        "empty-tenant",
        "long-tenant",
        "nul-in-name",
    ],
)
def test_bad_tokens_file_is_refused_with_a_clear_message(tmp_path, text, message):
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_tokens(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert TOKEN not in str(err.value)


def test_tokens_file_may_be_json_and_hold_only_digests(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(
        json.dumps(
            {
                "tokens": [
                    {
                        "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
                        "role": "worker",
                        "worker_id": "w7",
                    },
                ]
            }
        )
    )
    table = load_tokens(path)
    grant = table.lookup(TOKEN)
    assert grant is not None and grant.role is Role.WORKER and grant.worker_id == "w7"
    assert table.lookup(TOKEN + "x") is None


def test_a_client_tokens_principal_is_its_name_or_else_its_hash_and_tenant_binds(tmp_path):
    other = "another-token-of-16-chars"
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\ntoken = "{TOKEN}"\nrole = "client"\nname = "alice"\n'
        f'tenant = "acme"\n[[tokens]]\ntoken = "{other}"\nrole = "client"\n'
    )
    table = load_tokens(path)
    named, unnamed = table.lookup(TOKEN), table.lookup(other)
    assert (named.principal, named.tenant) == ("alice", "acme")
    assert unnamed.principal == "sha256:" + hashlib.sha256(other.encode()).hexdigest()[:16]
    assert unnamed.tenant is None and other not in unnamed.principal


def test_client_certificate_without_its_key_is_refused(pki):
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        channel_credentials(pki.ca.cert, pki.client.cert, None)


def test_client_command_with_a_missing_ca_file_says_which_flag(tmp_path, capsys):
    code = cli.main(["status", "--target", "127.0.0.1:1", "--tls-ca", str(tmp_path / "ca.pem")])
    assert code == 1
    assert "--tls-ca" in capsys.readouterr().err


def _start_logged(caplog, **fields) -> None:
    caplog.set_level(logging.WARNING, logger="service.server.app")
    running = start(ServeSettings(port=0, metrics_port=0, **fields), CollectorRegistry())
    # stop() waits out the metrics server's 0.5 s poll; nothing here needs to wait for it.
    threading.Thread(target=running.stop, args=(0.0,), daemon=True).start()


def test_no_auth_beyond_loopback_warns_but_serves(caplog):
    _start_logged(caplog, host="0.0.0.0")
    assert any("authentication is off" in r.getMessage() for r in caplog.records)


def test_no_auth_on_loopback_does_not_warn(caplog):
    _start_logged(caplog, host="127.0.0.1")
    assert not any("authentication is off" in r.getMessage() for r in caplog.records)
