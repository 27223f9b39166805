"""Processes of a Ferry stack on one machine: free ports, a redis-server child under the
supervisor, and the fail-fast ``Stack`` the service benchmarks start their parts with.

``ferry up`` and ``ops/bench/service.py`` both need a private Redis started and pinged the
same way; the benchmark wants no restarts (an exit is a failed measurement), so it gets
the supervisor with restarts off.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path

import typer

from ferry.supervisor import ChildSpec, Supervisor


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(sup: Supervisor, data: Path) -> str:
    """A private redis-server (AOF in ``data``, loopback only) as a supervised child that is
    never restarted; returns its URL once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise typer.BadParameter("redis-server not found on PATH; pass --redis-url")
    port = free_port()
    data.mkdir()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
           "--appendonly", "yes", "--save", "", "--daemonize", "no"]
    child = sup.start(ChildSpec("redis", lambda _n: cmd, restart=False, stop_order=2))
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 15
    try:
        while True:
            try:
                client.ping()
                return url
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                sup.poll()  # raises if it exited
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server (pid {child.pid}) did not start") from None
                time.sleep(0.05)
    finally:
        client.close()


class Stack:
    """Fail-fast processes for the benchmarks (``ops/bench/service.py``): the supervisor
    with restarts off, so any exit raises in ``check_alive``; stops workers, then the
    gateway, then Redis."""

    def __init__(self, log_dir: Path | None) -> None:
        self.sup = Supervisor(log_dir=log_dir)
        self.tmp = Path(tempfile.mkdtemp(prefix="ferry-stack-"))

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        order, grace = (1, 15.0) if name == "gateway" else (0, 60.0)
        self.sup.start(ChildSpec(name, lambda _n: cmd, env, restart=False, stop_order=order,
                                 stop_grace_s=grace))

    def start_redis(self) -> str:
        return start_redis(self.sup, self.tmp / "redis")

    def check_alive(self) -> None:
        self.sup.poll()  # Fatal (a RuntimeError) if anything exited

    def stop(self) -> None:
        self.sup.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
