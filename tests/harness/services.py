"""Private Redis and PostgreSQL instances on free ports, and a TCP proxy that can refuse
connections. Each can be stopped and started again on the same port with its data kept (Redis with
appendonly, PostgreSQL with its data directory), which is what the outage scenarios need.

    with RedisServer(tmp) as r:          # redis-server --port <free> --appendonly yes
        r.stop(); r.start()              # a restart: queued messages survive (AOF)
    with PostgresServer(tmp) as pg:      # initdb + pg_ctl, as the `postgres` user when run as root
        pg.stop(); pg.start()
    with TcpProxy(("127.0.0.1", pg.port)) as px:
        px.refuse(); px.accept()         # drop live connections, refuse new ones; then let them in
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Self

from tests.harness.waiting import wait_for


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------- Redis


class RedisServer:
    """A private redis-server configured as RELIABILITY.md asks (appendonly, noeviction)."""

    def __init__(self, workdir: str | Path, port: int | None = None, password: str | None = None):
        self.dir = Path(workdir) / f"redis-{os.getpid()}-{id(self):x}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, deadline_s: float = 30) -> RedisServer:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not on PATH")
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(
            self.ping,
            f"redis on port {self.port}",
            deadline_s,
            diagnose=lambda: (self.dir / "redis.log").read_text()[-2000:],
        )
        return self

    def ping(self) -> bool:
        import redis

        try:
            c = redis.Redis.from_url(self.url, socket_timeout=1)
            try:
                return bool(c.ping())
            finally:
                c.close()
        except (redis.RedisError, OSError):
            return False

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self, sig: str = "term") -> None:
        """Stop the server: 'term' (clean, AOF flushed) or 'kill' (SIGKILL)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            (self.proc.terminate if sig == "term" else self.proc.kill)()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        wait_for(lambda: not port_open(self.port), f"redis port {self.port} to close", 30)

    def queue_length(self, queue: str) -> int:
        c = self.client()
        try:
            return int(c.llen(queue))
        finally:
            c.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop("kill")
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------- PostgreSQL


def pg_bindir() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(d) / "initdb").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PostgresServer:
    """A throwaway PostgreSQL cluster (trust auth) on a free port. Run as root, the server runs
    as the `postgres` user through `runuser` (PostgreSQL refuses to run as root)."""

    def __init__(
        self, workdir: str | Path, port: int | None = None, user: str = "canvasq", password: str | None = None
    ):
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries (initdb, pg_ctl) not found")
        self.bin = bindir
        self.workdir = Path(workdir)
        # The cluster lives in a short directory of its own under /tmp, not in the test's tmp_path: the
        # `postgres` user must traverse every parent, and pytest sets its tmp root back to 0700 whenever
        # a session first asks for a tmp dir (under pytest-xdist each worker does, at any time, and a
        # running server then lost its data directory); and a Unix socket path is at most 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="cq-pg-"))
        self.data = self.dir / "data"
        self.port = port or free_port()
        self.user = user
        self.password = password
        self._initialised = False

    def _as_owner(self, args: list[str]) -> list[str]:
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--", *args]
        return args

    def _run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            self._as_owner(args), capture_output=True, text=True, timeout=timeout, check=True
        )

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str = "canvasq") -> str:
        auth = f"{self.user}:{self.password}" if self.password else self.user
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{database}"

    def init(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            os.chmod(self.dir, 0o700)
            # the parents must be traversable by the postgres user
            for parent in list(self.dir.parents)[:-1]:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o011)
        self._run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ]
        )
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\n"
                # fsync off is safe here (the OS stays up when the server is killed); synchronous_commit
                # must stay on: off, an immediate stop loses commits the client was told had happened
                "fsync = off\nfull_page_writes = off\nmax_connections = 100\n"
                "shared_buffers = 32MB\n"
            )
        self._initialised = True

    def start(self) -> PostgresServer:
        if not self._initialised:
            self.init()
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.dir / "pg.log"),
                "-w",
                "-t",
                "60",
                "start",
            ]
        )
        wait_for(lambda: port_open(self.port), f"postgres on port {self.port}", 60)
        if not getattr(self, "_db_made", False):
            self._create_db()
            self._db_made = True
        return self

    def _create_db(self) -> None:
        from sqlalchemy import create_engine, text

        eng = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with eng.connect() as c:
                pw = f" PASSWORD '{self.password}'" if self.password else ""
                c.execute(text(f'CREATE ROLE "{self.user}" LOGIN SUPERUSER{pw}'))
                c.execute(text(f'CREATE DATABASE canvasq OWNER "{self.user}"'))
        finally:
            eng.dispose()

    def stop(self, mode: str = "immediate") -> None:
        """pg_ctl stop -m immediate|fast: live connections are cut, new ones refused."""
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"])
        wait_for(lambda: not port_open(self.port), f"postgres port {self.port} to close", 30)

    def running(self) -> bool:
        return port_open(self.port)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------- TCP proxy


class TcpProxy:
    """127.0.0.1:<port> → target. `refuse()` closes every live connection and the listening socket
    (new connections get ECONNREFUSED); `accept()` listens again on the same port."""

    def __init__(self, target: tuple[str, int], port: int | None = None):
        self.target = target
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def url_for(self, url: str) -> str:
        """`url` with its host:port replaced by the proxy's."""
        from sqlalchemy.engine import make_url

        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def accept(self) -> None:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        self._thread = threading.Thread(target=self._serve, args=(ls,), daemon=True)
        self._thread.start()

    def _serve(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)

    def refuse(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> Self:
        self.accept()
        return self

    def __exit__(self, *exc) -> None:
        self.refuse()
