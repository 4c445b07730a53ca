"""The repository stands alone: nothing it runs or tests reads beside the clone.

Regression (outside probe): tests/stack read the Compose schema from the shared folder
beside the clone, so a fresh `git clone` followed by `scripts/test.sh` failed with 3
errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ["service", "worker_client", "bench", "scripts", "tests", "deploy", "protos"]
# Reaching out of the repository: its parent directory, or a path above it.
OUTSIDE = re.compile(
    r"""parents?\[?\d*\]?\s*/\s*["']shared["']|\.\./shared|/work/shared"""
    r"""|REPO\.parent|ROOT\.parent"""
)


def test_no_code_or_test_reads_a_file_beside_the_repository():
    hits = []
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.suffix not in (".py", ".sh", ".yml", ".yaml", ".toml", ".json")
                or path == Path(__file__).resolve()
            ):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == []


def test_the_compose_schema_is_vendored_with_its_licence_note():
    from tests.stack.stack_files import COMPOSE_SCHEMA

    assert ROOT in COMPOSE_SCHEMA.resolve().parents and COMPOSE_SCHEMA.is_file()
    note = (COMPOSE_SCHEMA.parent / "README.md").read_text()
    assert "Apache License 2.0" in note and "compose-spec/compose-spec" in note


# The folder of shared notes beside the working copies: a clone does not have it.
NAMES_SHARED = re.compile(r"\.\./shared|\bshared/(?:contract|style)\.md")


def test_nothing_in_the_repository_names_the_shared_folder():
    """The contract lives in docs/contract.md; README, docs, protos and code point there."""
    hits = []
    for folder, dirs, files in os.walk(ROOT):
        # Not the repository's: git, the virtual environments, build and run outputs.
        dirs[:] = [
            d
            for d in dirs
            if d
            not in (".git", ".venv", ".venv-vllm", ".artifacts", "__pycache__", "build", "dist")
            and not d.endswith(".egg-info")
        ]
        for name in files:
            path = Path(folder) / name
            if path.suffix not in _TEXT or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if NAMES_SHARED.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == []


_TEXT = (
    ".py",
    ".md",
    ".proto",
    ".pyi",
    ".sh",
    ".toml",
    ".yml",
    ".yaml",
    ".txt",
    ".json",
    ".cfg",
    "",
)
