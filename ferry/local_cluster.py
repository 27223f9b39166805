"""A Redis Cluster on loopback: free node ports, each node's command line, and the
``redis-cli --cluster create`` that joins them.

``ferry up --redis-shards N --redis-replicas R`` runs the nodes as supervised children,
and the cluster tests (``tests/redis_cluster.py``) and benchmarks run them as plain
processes; both start them with :func:`node_command` and join them with
:func:`create_cluster`, so there is one way to make a local cluster.

A node also listens on its *bus port*, its port + 10000, where nodes gossip and vote on
failovers; so a node port must be at most 55535 and both ports must be free.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BUS_PORT_OFFSET = 10_000
MAX_NODE_PORT = 65_535 - BUS_PORT_OFFSET
_LOWEST_NODE_PORT = 20_000  # above the usual services


def _node_port_range() -> tuple[int, int]:
    """Node ports whose bus ports (+10000) stay under the kernel's ephemeral range: a bus
    port in it can be taken by any outgoing connection between the check and the bind,
    and the node then exits at start."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768
    high = min(ephemeral_low, MAX_NODE_PORT + BUS_PORT_OFFSET) - BUS_PORT_OFFSET
    if high - _LOWEST_NODE_PORT < 1000:  # an unusual range: fall back to a wide one
        return _LOWEST_NODE_PORT, 45_000
    return _LOWEST_NODE_PORT, high


@dataclass(frozen=True)
class ClusterLayout:
    """How many masters and replicas per master; ``node_timeout_ms`` is how long a master
    may be unreachable before its replica is promoted (Redis' default: 15000)."""

    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 5000

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError(f"masters: {self.masters}; Redis Cluster needs at least 3")
        if self.replicas < 0:
            raise ValueError(f"replicas: {self.replicas} must be >= 0")
        if self.node_timeout_ms < 100:
            raise ValueError(f"node_timeout_ms: {self.node_timeout_ms} must be >= 100")

    @property
    def nodes(self) -> int:
        return self.masters * (1 + self.replicas)


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_node_ports(count: int, taken: set[int] | None = None) -> list[int]:
    """``count`` ports at most 55535 whose port and bus port (+10000) are both free now."""
    taken = set(taken or ())
    ports: list[int] = []
    for _ in range(count * 200):
        if len(ports) == count:
            return ports
        port = random.randrange(*_node_port_range())
        if port in taken or port + BUS_PORT_OFFSET in taken:
            continue
        if _is_free(port) and _is_free(port + BUS_PORT_OFFSET):
            ports.append(port)
            taken |= {port, port + BUS_PORT_OFFSET}
    raise RuntimeError(f"found only {len(ports)} of {count} free cluster node ports")


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found on PATH")
    return path


def node_command(port: int, data_dir: Path, layout: ClusterLayout,
                 appendonly: bool = False) -> list[str]:
    """The argv of one cluster node: loopback only, its own ``nodes.conf`` in ``data_dir``."""
    if not 0 < port <= MAX_NODE_PORT:
        raise ValueError(f"port: {port}; a cluster node port must be at most {MAX_NODE_PORT} "
                         "(its bus port is port + 10000)")
    return [
        redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(layout.node_timeout_ms),
        "--appendonly", "yes" if appendonly else "no", "--save", "", "--daemonize", "no",
        "--logfile", "redis.log",
        # a replica syncs at once instead of after 5 s: until it has, it cannot be promoted
        "--repl-diskless-sync-delay", "0",
        # while one master fails over, the others keep serving their slots (the default,
        # yes, refuses every command cluster-wide until the promotion)
        "--cluster-require-full-coverage", "no",
    ]


def wait_answering(ports: list[int], timeout: float = 15.0) -> None:
    """Until every node answers PING."""
    import redis

    deadline = time.monotonic() + timeout
    for port in ports:
        probe = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                try:
                    if probe.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster node on {port} did not start") from None
                    time.sleep(0.05)
        finally:
            probe.close()


def create_cluster(ports: list[int], layout: ClusterLayout, timeout: float = 30.0) -> None:
    """Join started nodes into one cluster (the first ``masters`` ports become masters,
    the rest their replicas) and wait until every node says ``cluster_state:ok``."""
    if len(ports) != layout.nodes:
        raise ValueError(f"ports: {len(ports)} given, the layout has {layout.nodes} nodes")
    cmd = [redis_binary("redis-cli"), "--cluster", "create",
           *(f"127.0.0.1:{p}" for p in ports),
           "--cluster-replicas", str(layout.replicas), "--cluster-yes"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")
    wait_cluster_ok(ports, timeout)


def wait_cluster_ok(ports: list[int], timeout: float = 30.0) -> None:
    """Until every node of ``ports`` reports ``cluster_state:ok``, knows all of them (a
    fresh cluster converges by gossip, a failover by a vote), and every replica among them
    is in sync with its master (until then it could not take over)."""
    import redis

    deadline = time.monotonic() + timeout
    clients = [redis.Redis(port=p, socket_connect_timeout=0.5, socket_timeout=1) for p in ports]
    try:
        while True:
            if all(_node_ok(c, len(ports)) for c in clients):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster on {ports} not ok after {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        for c in clients:
            c.close()


def _node_ok(client: object, nodes: int) -> bool:
    import redis

    try:
        info = client.cluster("INFO")  # type: ignore[attr-defined]
        replication = client.info("replication")  # type: ignore[attr-defined]
    except redis.RedisError:
        return False
    if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
        return False
    text = info if isinstance(info, str) else info.decode() if isinstance(info, bytes) else ""
    if isinstance(info, dict):
        state, known = info.get("cluster_state"), int(info.get("cluster_known_nodes", 0))
    else:
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        state, known = fields.get("cluster_state"), int(fields.get("cluster_known_nodes", 0))
    return state == "ok" and known >= nodes


def slot_owners(port: int) -> set[int]:
    """Ports of the nodes serving slots, in node ``port``'s view (``CLUSTER SLOTS``)."""
    import redis

    with redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1) as r:
        return {int(row[2][1]) for row in r.cluster("SLOTS")}


def wait_promoted(live_ports: list[int], dead_port: int, timeout: float = 60.0) -> float:
    """Seconds until every node of ``live_ports`` says that others serve all of
    ``dead_port``'s slots (its replica was promoted) and the cluster is ok."""
    import redis

    start = time.monotonic()
    while True:
        try:
            if all(dead_port not in slot_owners(p) for p in live_ports):
                wait_cluster_ok(live_ports, max(0.1, timeout - (time.monotonic() - start)))
                return time.monotonic() - start
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"no replica of {dead_port} promoted in {timeout} s")
        time.sleep(0.02)
