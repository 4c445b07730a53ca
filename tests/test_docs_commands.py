"""The commands in the README and docs/ run as they stand, pasted into a shell at the
repository root: the project's programs through `.venv/bin/` (nothing needs an activated
virtual environment), `lattice-worker` with its required `--model`, no `...` placeholders,
and every `scripts/` file named exists.

Regression (outside probe): the docs showed bare `python scripts/...`, which fails
without the venv.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Programs that exist only inside the project's virtual environment.
VENV_PROGRAMS = ("python", "python3", "pytest", "lattice-scheduler", "lattice-worker")
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHELL_FENCES = ("", "bash", "sh", "shell", "console")
_ENV_ASSIGNMENT = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*")
_INLINE = re.compile(r"`([^`\n]+)`")


def _shell_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each command in shell code blocks, fenced or indented;
    continuation lines are joined onto their command."""
    commands: list[tuple[int, str]] = []
    in_fence, fence_is_shell, pending = False, False, None
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            in_fence, fence_is_shell = not in_fence, fence.group(1) in _SHELL_FENCES
            continue
        indented = not in_fence and line.startswith("    ") and line.strip()
        if not ((in_fence and fence_is_shell) or indented):
            pending = None
            continue
        body = line.strip()
        if pending is not None:
            commands[-1] = (commands[-1][0], commands[-1][1] + " " + body)
        elif body and not body.startswith("#"):
            commands.append((number, body))
        pending = True if body.endswith("\\") else None
    return commands


def _program(command: str) -> str:
    return _ENV_ASSIGNMENT.sub("", command).split()[0]


def _all_commands():
    for path in DOCS:
        for number, command in _shell_commands(path.read_text()):
            yield pytest.param(command, id=f"{path.relative_to(ROOT)}:{number}")


@pytest.mark.parametrize("command", list(_all_commands()))
def test_each_documented_command_runs_as_it_stands(command):
    program = _program(command)
    creates_the_venv = re.match(r"python3? -m venv \.venv\b", _ENV_ASSIGNMENT.sub("", command))
    assert program not in VENV_PROGRAMS or creates_the_venv, (
        f"{program} needs the project's virtual environment: write .venv/bin/{program}"
    )
    if program.endswith("lattice-worker"):
        assert "--model" in command, "lattice-worker requires --model"
    assert "..." not in command.split("#")[0], "a placeholder is not a command"
    for script in re.findall(r"\bscripts/[\w./-]+", command):
        assert (ROOT / script).exists(), f"{script} does not exist"


def test_inline_commands_name_the_venv_too():
    bare = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for span in _INLINE.findall(line):
                words = _ENV_ASSIGNMENT.sub("", span).split()
                if len(words) > 1 and words[0] in ("python", "python3", "pytest"):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: `{span}`")
    assert bare == []
