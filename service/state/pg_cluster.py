"""A private PostgreSQL cluster for tests and `scripts/run_local.sh --replicas N`.

`PrivateCluster(directory).start()` runs initdb and pg_ctl from the PostgreSQL binaries
on this machine (Debian's postgresql-NN packages put them in /usr/lib/postgresql/NN/bin)
on a free loopback port, with trust authentication for the `lattice` role on 127.0.0.1
only, and creates the `lattice` database. PostgreSQL refuses to run as root: as root the
binaries run as the `postgres` user (or $LATTICE_PG_USER), which then owns the directory.

This is a harness, not a production setup: production points `--state` at a database an
operator runs.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROLE = "lattice"
DATABASE = "lattice"
_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin")


class ClusterError(RuntimeError):
    """The cluster could not be created, started or stopped; the message says why."""


def find_binaries() -> Path | None:
    """The directory holding initdb and pg_ctl (the newest version), or None."""
    override = os.environ.get("LATTICE_PG_BIN")
    candidates = [override] if override else []
    for pattern in _BIN_GLOBS:
        candidates += sorted(glob.glob(pattern), key=_version_key, reverse=True)
    for candidate in candidates:
        if candidate and all(
            os.access(Path(candidate, tool), os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")
        ):
            return Path(candidate)
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path and shutil.which("initdb") else None


def _version_key(path: str) -> tuple[int, ...]:
    parts = Path(path).parent.name.split(".")
    return tuple(int(p) for p in parts if p.isdigit())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class PrivateCluster:
    """One PostgreSQL cluster in `directory` (created on first start, reused after)."""

    directory: Path
    port: int = 0
    fsync: bool = True  # tests turn it off: the machine's disk is shared and slow
    # More server settings, each `name=value` (benchmarks: shared_preload_libraries=...).
    settings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).resolve()
        self.bin = find_binaries()
        if self.bin is None:
            raise ClusterError(
                "no PostgreSQL binaries (initdb, pg_ctl) found in "
                "/usr/lib/postgresql/*/bin or on PATH; install postgresql "
                "(Debian: apt-get install postgresql) or set LATTICE_PG_BIN"
            )
        self.user = _run_as_user()
        if not self.port:
            self.port = free_port()

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    def start(self, timeout_seconds: float = 60.0) -> PrivateCluster:
        """initdb if needed, start, wait until it accepts connections, create the database."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._give_to_user(self.directory)
        if not (self.data_dir / "PG_VERSION").exists():
            self._tool(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                ROLE,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            )
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 "
            f"-k {self.directory} -c fsync={'on' if self.fsync else 'off'} "
            "-c max_connections=200 -c shared_buffers=64MB"
        )
        options += "".join(f" -c {setting}" for setting in self.settings)
        self._tool(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-o",
            options,
            "-w",
            "-t",
            str(int(timeout_seconds)),
            "start",
        )
        self._create_database(timeout_seconds)
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop (fast: roll back open transactions, close connections); no-op if stopped."""
        if (self.data_dir / "postmaster.pid").exists():
            self._tool("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop (immediately) and delete the directory."""
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _create_database(self, timeout_seconds: float) -> None:
        import psycopg

        admin = f"postgresql://{ROLE}@127.0.0.1:{self.port}/postgres"
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
                    exists = conn.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
                    ).fetchone()
                    if not exists:
                        conn.execute(f"CREATE DATABASE {DATABASE}")
                return
            except psycopg.OperationalError as err:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"PostgreSQL on port {self.port} does not accept "
                        f"connections: {err}; see {self.log_path}"
                    ) from None
                time.sleep(0.2)

    def _tool(self, name: str, *args: str) -> None:
        argv = [str(self.bin / name), *args]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        result = subprocess.run(
            argv, capture_output=True, text=True, cwd="/", env={**os.environ, "LC_ALL": "C"}
        )
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise ClusterError(
                f"{name} failed ({result.returncode}): {' '.join(tail)}; log: {self.log_path}"
            )

    def _give_to_user(self, path: Path) -> None:
        if self.user is None:
            return
        entry = pwd.getpwnam(self.user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        os.chmod(path, 0o700)
        # The user must be able to reach the directory: every parent needs o+x.
        for parent in path.parents:
            if not os.stat(parent).st_mode & 0o001:
                raise ClusterError(
                    f"{path}: the {self.user} user cannot reach it ({parent} "
                    "is not searchable by others); use a directory under "
                    "/tmp"
                )


def _run_as_user() -> str | None:
    """None when this process may run PostgreSQL itself; else the user to run it as."""
    if os.geteuid() != 0:
        return None
    user = os.environ.get("LATTICE_PG_USER", "postgres")
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise ClusterError(
            f"PostgreSQL refuses to run as root and there is no {user!r} "
            "user to run it as; create one (useradd) or set "
            "LATTICE_PG_USER"
        ) from None
    return user
