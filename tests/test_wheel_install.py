"""The built wheel, installed with no extras into a clean virtual environment (as `pip
install lattice-scheduler` would), starts every entry point: each command's --help, `serve`
until it listens; and each command that needs an extra says in one line which one, instead
of a traceback. The editable .venv the other tests run in has every extra (and hypothesis
brings sortedcontainers), so a missing dependency shows only here."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds a wheel and a venv, installs from the package index


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(work / "dist"),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (work / "dist").glob("lattice_scheduler-*.whl")
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=True)
    subprocess.run(
        [
            str(env_dir / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-c",
            str(ROOT / "constraints.txt"),
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    return env_dir


def _run(env_dir: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command, *rest = argv
    return subprocess.run(
        [str(env_dir / "bin" / command), *rest],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=env_dir,
    )


def test_the_clean_venv_has_no_extra(clean_venv):
    for module in ("torch", "fastapi", "jinja2", "tokenizers", "psycopg", "matplotlib"):
        probe = _run(clean_venv, "python", "-c", f"import {module}")
        assert probe.returncode != 0, f"{module} is installed without its extra"


def test_every_command_and_subcommand_answers_help(clean_venv):
    top = _run(clean_venv, "lattice-scheduler", "--help")
    assert top.returncode == 0, top.stderr
    commands = re.search(r"\{([a-z,-]+)\}", top.stdout).group(1).split(",")
    assert {"serve", "gateway", "simulate", "state"} <= set(commands)
    helps = [("lattice-scheduler", c, "--help") for c in commands]
    helps += [
        ("lattice-scheduler", "state", "check", "--help"),
        ("lattice-worker", "--help"),
        ("lattice-worker", "profile", "--help"),
    ]
    for argv in helps:
        done = _run(clean_venv, *argv)
        assert done.returncode == 0 and "usage:" in done.stdout, (argv, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)


def test_serve_listens_then_stops_on_sigterm(clean_venv, tmp_path):
    process = subprocess.Popen(
        [
            str(clean_venv / "bin" / "lattice-scheduler"),
            "serve",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = process.stdout.readline()
            assert line or process.poll() is None, "serve exited before it listened"
        assert "listening on" in line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_scripted_worker_starts_without_torch_and_leaves_on_sigterm(clean_venv):
    with socket.socket() as s:  # nobody listens there: the worker retries its registration
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [
            str(clean_venv / "bin" / "lattice-worker"),
            "--scheduler",
            f"127.0.0.1:{port}",
            "--worker-id",
            "w1",
            "--model",
            "scripted",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = process.stdout.readline()
        while line and "retrying" not in line:
            line = process.stdout.readline()
        assert "retrying" in line, "the worker did not start"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    "argv, extra",
    [
        (
            (
                "lattice-scheduler",
                "serve",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--state",
                "postgresql://lattice@127.0.0.1:1/lattice",
            ),
            "postgres",
        ),
        (("lattice-scheduler", "gateway", "--model", ".", "--port", "0"), "gateway"),
        (
            (
                "lattice-scheduler",
                "simulate",
                "--compare",
                "fifo,budget",
                "--qps",
                "1",
                "--num-requests",
                "5",
                "--no-progress",
            ),
            "sim",
        ),
        (("lattice-worker", "--worker-id", "w", "--model", "tiny"), "worker"),
        (("lattice-worker", "profile", "--out", "table.json"), "worker"),
    ],
)
def test_a_command_without_its_extra_names_the_extra_in_one_line(clean_venv, argv, extra):
    done = _run(clean_venv, *argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"'{extra}' extra" in lines[0] and f"lattice-scheduler[{extra}]" in lines[0]
    assert done.stdout == ""  # nothing ran first
