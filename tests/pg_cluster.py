"""A throwaway PostgreSQL cluster for the test suite (Debian's ``postgresql``).

PostgreSQL refuses to run as root, and tests run as root here: the cluster is
created and started as the ``postgres`` user in a directory it can enter, on a
free loopback port, with fsync off (the data is thrown away).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    pass


def find_pg_bin() -> Path | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for directory in candidates:
        if Path(directory, "initdb").exists() and Path(directory, "pg_ctl").exists():
            return Path(directory)
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PgCluster:
    bin_dir: Path
    base_dir: Path
    port: int
    as_user: str | None

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    def _cmd(self, *args: str) -> list[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        return ["runuser", "-u", self.as_user, "--", *command] if self.as_user else command

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        run = lambda *a: subprocess.run(  # noqa: E731
            self._cmd(*a), check=True, capture_output=True, text=True, timeout=120
        )
        try:
            run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            )
            options = (
                f"-p {self.port} -k {self.base_dir} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200"
            )
            run(
                "pg_ctl",
                "-D",
                str(self.data_dir),
                "-o",
                options,
                "-l",
                str(self.base_dir / "server.log"),
                "-w",
                "-t",
                "60",
                "start",
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", "") or ""
            raise PostgresUnavailable(f"could not start PostgreSQL: {exc} {detail}") from exc

    def stop(self) -> None:
        subprocess.run(
            self._cmd("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "stop"),
            capture_output=True,
            timeout=60,
            check=False,
        )
        shutil.rmtree(self.base_dir, ignore_errors=True)


def start_cluster() -> PgCluster:
    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise PostgresUnavailable(
            "PostgreSQL server binaries not found (apt-get install postgresql; "
            "`make test` does this for you)"
        )
    as_user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError as exc:
            raise PostgresUnavailable("running as root but no 'postgres' user exists") from exc
        as_user = "postgres"
    base = Path(tempfile.mkdtemp(prefix="roundtable-pg-"))
    base.chmod(0o777)
    # The postgres user must be able to reach the directory through its parents.
    for parent in base.parents:
        if parent != Path("/") and not os.access(parent, os.X_OK):
            parent.chmod(parent.stat().st_mode | 0o011)
    if as_user:
        shutil.chown(base, user=as_user)
    cluster = PgCluster(bin_dir=bin_dir, base_dir=base, port=_free_port(), as_user=as_user)
    cluster.start()
    return cluster
