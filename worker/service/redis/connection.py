"""Redis plumbing shared by the worker's I/O threads: settings, connections, backoff, Lua.

The worker talks to Redis from three threads (intake, outbox, control; see
``docs/service.md``) and never from the engine loop. Each thread handles a lost connection
the same way: back off, reconnect, carry on where it was. What makes "carry on" safe is
that every write that matters is idempotent and fenced (``worker/service/redis/leases.py``), so a
command retried after a reply was lost is never applied twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException
from redis.retry import Retry

from protocol.cluster.keys import keys_for
from protocol.cluster.nodes import (
    TRANSIENT_CLUSTER_ERRORS,
    Replication,
    check_cluster_url,
    cluster_client,
    refresh_topology,
)
from protocol.cluster.shard_slots import DEFAULT_SHARDS
from protocol.dead_letters import DeadLetterBounds
from protocol.keys import Keys
from protocol.models import ID_PATTERN
from protocol.store import Ttls

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = TRANSIENT_CLUSTER_ERRORS
"""Errors that mean "Redis is unreachable right now" (refused connections, timeouts; on a
cluster also a failover's CLUSTERDOWN, MOVED, TRYAGAIN, READONLY): retry, never crash."""


def default_worker_id() -> str:
    """``host-pid-xxxx``: unique per process, readable in ``ferry top``, key-safe."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "worker"
    return f"{host}-{os.getpid()}-{random.randrange(16**4):04x}"


@dataclass(frozen=True)
class WorkerSettings:
    """Everything the service needs besides the engine; one object instead of loose args."""

    redis_url: str = "redis://localhost:6379/0"
    prefix: str = "ferry"
    worker_id: str = field(default_factory=default_worker_id)
    model_name: str = "ferry"
    lease_s: float = 30.0  # an entry idle this long (no renewal) may be reclaimed
    max_deliveries: int = 3  # a delivery past this goes to the dead-letter stream
    drain_timeout_s: float = 30.0  # SIGTERM: finish in-flight work for this long
    heartbeat_interval_s: float = 1.0
    metrics_port: int = 0  # 0: no Prometheus endpoint; taken: the next free one
    # Touched after every heartbeat written: a container's health check reads its age
    # (no port to find when several workers share a host network). None: off.
    health_file: str | None = None
    metrics_host: str = "127.0.0.1"  # like the gateway and Redis: open it on purpose
    # Entries held beyond the running batch (read but not started): small, so that a
    # burst spreads over the idle workers instead of queueing behind one worker's prefills
    prefetch: int = 4
    busy_block_ms: int = 50  # XREADGROUP BLOCK while the batch is running
    idle_block_ms: int = 1000  # ... and while it is empty
    max_outbox_events: int = 100_000  # buffered while Redis is away; then the loop waits
    ttls: Ttls = field(default_factory=Ttls)
    dead_letters: DeadLetterBounds = field(default_factory=DeadLetterBounds)
    # Redis Cluster: the URL names any node; the request streams are split into shards,
    # and a terminal event is on a replica (WAIT) before its entry is acknowledged.
    redis_cluster: bool = False
    stream_shards: int = DEFAULT_SHARDS
    replication: Replication = field(default_factory=Replication)
    # Speculative decoding: share finished outputs with the model's other workers
    # through the stream ``Keys.drafts`` (worker/service/sidecars/draft_feed.py), capped at about
    # this many entries; off: each worker drafts from its own outputs only.
    spec_fleet: bool = True
    spec_fleet_entries: int = 4096
    # text, events and their fenced writes in a second process (output_proc/service.py),
    # off the engine loop's GIL; False: the engine loop makes them (one process)
    output_process: bool = True
    # Directories runtime LoRA loads may read (FERRY_LORA_ROOTS, else FERRY_LORA_DIR; none:
    # only the worker's own --lora adapters load): protocol/lora/paths.py
    lora_roots: tuple[str, ...] = ()
    # An output process whose main loop answers nothing for this long (stopped, deadlocked)
    # is killed and the worker exits 71, as when it dies (worker/service/output_proc/link.py)
    output_hang_s: float = 5.0

    def __post_init__(self) -> None:
        if not re.match(ID_PATTERN, self.worker_id):
            raise ValueError(f"worker_id: {self.worker_id!r} must match {ID_PATTERN}")
        keys_for(self.prefix, self.redis_cluster, self.stream_shards)  # names the bad field
        if self.redis_cluster:
            check_cluster_url(self.redis_url)
        if self.lease_s <= 0:
            raise ValueError("lease_s: must be > 0")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries: must be >= 1")
        if self.prefetch < 1:
            raise ValueError("prefetch: must be >= 1")
        if self.spec_fleet_entries < 1:
            raise ValueError("spec_fleet_entries: must be >= 1")
        if not self.output_hang_s > 0:
            raise ValueError("output_hang_s: must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s: must be >= 0")
        if self.ttls.heartbeat_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s: {self.ttls.heartbeat_s} must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}), or a live worker "
                "looks dead between two beats and loses its requests")

    @property
    def keys(self) -> Keys:
        return keys_for(self.prefix, self.redis_cluster, self.stream_shards)

    def connect(self, socket_timeout: float = 5.0) -> Any:
        """A client for one thread: ``connect`` below, or a cluster client. The cluster
        client does not retry a command itself (redis-py's default tries ten times, each
        after re-reading the topology from every node): the threads' own loops retry, and
        a shard that stays away is skipped (``worker/service/redis/shard_gate.py``)."""
        if self.redis_cluster:
            return LazyClusterClient(lambda: cluster_client(
                self.redis_url, socket_timeout=socket_timeout,
                socket_connect_timeout=min(2.0, socket_timeout), socket_keepalive=True,
                retry=Retry(NoBackoff(), 0)))
        return connect(self.redis_url, socket_timeout)

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    @property
    def renew_interval_s(self) -> float:
        """Renew three times per lease, so one slow round trip never loses it."""
        return self.lease_s / 3

    @property
    def reap_interval_s(self) -> float:
        return min(self.lease_s / 2, 5.0)

    @property
    def liveness_ms(self) -> int:
        """A consumer whose heartbeat key has expired and that has not touched the stream
        for this long is dead: its entries are taken over without waiting for the lease."""
        return int(self.ttls.heartbeat_s * 1000)


def connect(url: str, socket_timeout: float = 5.0) -> redis.Redis:
    """A client for one thread's use. One silent retry re-dials a connection that a Redis
    restart closed; anything longer is the caller's backoff loop, where it is logged."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=2.0,
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=30,
    )


