"""What ``ferry top`` shows, read from Redis: live workers' heartbeats, the priority lanes
as the consumer group sees them, the tenants waiting in the fair backlogs, and ``ferry
up``'s restart records.

Why heartbeats and not each worker's ``/metrics``: workers behind a scaler come and go and
often have no reachable port, but every live worker writes ``{prefix}:worker:{id}`` every
few seconds with its batch and KV statistics. So one Redis connection sees the whole
fleet, with nothing to discover. The queue view comes from ``XINFO GROUPS`` on the request
streams (on a Redis Cluster, of every shard, with the master each shard lives on).
Restarts come from the records ``ferry up``'s supervisor keeps in ``{prefix}:restarts``
(``ferry/recovery.py``). Everything here only reads (no SREM of dead ids: a monitor must
not need write permission), so it runs as the read-only ``ferry-monitor`` ACL user. No
terminal code here: ``ferry/commands/top.py`` renders.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ferry.recovery import RestartRecord, read_restarts
from protocol import fair
from protocol.codec import ProtocolError, decode_heartbeat
from protocol.keys import Keys
from protocol.store import as_str, queue_commands, queue_lags

HISTORY_LEN = 20


@dataclass
class WorkerView:
    """One live worker as shown in a frame: its heartbeat plus its tokens/s history."""

    worker_id: str
    model: str
    age_s: float
    uptime_s: float
    stats: dict[str, Any]
    history: list[float] = field(default_factory=list)


@dataclass
class QueueView:
    """The request stream as the consumer group sees it."""

    depth: int = 0
    lag: int | None = 0
    pending: int = 0
    consumers: int = 0
    dead_letters: int = 0
    group_exists: bool = False


@dataclass(frozen=True)
class ShardView:
    """One request-stream shard of a Redis Cluster: where it lives and what waits there."""

    shard: int
    node: str  # host:port of the master holding its slot
    depth: int
    lag: int


@dataclass(frozen=True)
class TenantView:
    """One tenant with requests in the fair backlogs (``protocol.fair``), over every lane
    and shard: how many wait, its weight, and its lowest virtual token counter."""

    tenant: str
    waiting: int
    weight: float
    counter: float


@dataclass
class Snapshot:
    """Everything one frame shows; built by :func:`collect`."""

    taken_at: float
    prefix: str
    queue: QueueView
    workers: list[WorkerView]
    restarts: list[RestartRecord] = field(default_factory=list)
    shards: list[ShardView] = field(default_factory=list)  # on a cluster
    tenants: list[TenantView] = field(default_factory=list)  # with work waiting


class History:
    """Short in-memory tokens/s history per worker, for the sparklines (not persisted)."""

    def __init__(self, length: int = HISTORY_LEN) -> None:
        self.length = length
        self._series: dict[str, deque[float]] = {}

    def add(self, worker_id: str, value: float) -> list[float]:
        series = self._series.setdefault(worker_id, deque(maxlen=self.length))
        series.append(value)
        return list(series)

    def forget_except(self, live: set[str]) -> None:
        for worker_id in set(self._series) - live:
            del self._series[worker_id]


def _shards(redis: Any, keys: Keys, lanes: dict[str, tuple[int, int]]) -> list[ShardView]:
    """Per shard of a cluster: its master and the depth and lag of its three lanes."""
    views = []
    for k in range(keys.shards if keys.cluster else 0):
        streams = keys.shard_streams(k)
        node = redis.get_node_from_key(streams[0])
        views.append(ShardView(k, node.name if node else "?",
                               sum(lanes[s][0] for s in streams),
                               sum(lanes[s][1] for s in streams)))
    return views


def _tenants(redis: Any, keys: Keys) -> list[TenantView]:
    """The tenants in every lane's ready set, with their backlogs (two round trips)."""
    pipe = redis.pipeline(transaction=False)
    for stream in keys.request_streams:
        pipe.zrange(fair.ready(stream), 0, -1, withscores=True)
        pipe.hgetall(fair.weights(stream))
    replies = pipe.execute(raise_on_error=False)
    ready: list[tuple[str, str, float, float]] = []  # stream, tenant, counter, weight
    for i, stream in enumerate(keys.request_streams):
        members, weights = replies[2 * i], replies[2 * i + 1]
        if isinstance(members, Exception) or isinstance(weights, Exception):
            continue
        named = {as_str(k): float(v) for k, v in weights.items()}
        ready += [(stream, as_str(t), float(c), named.get(as_str(t), 1.0)) for t, c in members]
    pipe = redis.pipeline(transaction=False)
    for stream, tenant, _c, _w in ready:
        pipe.llen(fair.backlog(stream, tenant))
    views: dict[str, TenantView] = {}
    for (_s, tenant, counter, weight), n in zip(ready, pipe.execute(raise_on_error=False),
                                                 strict=True):
        seen = views.get(tenant)
        waiting = (0 if isinstance(n, Exception) else int(n)) + (seen.waiting if seen else 0)
        views[tenant] = TenantView(tenant, waiting, weight,
                                   min(counter, seen.counter) if seen else counter)
    return sorted(views.values(), key=lambda v: (-v.waiting, v.tenant))


