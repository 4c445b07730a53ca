"""pyproject.toml lists every package: a non-editable install (the Docker image's
`pip install /src[...]`) carries only the listed ones, and a missing one fails at import
only there, not in the editable .venv the tests run in."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_python_package_of_the_project_is_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / path for name, path in config.get("package-dir", {}).items()}
    found = set()
    for top in ("common", "service", "worker_client", "lattice"):
        base = roots.get(top, ROOT / top)
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            found.add(".".join((top, *relative.parts)))
    assert found - listed == set(), "packages missing from pyproject.toml"
    data_only = {
        name
        for name in listed - found
        if (ROOT / name.replace(".", "/")).is_dir()
        and not any((ROOT / name.replace(".", "/")).rglob("*.py"))
    }
    assert listed - found - data_only == set(), "pyproject.toml lists packages that do not exist"
