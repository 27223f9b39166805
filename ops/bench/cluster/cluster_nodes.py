"""Redis for ``ops/bench/cluster/cluster.py``: one redis-server, or a cluster of 1 or 3 masters
with a replica each, on loopback; each master's CPU time read from ``INFO CPU``.

``redis-cli --cluster create`` wants at least 3 masters, so the 1-master cluster is made
by hand: one node gets every slot (``CLUSTER ADDSLOTSRANGE``), a second one meets it and
becomes its replica.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ferry.local_cluster import (
    ClusterLayout,
    create_cluster,
    free_node_ports,
    node_command,
    redis_binary,
    wait_answering,
    wait_cluster_ok,
)


@dataclass
class Nodes:
    """Started redis-servers: the URL clients use, whether it is a cluster, the masters."""

    url: str
    cluster: bool
    masters: list[int]
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def cpu_s(self, port: int) -> float:
        """CPU seconds (user + system) the node on ``port`` has used so far."""
        with contextlib.closing(redis.Redis(port=port)) as r:
            info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@contextlib.contextmanager
def start_single(tmp: Path) -> Iterator[Nodes]:
    """One redis-server, no persistence, no replica: today's single-Redis setup."""
    port = free_node_ports(1)[0]
    proc = _spawn([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(tmp)])
    nodes = Nodes(f"redis://127.0.0.1:{port}/0", False, [port], {port: proc})
    try:
        wait_answering([port])
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def start_cluster(tmp: Path, masters: int, node_timeout_ms: int = 5000) -> Iterator[Nodes]:
    """A cluster of ``masters`` masters (1 or >= 3), one replica each."""
    layout = ClusterLayout(masters=max(masters, 3), replicas=1, node_timeout_ms=node_timeout_ms)
    ports = free_node_ports(2 * masters)
    nodes = Nodes(f"redis://127.0.0.1:{ports[0]}/0", True, ports[:masters])
    try:
        for port in ports:
            (tmp / str(port)).mkdir(parents=True)
            nodes.procs[port] = _spawn(node_command(port, tmp / str(port), layout))
        wait_answering(ports)
        if masters == 1:
            _one_master(ports[0], ports[1])
        else:
            create_cluster(ports, layout)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _one_master(master: int, replica: int) -> None:
    with contextlib.closing(redis.Redis(port=master)) as m, \
            contextlib.closing(redis.Redis(port=replica)) as r:
        m.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        r.execute_command("CLUSTER", "MEET", "127.0.0.1", master)
        master_id = m.execute_command("CLUSTER", "MYID").decode()
        deadline = time.monotonic() + 30
        while True:
            try:
                r.execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except redis.ResponseError:  # does not know the master yet: gossip is on its way
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    wait_cluster_ok([master, replica])
