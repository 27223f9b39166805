"""asyncio client, the twin of ``protocol.client`` on ``redis.asyncio`` (used by the gateway).

Same operations and the same guarantees; see ``protocol.client`` for the streaming
algorithm. It also has the read-only queries the gateway needs for admission and
readiness: queue lag, live workers and, on a Redis Cluster, the stream shards it cannot
reach (``protocol/cluster/shard_health.py``): every read of a shard is bounded, a shard that fails
one is skipped from then on (its requests get ``ShardDownError`` at once) until a probe
finds it back, so one lost master cannot stall the gateway's work on the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.affinity.router import AffinitySettings, Router
from protocol.asubscription import AsyncSubscription, decode_all
from protocol.cluster.enqueue import EnqueuePlan, aenqueue
from protocol.cluster.keys import keys_for
from protocol.cluster.nodes import Replication, async_cluster_client
from protocol.cluster.pubsub_hub import PubSubHub
from protocol.cluster.shard_health import LostShard, ShardHealth
from protocol.cluster.shard_reads import SHARD_TIMEOUT_S, AsyncShards
from protocol.cluster.shard_slots import DEFAULT_SHARDS
from protocol.cluster.sharded_hub import ShardedPubSubHub
from protocol.codec import (
    ProtocolError,
    decode_heartbeat,
    status_from_hash,
)
from protocol.keys import Keys
from protocol.models import GenerateRequest, JobStatus, TokenEvent, WorkerHeartbeat
from protocol.store import (
    DuplicateRequestError,
    Ttls,
    as_str,
    cancel_script,
    enqueue_script,
    queue_commands,
    queue_lags,
)
from protocol.streaming import (
    StreamTimeout,
    status_from_events,
)


class AsyncFerryClient:
    """Producer-side API over a ``redis.asyncio.Redis``, or an asyncio ``RedisCluster``
    with ``ClusterKeys`` (``decode_responses`` must be off)."""

    def __init__(
        self,
        client: Any,
        keys: Keys | None = None,
        ttls: Ttls | None = None,
        poll_interval_s: float = 1.0,
        reconnect_timeout_s: float = 10.0,
        replication: Replication | None = None,
        shard_timeout_s: float = SHARD_TIMEOUT_S,
        affinity: AffinitySettings | None = None,
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.ttls = ttls or Ttls()
        self.poll_interval_s = poll_interval_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.replication = replication or Replication()  # cluster only: WAIT after enqueue
        self.shard_timeout_s = shard_timeout_s
        self.shards = AsyncShards(client, self.keys, shard_timeout_s)  # cluster only
        self.router = Router(self.keys, affinity)  # prefix affinity (protocol/affinity)
        self._hub: PubSubHub | None = None

    @property
    def hub(self) -> PubSubHub:
        """The shared pub/sub connection(s), created on first use (in the running loop):
        one connection, or on a cluster one per master holding a followed channel."""
        if self._hub is None:
            self._hub = ShardedPubSubHub(self.redis) if self.keys.cluster \
                else PubSubHub(self.redis)
        return self._hub

    @classmethod
    def from_url(cls, url: str, prefix: str = "ferry", cluster: bool = False,
                 shards: int = DEFAULT_SHARDS, **kwargs: Any) -> AsyncFerryClient:
        """A client on the Redis ``url`` names, or on the cluster it is a node of."""
        client = async_cluster_client(url) if cluster else aredis.Redis.from_url(url)
        return cls(client, keys=keys_for(prefix, cluster, shards), **kwargs)

    async def aclose(self) -> None:
        self.shards.aclose()
        if self._hub is not None:
            await self._hub.aclose()
        await self.redis.aclose()

    async def ensure_group(self) -> None:
        """Create every lane's stream and consumer group if missing. Idempotent."""
        for stream in self.keys.request_streams:
            try:
                await self.redis.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def enqueue(self, request: GenerateRequest, weight: float = 1.0) -> str:
        """Record the job as queued and push it onto its tenant's fair backlog (``weight``:
        the tenant's share, ``protocol.tenants.fair``); returns the request id. On a cluster it is
        accepted once replicated (``NotReplicatedError`` otherwise)."""
        if self.keys.cluster:
            # each step may WAIT for a replica; past all that, the shard is not answering
            bound = 2 * (self.replication.timeout_ms / 1000 + self.shard_timeout_s)
            plan = EnqueuePlan(self.keys, request, self.ttls, self.replication, weight,
                               await self.router.amark_for(self.redis, request))
            await self.shards.run(self.keys.shard_of(request.request_id),
                                  aenqueue(self.redis, plan), bound)
            return request.request_id
        script, keys, argv = enqueue_script(self.keys, request, self.ttls, weight,
                                            await self.router.amark_for(self.redis, request))
        if await self.redis.eval(script, len(keys), *keys, *argv) is None:  # type: ignore[misc]
            raise DuplicateRequestError(f"request_id: {request.request_id!r} is already in use")
        return request.request_id

    def subscribe(self, request_id: str, after_seq: int = -1) -> AsyncSubscription:
        """A not-yet-open subscription; use it with ``async with``."""
        return AsyncSubscription(self, request_id, after_seq)

    async def stream(
        self, request_id: str, after_seq: int = -1, timeout: float | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Events after ``after_seq`` through the terminal one, in order, without duplicates."""
        async with self.subscribe(request_id, after_seq) as sub:
            async for event in sub.events(timeout):
                yield event

    async def generate(self, request: GenerateRequest, timeout: float | None = None) -> JobStatus:
        """Enqueue and wait for the whole result; cancels the job if ``timeout`` expires."""
        async with self.subscribe(request.request_id) as sub:
            await self.enqueue(request)
            try:
                events = [event async for event in sub.events(timeout)]
            except StreamTimeout:
                await self.cancel(request.request_id, reason="client timeout")
                raise
        return status_from_events(request, events)

    async def result(self, request_id: str) -> JobStatus | None:
        """The job hash as a JobStatus, or None if unknown or expired."""
        self.check_shard(request_id)
        fields = await self.redis.hgetall(self.keys.job(request_id))  # type: ignore[misc]
        return status_from_hash(fields) if fields else None

    async def states(self, request_ids: list[str]) -> list[str | None]:
        """Each job's ``state`` (None: no such job, or expired), in one round trip: how a
        poller (the batcher) follows many jobs without subscribing to their tokens."""
        pipe = self.redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hget(self.keys.job(request_id), "state")
        return [None if s is None else as_str(s) for s in await pipe.execute()]

    async def replay(self, request_id: str) -> list[TokenEvent]:
        """The job's whole replay log, in ``seq`` order (empty once it expired)."""
        self.check_shard(request_id)
        raw = await self.redis.lrange(self.keys.events(request_id), 0, -1)  # type: ignore[misc]
        return decode_all(raw)

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> str:
        """Cancel; returns the state found (see ``FerryClient.cancel``)."""
        self.check_shard(request_id)
        script, keys, argv = cancel_script(self.keys, request_id, reason, self.ttls)
        return as_str(await self.redis.eval(script, len(keys), *keys, *argv))  # type: ignore[misc]

    async def ping(self) -> bool:
        """Redis answers (on a cluster: the master of every shard not lost, each bounded;
        the lost ones are in ``lost_shards``)."""
        if self.keys.cluster:
            return len(await self.shards.lost()) < self.keys.shards
        return bool(await self.redis.ping())  # type: ignore[misc]

    def check_shard(self, request_id: str) -> None:
        """Cluster: ``ShardDownError`` at once for a request whose stream shard is lost."""
        if self.keys.cluster:
            self.shards.check(request_id)

    async def confirm_shards(self, request_ids: list[str]) -> None:
        """Cluster: ask the masters of these requests' shards (``AsyncShards.confirm``)."""
        if self.keys.cluster:
            await self.shards.confirm(request_ids)

    async def lost_shards(self) -> dict[int, LostShard]:
        """Cluster: the shards this client cannot reach (``AsyncShards.lost``)."""
        return await self.shards.lost() if self.keys.cluster else {}

    @property
    def shard_health(self) -> ShardHealth:
        return self.shards.health

    async def queue_lag(self) -> int:
        """Entries not yet delivered to any worker, summed over the priority lanes (on a
        cluster: over the shards it can reach; see ``AsyncShards.lags``)."""
        if self.keys.cluster:
            return sum((await self.shards.lags()).values())
        pipe = self.redis.pipeline(transaction=False)
        queue_commands(pipe, self.keys)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:  # a missing stream is an empty lane; anything else is real
            if isinstance(reply, (RedisConnectionError, RedisTimeoutError)):
                raise reply
        return sum(lag for _depth, lag in queue_lags(replies, self.keys).values())

    async def live_workers(self) -> list[WorkerHeartbeat]:
        """Heartbeats of workers whose key has not expired; prunes dead ids from the set.
        On a cluster, bounded like a shard's read (the heartbeats share the slot of the tag
        ``{prefix}``, on the master of the shard ``keys.shard_of(prefix)``)."""
        if self.keys.cluster:
            return await self.shards.run(self.keys.shard_of(self.keys.prefix),
                                         self._live_workers())
        return await self._live_workers()

    async def _live_workers(self) -> list[WorkerHeartbeat]:
        ids = sorted(as_str(i) for i in await self.redis.smembers(self.keys.workers))  # type: ignore[misc]
        if not ids:
            return []
        values = await self.redis.mget([self.keys.worker(i) for i in ids])
        live, dead = [], []
        for worker_id, value in zip(ids, values, strict=True):
            if value is None:
                dead.append(worker_id)
                continue
            try:
                live.append(decode_heartbeat(value))
            except ProtocolError:
                continue
        if dead:
            await self.redis.srem(self.keys.workers, *dead)  # type: ignore[misc]
        return live