def _queue(redis: Any, keys: Keys) -> tuple[QueueView, dict[str, tuple[int, int]]]:
    """XLEN and XINFO GROUPS of every priority lane (of every shard), summed, and per
    stream; zeros before streams exist."""
    pipe = redis.pipeline(transaction=False)
    queue_commands(pipe, keys)
    replies = pipe.execute(raise_on_error=False)
    lanes = queue_lags(replies, keys)
    view = QueueView(depth=sum(d for d, _ in lanes.values()))
    view.dead_letters = sum(int(redis.xlen(dead)) for dead in keys.dead_letters)
    view.lag = sum(lag for _, lag in lanes.values())
    for i in range(len(keys.request_streams)):
        groups = replies[3 * i + 1]
        for group in [] if isinstance(groups, Exception) else groups:
            if as_str(group["name"]) != keys.group:
                continue
            view.group_exists = True
            view.pending += int(group.get("pending") or 0)
            view.consumers = max(view.consumers, int(group.get("consumers") or 0))
    return view, lanes


def collect(redis: Any, keys: Keys, history: History | None = None) -> Snapshot:
    """Read heartbeats and queue state with a sync ``redis.Redis`` (bytes responses)."""
    now = time.time()
    ids = sorted(as_str(i) for i in redis.smembers(keys.workers))
    values = redis.mget([keys.worker(i) for i in ids]) if ids else []
    workers: list[WorkerView] = []
    for worker_id, raw in zip(ids, values, strict=True):
        if raw is None:
            continue  # key expired: the worker is gone (the gateway prunes the set)
        try:
            beat = decode_heartbeat(raw)
        except ProtocolError:
            continue
        tps = float(beat.stats.get("tokens_per_s", 0) or 0)
        series = history.add(worker_id, tps) if history is not None else [tps]
        workers.append(WorkerView(
            worker_id=beat.worker_id, model=beat.model, age_s=max(0.0, now - beat.updated_at),
            uptime_s=max(0.0, now - beat.started_at), stats=dict(beat.stats), history=series,
        ))
    if history is not None:
        history.forget_except({w.worker_id for w in workers})
    queue, lanes = _queue(redis, keys)
    return Snapshot(taken_at=now, prefix=keys.prefix, queue=queue, workers=workers,
                    restarts=_restarts(redis, keys), shards=_shards(redis, keys, lanes),
                    tenants=_tenants(redis, keys))


def _restarts(redis: Any, keys: Keys) -> list[RestartRecord]:
    """Supervisor restart records; none where the ACL hides them (an older monitor user)."""
    from redis.exceptions import ResponseError

    try:
        return read_restarts(redis, keys)
    except ResponseError:  # NOPERM, or a key of another type
        return []
