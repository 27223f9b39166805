"""A private ``redis-server`` per test module: free port, temp dir, optional AOF, kill -9.

Tests must talk to a real Redis but never to the one a developer may run on 6379, so each
module starts its own. ``kill()`` and ``restart()`` keep the port and the data directory,
which is what crash tests need (with ``appendonly=True`` the data survives a kill -9).

Use the fixtures explicitly, e.g. in a ``conftest.py``::

    from tests.redis_server import redis_server, redis_client  # noqa: F401

or the class directly: ``with RedisServer(appendonly=True) as server: ...``.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

_LIVE: set[subprocess.Popen[bytes]] = set()


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@atexit.register
def _kill_leftovers() -> None:
    """Last resort if a test process dies without running fixture teardown."""
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, restartable on the same port and dir."""

    def __init__(
        self,
        port: int | None = None,
        appendonly: bool = False,
        data_dir: str | Path | None = None,
        binary: str = "redis-server",
    ) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="ferry-redis-"))
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        cmd = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--daemonize", "no",
            "--logfile", "redis.log", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",  # a kill -9 then loses nothing already acknowledged
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        _LIVE.add(self.proc)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if not self.running:
                    raise RuntimeError(f"redis-server exited early:\n{self.log_tail()}")
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                    if probe.ping():
                        return
                time.sleep(0.02)
        finally:
            probe.close()
        self.kill()
        raise TimeoutError(f"redis-server not ready on {self.port}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        log = self.dir / "redis.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def _reap(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _LIVE.discard(self.proc)
        self.proc = None

    def stop(self) -> None:
        """Graceful SIGTERM: Redis flushes the AOF, if any, and exits."""
        self._reap(signal.SIGTERM)

    def kill(self) -> None:
        """kill -9: no shutdown work at all, as in a crash."""
        self._reap(signal.SIGKILL)

    def restart(self, hard: bool = True) -> RedisServer:
        """Kill (or stop) then start again on the same port with the same data dir."""
        if hard:
            self.kill()
        else:
            self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for the test module, stopped and removed afterwards."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on an emptied database, so tests in one module do not see each other."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()