class LazyClusterClient:
    """A ``RedisCluster`` made on first use. Making one asks a node for the topology at
    once, while a worker must start (and wait, with backoff) when the cluster is away, as
    it does for one Redis; so the first command makes it, and a cluster not reachable yet
    is a ``ConnectionError`` like any other outage."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = self._make()
                    except RedisClusterException as exc:  # no node answered
                        raise RedisConnectionError(str(exc)) from exc
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def warm(self) -> None:
        """Make the client now, if the cluster answers: it then knows every node, and
        finds the cluster later through any of them, not only through the URL's (which
        may be the one that is down by then)."""
        with contextlib.suppress(RedisConnectionError):
            self._get()

    def refresh(self) -> None:
        if self._client is not None:
            refresh_topology(self._client)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def recover(r: Any) -> None:
    """After a transient error: a cluster client re-reads the topology (a failover moved
    slots to a promoted replica); a plain client simply reconnects on its next command."""
    if isinstance(r, LazyClusterClient):
        r.refresh()


class Backoff:
    """Exponential backoff with jitter for reconnect loops; ``reset()`` after a success."""

    def __init__(self, base: float = 0.05, cap: float = 2.0) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0

    def reset(self) -> None:
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 16))
        return delay * random.uniform(0.5, 1.0)

    def wait(self, stop: threading.Event) -> None:
        """Sleep the next delay, or less if ``stop`` is set meanwhile."""
        stop.wait(self.next_delay())


class LuaScript:
    """A script run by EVALSHA inside pipelines, reloaded when Redis lost its script cache.

    redis-py's own ``Script`` objects in a pipeline cost an extra ``SCRIPT EXISTS`` round
    trip on every execute; here a restart's ``NOSCRIPT`` is handled by the caller instead:
    ``load()`` and resend (every script the worker runs is safe to resend).
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def load(self, r: redis.Redis) -> None:
        r.script_load(self.text)

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        # by name: a cluster pipeline blocks evalsha() but routes EVALSHA by its keys
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def run(self, r: redis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.load(r)
            return r.evalsha(self.sha, len(keys), *keys, *args)


def execute_scripts(r: redis.Redis, build: Any, scripts: list[LuaScript],
                    preload: bool = False) -> list[Any]:
    """Run a non-transactional pipeline built by ``build(pipe)``; on NOSCRIPT (Redis
    restarted and lost its script cache) load the scripts and run it again. Replies keep
    per-command errors in place so one bad item cannot sink the rest of a batch.

    Running it again repeats the pipeline's plain commands too: a pipeline that holds
    writes outside scripts (a dead letter's XADD and XACK) passes ``preload``, so the
    scripts are loaded first and the first run is the one that counts."""
    if preload:
        for script in scripts:
            script.load(r)
    replies: list[Any] = []
    for attempt in range(2):
        pipe = r.pipeline(transaction=False)
        build(pipe)
        replies = pipe.execute(raise_on_error=False)
        if attempt or not any(isinstance(x, NoScriptError) for x in replies):
            break
        for script in scripts:
            script.load(r)
    return replies


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
