"""The command lines of a gateway test stack's processes, as outside tools start them
(common/processes.py starts them and waits for their banners)."""

from __future__ import annotations

import sys
from pathlib import Path

from common.processes import LOOPBACK

ROOT = Path(__file__).resolve().parents[2]


def worker_argv(target: str, model_dir: Path, worker_id: str = "gateway-test-worker") -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker_client",
        "--scheduler",
        target,
        "--worker-id",
        worker_id,
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--threads",
        "1",
    ]


def gateway_argv(target: str, model_dir: Path, *flags: str) -> list[str]:
    """Exactly the flags outside tools use, plus `flags`."""
    return [
        sys.executable,
        "-m",
        "service",
        "gateway",
        "--target",
        target,
        "--model",
        str(model_dir),
        "--host",
        LOOPBACK,
        "--port",
        "0",
        *flags,
    ]
