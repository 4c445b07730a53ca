"""docs/architecture.md stays true: every path it names exists, and its import table is
the design tests/test_imports.py enforces."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_imports import ALLOWED

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]*)+$|^[\w-]+\.(?:py|md|proto|toml|sh|yml)$")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _paths(text: str) -> list[str]:
    return [span for span in _SPAN.findall(text) if _PATH.match(span)]


def test_every_backticked_path_exists():
    missing = [p for p in _paths(DOC.read_text()) if not (ROOT / p.rstrip("/")).exists()]
    assert missing == []


def test_every_link_leads_to_a_file():
    missing = [
        link
        for link in _LINK.findall(DOC.read_text())
        if "://" not in link and not (DOC.parent / link).exists()
    ]
    assert missing == []


def test_the_path_check_sees_files_and_folders():
    spans = _paths(
        "`service/core/` and `worker_client/loop.py`, `README.md`, not `a b/c`, "
        "not `lattice.scheduler.v1` nor `postgresql://...`"
    )
    assert spans == ["service/core/", "worker_client/loop.py", "README.md"]


def test_the_import_table_is_the_enforced_design():
    text = DOC.read_text()
    table = text[text.index("| package | may import |") :]
    table = table[: table.index("\n\n")]
    documented = {}
    for row in table.splitlines()[2:]:
        package, allowed = row.strip("|").split("|")
        names = _SPAN.findall(allowed.split("(")[0])
        documented[_SPAN.findall(package)[0]] = frozenset(names)
    assert documented == ALLOWED
