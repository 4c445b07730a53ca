"""The gateway is a client like any other: it reaches a TLS scheduler that checks tokens
with --tls-ca and --token, and a refused token is a 502 that says so."""

from __future__ import annotations

import secrets

import pytest

from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    SCHEDULER_LISTENING,
    gateway_argv,
    scheduler_argv,
    spawn,
)
from tests.security.pki import make_pki

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


def test_gateway_reaches_a_tls_scheduler_with_its_token_and_a_wrong_token_is_a_502(
    checkpoint, tmp_path
):
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    token = secrets.token_urlsafe(24)
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[[tokens]]\ntoken = "{token}"\nrole = "client"\nname = "gateway"\n')
    started = []
    try:
        scheduler = spawn(
            "scheduler",
            scheduler_argv(
                "--tls-cert",
                str(pki.server.cert),
                "--tls-key",
                str(pki.server.key),
                "--auth-tokens",
                str(tokens_file),
                "--max-queue",
                "1",
            ),
            tmp_path,
            SCHEDULER_LISTENING,
        )
        started.append(scheduler)
        target = f"{LOOPBACK}:{scheduler.ports[0]}"
        good = spawn(
            "gateway-good",
            gateway_argv(target, checkpoint.path, "--tls-ca", str(pki.ca.cert), "--token", token),
            tmp_path,
            GATEWAY_LISTENING,
        )
        bad = spawn(
            "gateway-bad",
            gateway_argv(
                target, checkpoint.path, "--tls-ca", str(pki.ca.cert), "--token", "x" * 24
            ),
            tmp_path,
            GATEWAY_LISTENING,
        )
        started += [good, bad]

        def client(process):
            return openai.OpenAI(
                base_url=f"http://{LOOPBACK}:{process.ports[0]}/v1",
                api_key="unused",
                max_retries=0,
                timeout=30,
            )

        # No worker: the stream opens once the scheduler has accepted the sequence.
        stream = client(good).completions.create(
            model=checkpoint.path.name, prompt="hi", max_tokens=4, stream=True
        )
        stream.close()
        with pytest.raises(openai.APIStatusError) as raised:
            client(bad).completions.create(model=checkpoint.path.name, prompt="hi", max_tokens=4)
        assert raised.value.status_code == 502
        assert "credentials" in raised.value.body["message"]
        assert token not in good.log_text() + bad.log_text()
    finally:
        for process in reversed(started):
            process.stop()
