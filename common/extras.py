"""The optional dependencies (pyproject.toml's extras): a command that needs one checks for
it before it does anything, and a missing one is one line naming the extra to install, not
a traceback from deep inside the run."""

from __future__ import annotations

import importlib

from common.errors import ConfigError

# Each extra and the modules of it that our code imports, as pyproject.toml lists them.
MODULES_BY_EXTRA: dict[str, tuple[str, ...]] = {
    "worker": ("torch", "safetensors", "numpy"),
    "gateway": ("fastapi", "uvicorn", "tokenizers", "jinja2"),
    "postgres": ("psycopg", "psycopg_pool"),
    "sim": ("matplotlib",),
}


class MissingExtra(ConfigError):
    """A command needs an extra that is not installed."""


def require(extra: str, needed_by: str) -> None:
    """Import every module of `extra`; raise MissingExtra naming the extra and the first
    module that is missing (or fails to import, e.g. psycopg without its libpq)."""
    for module in MODULES_BY_EXTRA[extra]:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise MissingExtra(
                f"{needed_by} needs the {extra!r} extra, which is not installed ({err}): "
                f"pip install 'lattice-scheduler[{extra}]'"
            ) from None
