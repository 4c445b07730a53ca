"""A streamed answer with an Idempotency-Key survives a kill -9 of the scheduler: the
scheduler comes back on its --state-dir, the gateway re-attaches the stream, and the client
reads the same text as if nothing had happened."""

from __future__ import annotations

import socket

import pytest

from common.processes import (
    CPU_ONE_THREAD,
    GATEWAY_LISTENING,
    LOOPBACK,
    SCHEDULER_LISTENING,
    gateway_argv,
    scheduler_argv,
    spawn,
    worker_argv,
)

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MAX_TOKENS = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def test_a_keyed_stream_reads_on_across_a_scheduler_kill_and_restart(checkpoint, tmp_path):
    port = free_port()
    argv = scheduler_argv("--state-dir", str(tmp_path / "state"))
    argv[argv.index("--port") + 1] = str(port)
    target = f"{LOOPBACK}:{port}"
    started = []
    try:
        started.append(spawn("scheduler", argv, tmp_path, SCHEDULER_LISTENING))
        started.append(
            spawn(
                "worker", worker_argv(target, "worker", checkpoint.path, *CPU_ONE_THREAD), tmp_path
            )
        )
        gateway = spawn(
            "gateway", gateway_argv(target, checkpoint.path), tmp_path, GATEWAY_LISTENING
        )
        started.append(gateway)
        client = openai.OpenAI(
            base_url=f"http://{LOOPBACK}:{gateway.ports[0]}/v1",
            api_key="unused",
            max_retries=0,
            timeout=120,
        )
        fields = dict(
            model=checkpoint.path.name,
            prompt="The scheduler admits",
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        expected = client.completions.create(**fields).choices[0].text  # waits for the worker

        stream = client.completions.create(
            **fields,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"Idempotency-Key": "restart-1"},
        )
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        started[0].popen.kill()  # kill -9, mid-answer
        started[0].popen.wait(10)
        started[0] = spawn("scheduler-again", argv, tmp_path, SCHEDULER_LISTENING)
        rest = list(chunks)
        pieces += [c.choices[0].text for c in rest if c.choices]
        assert "".join(pieces) == expected
        assert rest[-1].usage.completion_tokens == MAX_TOKENS
        assert "re-attached seq_id" in gateway.log_text()
    finally:
        for process in reversed(started):
            process.stop()
