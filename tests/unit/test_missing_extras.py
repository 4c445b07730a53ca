"""A command whose extra is not installed says so in one line naming the extra, before it
does anything (no traceback, no run thrown away). The missing module is simulated: a None
in sys.modules makes its import fail as an absent package does."""

from __future__ import annotations

import sys

from common import extras
from service.cli import main as scheduler_cli
from worker_client import cli as worker_cli


def _hide(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def _one_line_naming(capsys, extra: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert f"'{extra}' extra" in lines[0]
    assert f"pip install 'lattice-scheduler[{extra}]'" in lines[0]
    return captured.out


def test_every_extra_lists_only_modules_that_import_here():
    for modules in extras.MODULES_BY_EXTRA.values():
        for module in modules:
            __import__(module)  # the dev venv has every extra: a typo fails here


def test_serve_with_postgres_state_names_the_postgres_extra(monkeypatch, capsys):
    _hide(monkeypatch, "psycopg")
    code = scheduler_cli.main(
        [
            "serve",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--state",
            "postgresql://lattice@127.0.0.1:1/lattice",
        ]
    )
    assert code == 2
    _one_line_naming(capsys, "postgres")


def test_gateway_names_the_gateway_extra(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "jinja2")
    code = scheduler_cli.main(["gateway", "--model", str(tmp_path), "--port", "0"])
    assert code == 2
    _one_line_naming(capsys, "gateway")


def test_simulate_compare_names_the_sim_extra_before_any_run(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "matplotlib")
    code = scheduler_cli.main(
        [
            "simulate",
            "--compare",
            "fifo,budget",
            "--qps",
            "1",
            "--num-requests",
            "5",
            "--no-progress",
            "--plot",
            str(tmp_path / "cmp.png"),
        ]
    )
    assert code == 2
    out = _one_line_naming(capsys, "sim")
    assert out == ""  # nothing ran: no header, no table
    assert not (tmp_path / "cmp.png").exists()


def test_worker_with_a_model_names_the_worker_extra(monkeypatch, capsys):
    _hide(monkeypatch, "torch")
    code = worker_cli.main(["--worker-id", "w", "--model", "tiny"])
    assert code == 2
    _one_line_naming(capsys, "worker")


def test_worker_profile_names_the_worker_extra(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "torch")
    code = worker_cli.main(["profile", "--out", str(tmp_path / "t.json")])
    assert code == 2
    _one_line_naming(capsys, "worker")
