"""Per-shard Redis work on a Redis Cluster: a lost shard is skipped by every worker thread,
and a thread of its own probes it until it answers again (``protocol/cluster/shard_health.py``).

The intake reads every shard's lanes, the control thread renews leases and reads queue
numbers on every shard, the outbox writes to every master: one unreachable master (and
its replica) would stall each of them on every pass, and so the whole worker. Through the
gate each thread runs one shard's work at a time; the first that fails marks the shard
lost for all of them (logged once, ``shard_lost``), and from then on nobody sends it a
command until ``ShardWatch`` (its own client, short timeouts, so its waits cost nobody
else) finds its master answering again (``shard_recovered``). On one Redis there is one
shard and the gate is transparent: errors reach the threads' backoff loops unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
from redis.exceptions import AskError, MovedError

from protocol.cluster.keys import ClusterKeys
from protocol.cluster.shard_health import PROBE_TIMEOUT_S, ShardHealth, master_name, probe
from worker.service.redis.connection import TRANSIENT_ERRORS, WorkerSettings, recover

log = structlog.get_logger("ferry.worker.shards")
T = TypeVar("T")


class ShardGate:
    """Which shards a worker's threads may touch now; shared by all of them."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.keys = settings.keys
        self.cluster = settings.redis_cluster
        self.health = ShardHealth(self.keys.shards)
        self.watched = False  # a ShardWatch probes the lost shards (else: the next try does)
        # the fleet-wide keys (heartbeats, the workers set) share the tag {prefix}: they
        # live on the master of the shard whose slot range holds that tag's slot
        self.fleet_shard = self.keys.shard_of(self.keys.prefix)

    def usable(self, shard: int) -> bool:
        """Not lost; or lost, unwatched and due for a probe: the next try is the probe."""
        if not self.cluster or not self.health.is_lost(shard):
            return True
        return not self.watched and self.health.probe_due(shard)

    def shard_of_stream(self, stream: str) -> int:
        keys = self.keys
        return keys.shard_of_stream(stream) if isinstance(keys, ClusterKeys) else 0

    def run(self, shard: int, work: Callable[..., T], *args: Any, default: T,
            redis: Any = None) -> T:
        """``work(*args)`` unless ``shard`` is lost (then ``default``). On a cluster an
        unreachable shard's error marks it lost and gives ``default``; on one Redis it is
        raised."""
        if not self.cluster:
            return work(*args)
        if not self.usable(shard):
            return default
        try:
            result = work(*args)
        except TRANSIENT_ERRORS as exc:
            if isinstance(exc, (MovedError, AskError)) and redis is not None:
                recover(redis)  # the slot moved (a failover): the next pass goes there
            self.lost(shard, exc, redis)
            return default
        self.ok(shard)
        return result

    def ok(self, shard: int) -> None:
        """``shard`` answered (a probe, or a try while unwatched): it is back."""
        if self.health.recovered(shard):
            log.warning("shard_recovered", shard=shard)

    def lost(self, shard: int, exc: BaseException | str, redis: Any = None) -> None:
        """Mark ``shard`` lost (logged the first time), naming its master if known. A
        client whose *default node* is that master gets another one: redis-py asks it
        for the keys of some commands (EVAL in a pipeline, XREAD), whatever their slot."""
        node = master_name(redis, self.keys.shard_streams(shard)[0]) if redis else None
        default = redis.get_default_node() if node is not None else None
        if default is not None and default.name == node:
            redis.replace_default_node()
        if self.health.failed(shard, exc, node):
            log.warning("shard_lost", shard=shard, node=node, error=str(exc)[:300])


class ShardWatch(threading.Thread):
    """Probes the lost shards, each once a second; marks them back when they answer."""

    def __init__(self, settings: WorkerSettings, gate: ShardGate) -> None:
        super().__init__(name="ferry-shards", daemon=True)
        self.settings = settings
        self.gate = gate
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        redis = self.settings.connect(socket_timeout=PROBE_TIMEOUT_S)
        health = self.gate.health
        self.gate.watched = True
        while not self.stopped.is_set():  # learn every node now, while the URL's answers
            try:
                redis.get_default_node()
                break
            except TRANSIENT_ERRORS:
                self.stopped.wait(health.probe_interval_s)
        try:
            while not self.stopped.wait(min(0.2, health.probe_interval_s)):
                for shard in health.due():
                    key = self.gate.keys.shard_streams(shard)[0]
                    try:
                        why = probe(redis, key, PROBE_TIMEOUT_S)
                    except Exception as exc:  # no topology at all yet: still lost
                        why = f"{type(exc).__name__}: {exc}"
                    if why is not None:
                        health.failed(shard, why)
                    else:
                        self.gate.ok(shard)
        finally:
            redis.close()
