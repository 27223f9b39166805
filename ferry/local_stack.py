"""Processes of a Ferry stack on one machine: free ports, a redis-server child (or a local
Redis Cluster's nodes) under the supervisor, and the fail-fast ``Stack`` the service
benchmarks start their parts with.

``ferry up`` and ``ops/bench/service/service.py`` both need a private Redis started and pinged the
same way; the benchmark wants no restarts (an exit is a failed measurement), so it gets
the supervisor with restarts off.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import typer

from ferry.local_cluster import (
    ClusterLayout,
    create_cluster,
    free_node_ports,
    node_command,
    wait_answering,
)
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


def _fixed(cmd: list[str]) -> Callable[[int], list[str]]:
    """The same argv for every incarnation (a restarted node keeps its port and dir)."""
    return lambda _incarnation: cmd


def start_redis_cluster(sup: Supervisor, data: Path, layout: ClusterLayout) -> str:
    """A private Redis Cluster on loopback (``layout.masters`` masters with
    ``layout.replicas`` replicas each), one supervised child per node, joined with
    ``redis-cli --cluster create``; returns a URL naming its first node.

    Unlike the single Redis, a node that dies is restarted (same port, same ``nodes.conf``):
    its replica has taken over meanwhile, and it rejoins as a replica, so the stack rides
    through it instead of stopping."""
    try:
        ports = free_node_ports(layout.nodes)
        data.mkdir()
        for i, port in enumerate(ports):
            node_dir = data / str(port)
            node_dir.mkdir()
            cmd = node_command(port, node_dir, layout, appendonly=True)
            sup.start(ChildSpec(f"redis-{i}", _fixed(cmd), stop_order=2))
        wait_answering(ports)
        create_cluster(ports, layout)
    except FileNotFoundError as exc:
        raise typer.BadParameter(f"{exc}; pass --redis-url") from exc
    except (TimeoutError, RuntimeError) as exc:
        sup.poll()  # a node that exited says why
        raise RuntimeError(f"Redis Cluster did not form: {exc}") from exc
    return f"redis://127.0.0.1:{ports[0]}/0"


class Stack:
    """Fail-fast processes for the benchmarks (``ops/bench/service/service.py``): the supervisor
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
