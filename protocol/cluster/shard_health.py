"""Which stream shards of a Redis Cluster answer, as one process sees them (``ShardHealth``),
and the quick probes that tell a lost shard has come back.

With one master and its replica unreachable, every command for that shard's slots waits
out a socket timeout, and redis-py's cluster client retries it and re-reads the topology
from every node (the unreachable ones too) before it gives up: a read that touches every
shard (the gateway's queue-lag check, a worker's intake pass, a heartbeat's queue
numbers) then stalls the whole fleet for a minute. So the parties read shard by shard:
a shard whose read fails is *lost* for this process and skipped (its requests get a
prompt 503 at the gateway; a worker serves the other shards), and a probe (PING its
master directly, with a short timeout, re-reading the topology when the master moved)
tells when it is back. A normal failover looks the same for a moment: the shard is lost
until its promoted replica answers the probe, a second or two.

A shard is named by its number ``k`` of ``ClusterKeys.shard_streams(k)``; with the shards
spread over the masters (``protocol/cluster/shard_slots.py``) a request's own keys live on its
shard's master, so a lost shard is also where its requests' job hashes and channels are.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for a lost shard's master to answer PING."""

PROBE_INTERVAL_S = 1.0
"""How often a lost shard is probed."""


class ShardDownError(RedisConnectionError):
    """A request's stream shard is unreachable: no command for it is sent (it would wait
    out timeouts); the message names the shard, never a host (it reaches HTTP clients)."""

    def __init__(self, shard: int) -> None:
        super().__init__(f"stream shard {shard} is unreachable (its master and replicas do "
                         "not answer): requests that hash to it cannot be queued or read now")
        self.shard = shard


@dataclass(frozen=True)
class LostShard:
    """A shard this process could not reach: since when (wall clock), why, and the master
    it was last known on (``host:port``, or None when no master serves its slots)."""

    shard: int
    since: float
    error: str
    node: str | None = None


class ShardHealth:
    """Lost shards and when each is probed next. Thread-safe (the worker's threads share
    one); holds no connection, so the asyncio gateway uses it as is."""

    def __init__(self, shards: int, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        self.shards = shards
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._lost: dict[int, LostShard] = {}
        self._next_probe: dict[int, float] = {}

    def lost(self) -> dict[int, LostShard]:
        with self._lock:
            return dict(self._lost)

    def is_lost(self, shard: int) -> bool:
        with self._lock:
            return shard in self._lost

    def usable(self) -> list[int]:
        """The shards not known lost, in order."""
        with self._lock:
            return [k for k in range(self.shards) if k not in self._lost]

    def failed(self, shard: int, error: BaseException | str, node: str | None = None) -> bool:
        """Mark ``shard`` lost (kept from its first failure); True when it was not yet."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            known = self._lost.get(shard)
            self._lost[shard] = LostShard(shard, known.since if known else time.time(),
                                          why[:300], node or (known.node if known else None))
            self._next_probe[shard] = time.monotonic() + self.probe_interval_s
            return known is None

    def recovered(self, shard: int) -> bool:
        """Mark ``shard`` reachable again; True when it was lost."""
        with self._lock:
            self._next_probe.pop(shard, None)
            return self._lost.pop(shard, None) is not None

    def probe_due(self, shard: int) -> bool:
        """Whether a lost ``shard`` is due for a probe (nothing is scheduled by asking)."""
        with self._lock:
            at = self._next_probe.get(shard)
            return at is not None and at <= time.monotonic()

    def due(self) -> list[int]:
        """Lost shards whose probe is due now (each is scheduled for the next interval)."""
        now = time.monotonic()
        with self._lock:
            ready = [k for k, at in self._next_probe.items() if at <= now]
            for k in ready:
                self._next_probe[k] = now + self.probe_interval_s
            return ready


def master_name(rc: Any, key: str) -> str | None:
    """``host:port`` of the master of ``key``'s slot in the client's slot map (no network),
    or None when no master serves that slot."""
    node = _master(rc, key)
    return None if node is None else str(node.name)


def _master(rc: Any, key: str) -> Any:
    """The master node of ``key``'s slot in the client's slot map (sync and asyncio
    clients alike, no network); None when no master serves that slot."""
    try:
        return rc.get_node_from_key(key)
    except Exception:  # SlotNotCoveredError, or no topology known yet
        return None


def _ping(rc: Any, key: str, timeout: float) -> str | None:
    """None when the master of ``key``'s slot answers PING within ``timeout`` (a
    connection of its own, not the client's pool: no retries, no topology refresh)."""
    node = _master(rc, key)
    if node is None:
        return "no master serves its slots"
    pool = rc.get_redis_connection(node).connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout,
              "socket_connect_timeout": timeout}
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **kwargs))
    try:
        client.ping()
        return None
    except (redis.RedisError, OSError) as exc:
        return f"{node.name}: {type(exc).__name__}"
    finally:
        client.close()


def probe(rc: Any, key: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the shard holding ``key`` answers again; else why not. A sync
    ``RedisCluster``: best with a client of its own and short timeouts (the topology
    refresh asks every node it knows, the unreachable ones too)."""
    why = _ping(rc, key, timeout)
    if why is None:
        return None
    try:  # promoted elsewhere, or back after a while: read the topology again
        rc.nodes_manager.initialize()
    except Exception as exc:
        return f"{why}; topology unreadable: {type(exc).__name__}"
    return _ping(rc, key, timeout)


async def _aping(rc: Any, key: str, timeout: float) -> str | None:
    node = _master(rc, key)
    if node is None:
        return "no master serves its slots"
    try:  # a cancelled read disconnects its connection: none goes back half-read
        await asyncio.wait_for(node.execute_command("PING"), timeout)
        return None
    except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
        return f"{node.name}: {type(exc).__name__}"


async def aprobe(rc: Any, key: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """The asyncio twin of :func:`probe`, each step bounded by ``timeout``."""
    why = await _aping(rc, key, timeout)
    if why is None:
        return None
    try:
        await asyncio.wait_for(rc.nodes_manager.initialize(), timeout * 2)
    except Exception as exc:
        return f"{why}; topology unreadable: {type(exc).__name__}"
    return await _aping(rc, key, timeout)
