"""What ``ferry top`` shows, read from Redis: live workers' heartbeats, the priority lanes
as the consumer group sees them, the tenants waiting in the fair backlogs, and ``ferry
up``'s restart records.

Why heartbeats and not each worker's ``/metrics``: workers behind a scaler come and go and
often have no reachable port, but every live worker writes ``{prefix}:worker:{id}`` every
few seconds with its batch and KV statistics. So one Redis connection sees the whole
fleet, with nothing to discover. The queue view comes from ``XINFO GROUPS`` on the request
streams (on a Redis Cluster, of every shard, with the master each shard lives on; a shard
that does not answer is shown lost, probed from frame to frame, not read).
Restarts come from the records ``ferry up``'s supervisor keeps in ``{prefix}:restarts``
(``ferry/recovery.py``). Everything here only reads (no SREM of dead ids: a monitor must
not need write permission), so it runs as the read-only ``ferry-monitor`` ACL user. No
terminal code here: ``ferry/commands/top.py`` renders.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ferry.recovery import RestartRecord, read_restarts
from protocol.cluster.nodes import TRANSIENT_CLUSTER_ERRORS, node_pipeline, raise_moved
from protocol.cluster.shard_health import ShardHealth, master_name, probe
from protocol.codec import ProtocolError, decode_heartbeat
from protocol.keys import Keys
from protocol.store import as_str, queue_commands, queue_lags
from protocol.tenants import fair

HISTORY_LEN = 20
T = TypeVar("T")


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
    """One request-stream shard of a Redis Cluster: where it lives and what waits there,
    or, for a shard that does not answer, since when and why (``lost``)."""

    shard: int
    node: str  # host:port of the master holding its slot ("?": none serves it)
    depth: int
    lag: int
    lost: str | None = None
    lost_for_s: float = 0.0


@dataclass(frozen=True)
class TenantView:
    """One tenant with requests in the fair backlogs (``protocol.tenants.fair``), over every lane
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
    heartbeats_lost: str | None = None  # why the heartbeats could not be read (a cluster)


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


def _shards(redis: Any, keys: Keys, lanes: dict[str, tuple[int, int]],
            health: ShardHealth) -> list[ShardView]:
    """Per shard of a cluster: its master and the depth and lag of its three lanes, or
    how long it has been lost."""
    views, now, lost = [], time.time(), health.lost()
    for k in range(keys.shards if keys.cluster else 0):
        streams = keys.shard_streams(k)
        node = master_name(redis, streams[0]) or "?"
        if k in lost:
            views.append(ShardView(k, lost[k].node or node, 0, 0, lost[k].error,
                                   max(0.0, now - lost[k].since)))
            continue
        views.append(ShardView(k, node, sum(lanes[s][0] for s in streams if s in lanes),
                               sum(lanes[s][1] for s in streams if s in lanes)))
    return views


def _by_shard(redis: Any, keys: Keys, health: ShardHealth, read: Callable[[list[str]], T],
              ) -> dict[int, T]:
    """``read(streams)`` for each shard's lanes (one shard at once on a cluster, so one
    that does not answer is marked lost and left out; a lost one is probed, not read)."""
    if not keys.cluster:
        return {0: read(list(keys.request_streams))}
    for k in health.due():
        if probe(redis, keys.shard_streams(k)[0]) is None:
            health.recovered(k)
    out: dict[int, T] = {}
    for k in health.usable():
        streams = list(keys.shard_streams(k))
        try:
            out[k] = read(streams)
        except TRANSIENT_CLUSTER_ERRORS as exc:
            health.failed(k, exc, master_name(redis, streams[0]))
    return out


def _tenants(redis: Any, keys: Keys, health: ShardHealth) -> list[TenantView]:
    """The tenants in every lane's ready set, with their backlogs (two round trips per
    shard)."""
    views: dict[str, TenantView] = {}
    for part in _by_shard(redis, keys, health, lambda s: _shard_tenants(redis, s)).values():
        for view in part:
            seen = views.get(view.tenant)
            views[view.tenant] = view if seen is None else TenantView(
                view.tenant, view.waiting + seen.waiting, view.weight,
                min(view.counter, seen.counter))
    return sorted(views.values(), key=lambda v: (-v.waiting, v.tenant))


