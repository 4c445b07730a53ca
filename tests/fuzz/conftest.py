"""Fuzzing a live scheduler: a server on loopback (tests/server's), and a tally of the
status codes each RPC answered, printed at the end of the run with other figures."""

from __future__ import annotations

from collections import Counter

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.server.conftest import server_stoppers, start_server  # noqa: F401 (fixtures)

from .target import FuzzTarget

_CODES = pytest.StashKey[Counter]()
_NOTES = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def codes_seen(request) -> Counter:
    """(method, status name) -> calls, over the whole session."""
    return request.config.stash.setdefault(_CODES, Counter())


@pytest.fixture(scope="session")
def fuzz_notes(request) -> list[str]:
    """Lines (measured figures) printed at the end of the run."""
    return request.config.stash.setdefault(_NOTES, [])


@pytest.fixture(params=["memory", "state-dir"])
def target(request, start_server, codes_seen, tmp_path) -> FuzzTarget:
    """A fresh scheduler with a few queued sequences and workers "w0" and "w1" registered;
    once with state in memory, once with --state-dir (SQLite)."""
    state_dir = str(tmp_path / "state") if request.param == "state-dir" else ""
    fuzz = FuzzTarget(start_server(state_dir), codes_seen, state_dir=state_dir)
    for _ in range(3):
        fuzz.call("Submit", pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4))
    for worker_id in ("w0", "w1"):
        fuzz.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(
                worker_id=worker_id, total_kv_pages=1000, page_size=16, total_gdn_slots=64
            ),
        )
    return fuzz


def pytest_terminal_summary(terminalreporter, config) -> None:
    codes = config.stash.get(_CODES, None)
    notes = config.stash.get(_NOTES, [])
    if not codes and not notes:
        return
    terminalreporter.section("fuzz: figures, and status codes per RPC")
    for line in notes:
        terminalreporter.write_line(line)
    for method in sorted({m for m, _ in codes}):
        row = ", ".join(f"{name}={n}" for (m, name), n in sorted(codes.items()) if m == method)
        terminalreporter.write_line(f"{method}: {row}")
    terminalreporter.write_line(f"calls in all: {sum(codes.values())}")
