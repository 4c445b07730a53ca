"""A command line's refusal of bad arguments: argparse's exit status 2, and the line that
says why (the last of stderr, after the usage)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def refusal_line(main: Callable[[list[str]], object], argv: list[str], capsys) -> str:
    """Run `main(argv)`, which must exit with status 2; the last line it wrote to stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]