def _shard_tenants(redis: Any, streams: list[str]) -> list[TenantView]:
    pipe = node_pipeline(redis, streams[0])  # one shard's lanes (all, on one Redis)
    for stream in streams:
        pipe.zrange(fair.ready(stream), 0, -1, withscores=True)
        pipe.hgetall(fair.weights(stream))
    replies = raise_moved(pipe.execute(raise_on_error=False))
    ready: list[tuple[str, str, float, float]] = []  # stream, tenant, counter, weight
    for i, stream in enumerate(streams):
        members, weights = replies[2 * i], replies[2 * i + 1]
        if isinstance(members, Exception) or isinstance(weights, Exception):
            continue
        named = {as_str(k): float(v) for k, v in weights.items()}
        ready += [(stream, as_str(t), float(c), named.get(as_str(t), 1.0)) for t, c in members]
    pipe = node_pipeline(redis, streams[0])
    for stream, tenant, _c, _w in ready:
        pipe.llen(fair.backlog(stream, tenant))
    views: dict[str, TenantView] = {}
    for (_s, tenant, counter, weight), n in zip(ready, pipe.execute(raise_on_error=False),
                                                 strict=True):
        seen = views.get(tenant)
        waiting = (0 if isinstance(n, Exception) else int(n)) + (seen.waiting if seen else 0)
        views[tenant] = TenantView(tenant, waiting, weight,
                                   min(counter, seen.counter) if seen else counter)
    return list(views.values())


def _queue(redis: Any, keys: Keys, health: ShardHealth
           ) -> tuple[QueueView, dict[str, tuple[int, int]]]:
    """XLEN and XINFO GROUPS of every priority lane (of every shard that answers), summed,
    and per stream; zeros before streams exist."""
    view = QueueView()
    lanes: dict[str, tuple[int, int]] = {}

    def read(streams: list[str]) -> tuple[list[Any], int]:
        pipe = node_pipeline(redis, streams[0]) if keys.cluster \
            else redis.pipeline(transaction=False)
        queue_commands(pipe, keys, streams)
        for dead in {keys.dead_letter_for(s) for s in streams}:  # one, sharing their slot
            pipe.xlen(dead)
        replies = raise_moved(pipe.execute(raise_on_error=False))
        for reply in replies:  # a missing stream is an empty lane; not this
            if isinstance(reply, TRANSIENT_CLUSTER_ERRORS):
                raise reply
        return replies[:-1], int(replies[-1])

    for (replies, dead), streams in _with_streams(_by_shard(redis, keys, health, read), keys):
        view.dead_letters += dead
        lanes.update(queue_lags(replies, keys, streams))
        for i in range(len(streams)):
            groups = replies[3 * i + 1]
            for group in [] if isinstance(groups, Exception) else groups:
                if as_str(group["name"]) != keys.group:
                    continue
                view.group_exists = True
                view.pending += int(group.get("pending") or 0)
                view.consumers = max(view.consumers, int(group.get("consumers") or 0))
    view.depth = sum(d for d, _ in lanes.values())
    view.lag = sum(lag for _, lag in lanes.values())
    return view, lanes


def _with_streams(parts: dict[int, T], keys: Keys) -> list[tuple[T, list[str]]]:
    """Each shard's result with its lanes (all of them on one Redis)."""
    if not keys.cluster:
        return [(part, list(keys.request_streams)) for part in parts.values()]
    return [(part, list(keys.shard_streams(k))) for k, part in parts.items()]


def collect(redis: Any, keys: Keys, history: History | None = None,
            health: ShardHealth | None = None) -> Snapshot:
    """Read heartbeats and queue state with a sync ``redis.Redis`` (bytes responses). On a
    cluster ``health`` remembers, from frame to frame, the shards that do not answer: they
    are probed, not read, and shown as lost."""
    health = health or ShardHealth(keys.shards)
    now = time.time()
    workers, lost_beats = _workers(redis, keys, now, history, health)
    queue, lanes = _queue(redis, keys, health)
    return Snapshot(taken_at=now, prefix=keys.prefix, queue=queue, workers=workers,
                    restarts=_restarts(redis, keys) if lost_beats is None else [],
                    shards=_shards(redis, keys, lanes, health),
                    tenants=_tenants(redis, keys, health), heartbeats_lost=lost_beats)


def _workers(redis: Any, keys: Keys, now: float, history: History | None,
             health: ShardHealth) -> tuple[list[WorkerView], str | None]:
    """Live workers from their heartbeats; on a cluster whose shard holding them (the tag
    ``{prefix}``) is lost: none, and why."""
    fleet = keys.shard_of(keys.prefix)
    if keys.cluster and health.is_lost(fleet):
        return [], f"heartbeats unreachable: stream shard {fleet}'s master is lost"
    try:
        ids = sorted(as_str(i) for i in redis.smembers(keys.workers))
        values = redis.mget([keys.worker(i) for i in ids]) if ids else []
    except TRANSIENT_CLUSTER_ERRORS as exc:
        if not keys.cluster:
            raise
        health.failed(fleet, exc, master_name(redis, keys.workers))
        return [], f"heartbeats unreachable: stream shard {fleet}'s master is lost"
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
    return workers, None


def _restarts(redis: Any, keys: Keys) -> list[RestartRecord]:
    """Supervisor restart records; none where the ACL hides them (an older monitor user)."""
    from redis.exceptions import ResponseError

    try:
        return read_restarts(redis, keys)
    except ResponseError:  # NOPERM, or a key of another type
        return []
