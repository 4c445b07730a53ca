"""Workers and clients through TLS and tokens: the worker loop, the CLIs, lattice-worker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from common.credentials import channel_credentials
from service.cli import main as cli
from worker_client.client import SchedulerCallError, SchedulerClient, WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine, reference_output

PROMPT = [5, 6, 7, 8, 9]
MAX_NEW_TOKENS = 6


class _Worker:
    """A WorkerLoop over ScriptedEngine on a thread, through TLS with worker token w1."""

    def __init__(self, server, token: str, worker_id: str = "w1") -> None:
        self.client = SchedulerClient(
            server.target, credentials=channel_credentials(server.pki.ca.cert), token=token
        )
        engine = ScriptedEngine()
        resources = WorkerResources(
            worker_id, engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
        )
        self.loop = WorkerLoop(engine, self.client, resources, idle_sleep_seconds=0.002)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self.loop.run, args=(self.stop,), daemon=True)

    def __enter__(self) -> _Worker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(10)
        self.client.close()
        assert not self._thread.is_alive()


def _cli(*argv: str) -> int:
    return cli.main(list(argv))


def _generated(stdout: str) -> list[int]:
    """The token lines of `lattice-scheduler generate` output."""
    return [
        int(t)
        for line in stdout.splitlines()
        if re.fullmatch(r"[\d ]+", line)
        for t in line.split()
    ]


def test_worker_loop_and_cli_generate_through_tls_and_tokens(secure_server, tokens, capsys):
    server = secure_server(tls=True, auth=True)
    with _Worker(server, tokens.w1) as worker:
        code = _cli(
            "generate",
            "--target",
            server.target,
            "--tls-ca",
            str(server.pki.ca.cert),
            "--token",
            tokens.client,
            "--prompt-ids",
            ",".join(map(str, PROMPT)),
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert _generated(out) == reference_output(PROMPT, MAX_NEW_TOKENS)
        assert f"finished: FINISH_REASON_MAX_LENGTH after {MAX_NEW_TOKENS} tokens" in out
        assert (
            _cli(
                "status",
                "--target",
                server.target,
                "--tls-ca",
                str(server.pki.ca.cert),
                "--token",
                tokens.client,
            )
            == 0
        )
        assert "worker=w1" in capsys.readouterr().out
    assert worker.loop.stats.finished == 1


def test_cli_load_through_tls_and_a_token_from_the_environment(
    secure_server, tokens, capsys, monkeypatch
):
    server = secure_server(tls=True, auth=True)
    monkeypatch.setenv("LATTICE_SCHEDULER_TOKEN", tokens.client)
    with _Worker(server, tokens.w1):
        code = _cli(
            "load",
            "--target",
            server.target,
            "--tls-ca",
            str(server.pki.ca.cert),
            "--requests",
            "3",
            "--concurrency",
            "3",
            "--max-prompt-len",
            "20",
            "--max-new-tokens",
            "4",
        )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "requests: 3 finished, 0 failed" in out


def test_cli_without_a_token_reports_unauthenticated(secure_server, capsys, monkeypatch):
    monkeypatch.delenv("LATTICE_SCHEDULER_TOKEN", raising=False)
    server = secure_server(tls=True, auth=True)
    assert _cli("status", "--target", server.target, "--tls-ca", str(server.pki.ca.cert)) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_worker_client_bound_to_w1_registering_as_w2_fails_at_once(secure_server, tokens):
    server = secure_server(tls=True, auth=True)
    client = SchedulerClient(
        server.target, credentials=channel_credentials(server.pki.ca.cert), token=tokens.w1
    )
    try:
        started = time.monotonic()
        with pytest.raises(SchedulerCallError, match="PERMISSION_DENIED"):
            client.register(WorkerResources("w2", 64, 16, 8))
        assert time.monotonic() - started < 2.0, "a denial is not retried"
    finally:
        client.close()


@pytest.mark.slow
def test_lattice_worker_process_serves_through_mtls_and_a_token(secure_server, tokens, capsys):
    server = secure_server(tls=True, mtls=True, auth=True)
    pki = server.pki
    tls = [
        "--tls-ca",
        str(pki.ca.cert),
        "--tls-cert",
        str(pki.client.cert),
        "--tls-key",
        str(pki.client.key),
    ]
    env = {**os.environ, "LATTICE_SCHEDULER_TOKEN": tokens.w1}
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker_client",
            "--scheduler",
            server.target,
            "--worker-id",
            "w1",
            "--model",
            "scripted",
            *tls,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code = _cli(
            "generate",
            "--target",
            server.target,
            *tls,
            "--token",
            tokens.client,
            "--prompt-ids",
            ",".join(map(str, PROMPT)),
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
            "--timeout",
            "20",
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert _generated(out) == reference_output(PROMPT, MAX_NEW_TOKENS)
    finally:
        worker.send_signal(signal.SIGTERM)
        stdout, stderr = worker.communicate(timeout=20)
    assert worker.returncode == 0, stderr
    assert "1 sequences finished" in stdout
    assert tokens.w1 not in stdout + stderr
