"""Redis Cluster plumbing shared by the clients, the gateway and the workers.

redis-py's cluster clients (``redis.cluster.RedisCluster`` and its asyncio twin) route each
command by its keys' slot, follow ``MOVED``/``ASK`` and refresh their view of the topology
after a failover. Two things they do not do, which Ferry needs, are here:

* **Node pipelines with WAIT.** ``WAIT n timeout`` waits for the replication of the writes
  *of the connection it runs on*, so it must follow the writes on the same connection:
  :func:`run_on_master` runs a pipeline on the master of one key's slot (writes, then WAIT)
  and, if the slot moved or the node is gone, refreshes the topology and tries again.
* **Transient errors.** A failover shows as refused connections, ``CLUSTERDOWN``,
  ``MOVED``, ``TRYAGAIN``, ``READONLY`` (a demoted master) or a slot not covered for a
  moment; :data:`TRANSIENT_CLUSTER_ERRORS` lists them so every loop can back off and
  retry instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import redis
import redis.asyncio.cluster as acluster
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    ReadOnlyError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TRANSIENT_CLUSTER_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, ClusterError,
    MovedError, AskError, TryAgainError, ReadOnlyError, SlotNotCoveredError,
)
"""What a failover or a resharding looks like from a client: refresh and retry."""

RETRY_WINDOW_S = 20.0
"""How long a node pipeline keeps retrying through a failover (promotion takes about
``cluster-node-timeout`` plus an election, seconds) before it gives up."""


class NotReplicatedError(redis.RedisError):
    """A write reached its master, but no replica confirmed it in time (``WAIT``): were
    the master to fail now, the write could be lost with it."""


@dataclass(frozen=True)
class Replication:
    """``WAIT replicas timeout_ms`` after the writes that must survive a failover (the
    enqueue; a terminal event before its entry is acknowledged). ``replicas=0``: no WAIT."""

    replicas: int = 1
    timeout_ms: int = 2000

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas: {self.replicas} must be >= 0")
        if self.timeout_ms < 1:
            raise ValueError(f"timeout_ms: {self.timeout_ms} must be >= 1")

    def check(self, acknowledged: int, what: str) -> None:
        """Raise ``NotReplicatedError`` unless ``acknowledged`` replicas are enough."""
        if acknowledged < self.replicas:
            raise NotReplicatedError(
                f"{what}: {acknowledged} of {self.replicas} replica(s) acknowledged the write "
                f"within {self.timeout_ms} ms (WAIT); a failover now could lose it")


def check_cluster_url(url: str) -> None:
    """Redis Cluster has database 0 only: refuse a URL that names another one."""
    parsed = urlparse(url)
    db = parsed.path.lstrip("/") or parse_qs(parsed.query).get("db", ["0"])[0]
    if db not in ("", "0"):
        raise ValueError(f"redis_url: database {db} requested, but Redis Cluster has only "
                         "database 0 (use /0 or leave the path out)")


def cluster_client(url: str, **kwargs: Any) -> RedisCluster:
    """A sync cluster client; the topology is discovered from the node ``url`` names.

    It accepts a topology where some slots have no master (``require_full_coverage``
    off, as the cluster's own setting should be): with a master and its replicas lost,
    redis-py's default refuses *every* topology it reads, so a client stops working for
    all shards instead of one (``protocol/cluster/shard_health.py``). A ``retry`` applies once
    the client is made: making it asks a *default node* for the command table, and only
    the default retries try another when that node does not answer."""
    check_cluster_url(url)
    kwargs.setdefault("require_full_coverage", False)
    retry = kwargs.pop("retry", None)
    client = RedisCluster.from_url(url, **kwargs)
    if retry is not None:
        client.set_retry(retry)
    return client


def async_cluster_client(url: str, **kwargs: Any) -> acluster.RedisCluster:
    """An asyncio cluster client; the topology is discovered from the node ``url`` names
    (partial coverage accepted, as for :func:`cluster_client`)."""
    check_cluster_url(url)
    kwargs.setdefault("require_full_coverage", False)
    return acluster.RedisCluster.from_url(url, **kwargs)


def refresh_topology(rc: RedisCluster) -> None:
    """Re-read the slot map from any reachable node (after a failover or a MOVED)."""
    with contextlib.suppress(Exception):  # no node reachable now: the next try refreshes
        rc.nodes_manager.initialize()


def run_on_master(rc: RedisCluster, key: str, commands: list[tuple[Any, ...]],
                  window_s: float = RETRY_WINDOW_S) -> list[Any]:
    """Run ``commands`` on the master of ``key``'s slot, in one round trip on one
    connection, and return their replies (errors raised). Retries through a failover for
    up to ``window_s``: every command here must be safe to send twice."""
    deadline, delay = time.monotonic() + window_s, 0.05
    while True:
        try:
            node = rc.get_node_from_key(key)
            pipe = rc.get_redis_connection(node).pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())
        except TRANSIENT_CLUSTER_ERRORS:
            if time.monotonic() > deadline:
                raise
            refresh_topology(rc)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def node_pipeline(r: Any, key: str) -> Any:
    """A pipeline (no transaction) on the one node holding ``key``'s slot: on a cluster,
    that master's own connection, which neither retries nor falls back (after a timeout a
    cluster pipeline resends every command alone, each waiting out its own timeout and
    re-reading the topology: one unreachable master would cost a minute); on one Redis,
    the client's own. Every key of it must share that slot (one shard's lanes, say); read
    the replies with :func:`raise_moved`."""
    return node_client(r, key).pipeline(transaction=False)


def node_client(r: Any, key: str) -> Any:
    """The client of the node holding ``key``'s slot (see :func:`node_pipeline`); ``r``
    itself on one Redis."""
    if not hasattr(r, "nodes_manager"):
        return r
    return r.get_redis_connection(r.get_node_from_key(key))


def raise_moved(replies: list[Any]) -> list[Any]:
    """``replies`` of a :func:`node_pipeline` run with ``raise_on_error=False``; a slot
    that moved away (``MOVED``/``ASK``: a failover, a resharding) is raised, so the caller
    re-reads the topology and tries again, instead of taking the error for an answer."""
    for reply in replies:
        if isinstance(reply, (MovedError, AskError)):
            raise reply
    return replies


async def arefresh_topology(rc: acluster.RedisCluster) -> None:
    """The asyncio twin of :func:`refresh_topology`."""
    with contextlib.suppress(Exception):
        await rc.nodes_manager.initialize()


async def arun_on_master(rc: acluster.RedisCluster, key: str,
                         commands: list[tuple[Any, ...]],
                         window_s: float = RETRY_WINDOW_S) -> list[Any]:
    """The asyncio twin of :func:`run_on_master`, for a list of raw commands."""
    deadline, delay = time.monotonic() + window_s, 0.05
    while True:
        try:
            await rc.initialize()  # a no-op once the topology is known
            node = rc.get_node_from_key(key)
            if node is None:
                raise SlotNotCoveredError(f"no master for the slot of {key!r}")
            return await _node_pipeline(node, commands)
        except TRANSIENT_CLUSTER_ERRORS:
            if time.monotonic() > deadline:
                raise
            await arefresh_topology(rc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def _node_pipeline(node: acluster.ClusterNode, commands: list[tuple[Any, ...]]
                         ) -> list[Any]:
    """Send ``commands`` on one connection of ``node`` and read every reply; the first
    error reply is raised (after all replies are read, so the connection stays usable)."""
    conn = node.acquire_connection()
    try:
        await conn.send_packed_command(conn.pack_commands(commands), False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await conn.disconnect()
        node.release(conn)
        raise
    node.release(conn)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies

