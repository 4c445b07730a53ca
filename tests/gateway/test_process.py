"""The gateway process: a bad model directory stops it with one line, SIGTERM stops it
cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.processes import GATEWAY_LISTENING, LOOPBACK, clean_env, gateway_argv, spawn

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.slow


def test_a_model_directory_without_a_tokenizer_exits_2_with_one_line_naming_it(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "gateway",
            "--target",
            f"{LOOPBACK}:1",
            "--model",
            str(tmp_path),
            "--port",
            "0",
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"lattice-scheduler gateway: --model {tmp_path}: no tokenizer.json there (the gateway "
        f"tokenizes with the checkpoint's own tokenizer)"
    ]


def test_sigterm_stops_the_gateway_with_exit_code_0(checkpoint, tmp_path):
    gateway = spawn(
        "gateway",
        gateway_argv(f"{LOOPBACK}:1", checkpoint.path, "--grace-seconds", "2"),
        tmp_path,
        GATEWAY_LISTENING,
    )
    gateway.popen.send_signal(signal.SIGTERM)
    assert gateway.popen.wait(timeout=30) == 0
    assert "Application shutdown complete" in gateway.log_text()
