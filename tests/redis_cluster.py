"""A private Redis Cluster per test module: 3 masters and 3 replicas on loopback.

The nodes are real ``redis-server`` processes started and joined the way ``ferry up
--redis-shards`` does it (``ferry/local_cluster.py``), with a short ``cluster-node-timeout``
so a killed master's replica is promoted in about two seconds. ``kill(port)`` is a
``kill -9`` of one node; ``restart(port)`` brings it back (it rejoins from its
``nodes.conf``, as a replica of whoever was promoted meanwhile).

Use the fixtures explicitly, e.g. in a ``conftest.py``::

    from tests.redis_cluster import redis_cluster, cluster_client  # noqa: F401
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from ferry.local_cluster import (
    ClusterLayout,
    create_cluster,
    free_node_ports,
    node_command,
    slot_owners,
    wait_answering,
    wait_cluster_ok,
    wait_promoted,
)

_LIVE: set[subprocess.Popen[bytes]] = set()
TEST_LAYOUT = ClusterLayout(masters=3, replicas=1, node_timeout_ms=1000)


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()


class LocalCluster:
    """Cluster nodes on 127.0.0.1, each restartable on its port with its data dir, or
    frozen (SIGSTOP) and thawed."""

    def __init__(self, layout: ClusterLayout = TEST_LAYOUT) -> None:
        self.layout = layout
        self.ports = free_node_ports(layout.nodes)
        self.root = Path(tempfile.mkdtemp(prefix="ferry-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """Any node names the cluster; clients discover the rest."""
        return f"redis://127.0.0.1:{self.live_ports[0]}/0"

    @property
    def live_ports(self) -> list[int]:
        return [p for p in self.ports if p in self.procs and self.procs[p].poll() is None]

    def _spawn(self, port: int) -> None:
        data = self.root / str(port)
        data.mkdir(exist_ok=True)
        proc = subprocess.Popen(node_command(port, data, self.layout),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs[port] = proc
        _LIVE.add(proc)

    def start(self) -> LocalCluster:
        for attempt in range(3):
            for port in self.ports:
                self._spawn(port)
            try:
                wait_answering(self.ports)
                break
            except TimeoutError:  # a port was taken between the check and the bind
                exited = [p for p, proc in self.procs.items() if proc.poll() is not None]
                if attempt == 2 or not exited:
                    raise
                for port in list(self.procs):
                    self.kill(port)
                self.procs.clear()
                self.ports = free_node_ports(self.layout.nodes)
        create_cluster(self.ports, self.layout)
        return self

    def client(self, **kwargs: object) -> RedisCluster:
        return RedisCluster.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1)

    def masters(self) -> list[int]:
        """Ports of the nodes serving slots, in a live node's view."""
        return sorted(self.slot_owners(self.live_ports[0]))

    def master_of(self, key: str) -> int:
        """Port of the master that owns ``key``'s slot now."""
        with contextlib.closing(self.client()) as rc:
            return int(rc.get_node_from_key(key).port)

    def kill(self, port: int) -> None:
        """``kill -9`` of one node."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        if proc is not None:
            _LIVE.discard(proc)

    def freeze(self, port: int) -> None:
        """SIGSTOP of one node: it keeps its sockets but answers nothing (a hung host, a
        network partition), so clients wait out their timeouts instead of being refused."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        """SIGCONT of a frozen node."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    def replicas_of(self, master: int, timeout: float = 15.0) -> list[int]:
        """Ports of the replicas of the master on ``master``, in the master's own view
        (``INFO replication``: the replicas connected to it). ``CLUSTER NODES`` was used
        before, but a master learns a new replica's role by gossip, which on a loaded CI
        machine lagged the replica's own "link up" (an empty list, and a frozen master's
        replica promoted under a test that meant to freeze both). Waits until every
        replica the layout gives a master is connected."""
        want = self.layout.replicas
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.closing(self.node(master)) as r:
                info = r.info("replication")
            ports = sorted(int(v["port"]) for k, v in info.items()
                           if k.startswith("slave") and isinstance(v, dict)
                           and v.get("state") == "online")
            if len(ports) >= want or time.monotonic() > deadline:
                return ports
            time.sleep(0.1)

    def restart(self, port: int) -> None:
        """Start a killed node again on its port and wait until the cluster is whole."""
        self.kill(port)
        self._spawn(port)
        wait_answering([port])
        wait_cluster_ok(self.ports, timeout=60)

    def slot_owners(self, port: int) -> set[int]:
        """Ports serving slots, in node ``port``'s view (``CLUSTER SLOTS``)."""
        return slot_owners(port)

    def wait_promoted(self, dead_port: int, timeout: float = 30.0) -> float:
        """Seconds until the live nodes say ``dead_port``'s replica took over."""
        return wait_promoted(self.live_ports, dead_port, timeout)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every node is up, in sync and agrees the cluster is ok (after a test froze
        or killed one)."""
        wait_cluster_ok(self.live_ports, timeout)

    def flushall(self) -> None:
        for port in self.masters():
            with contextlib.closing(self.node(port)) as r:
                r.flushall()

    def close(self) -> None:
        for port in list(self.procs):
            proc = self.procs[port]
            self.thaw(port)  # a stopped node would not act on SIGTERM
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            _LIVE.discard(proc)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A fresh 3-master, 3-replica cluster for the test module, removed afterwards."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_client(redis_cluster: LocalCluster) -> Iterator[RedisCluster]:
    """A cluster client on emptied masters, so tests in one module do not see each other."""
    redis_cluster.flushall()
    client = redis_cluster.client()
    yield client
    client.close()
