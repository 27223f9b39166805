"""asyncio client, the twin of ``protocol.client`` on ``redis.asyncio`` (used by the gateway).

Same operations and the same guarantees; see ``protocol.client`` for the streaming
algorithm. It also has the read-only queries the gateway needs for admission and
readiness: queue lag and live workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.cluster import Replication, async_cluster_client
from protocol.cluster_enqueue import EnqueuePlan, aenqueue
from protocol.cluster_keys import keys_for
from protocol.codec import (
    ProtocolError,
    decode_event_trusted,
    decode_heartbeat,
    status_from_hash,
)
from protocol.keys import Keys
from protocol.models import GenerateRequest, JobStatus, TokenEvent, WorkerHeartbeat
from protocol.pubsub_hub import Inbox, PubSubHub
from protocol.shard_slots import DEFAULT_SHARDS
from protocol.sharded_hub import ShardedPubSubHub
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
    EventSequencer,
    Outage,
    StreamTimeout,
    log_misaligned,
    status_from_events,
)

SUBSCRIBE_TIMEOUT_S = 10.0
QUIET_LOG_READ_S = 5.0
QUIET_LOG_READ_MAX = 256


def _decode_all(raw_items: list[Any]) -> list[TokenEvent]:
    """Events from pub/sub or the replay log: written by our workers, so the fast decoder
    (version-checked; anything unusual still validated strictly)."""
    return [decode_event_trusted(item) for item in raw_items]


class AsyncSubscription:
    """One request's event feed; ``async with`` it *before* enqueueing.

    Messages arrive through the client's shared ``PubSubHub`` (one pub/sub connection
    for all subscriptions); gaps and quiet intervals are filled from the replay log.
    """

    def __init__(self, client: AsyncFerryClient, request_id: str, after_seq: int = -1) -> None:
        self._client = client
        self._seq = EventSequencer(request_id, after_seq)
        self._channel = client.keys.tokens(request_id)
        self._inbox: Inbox | None = None
        self._backfilled = False
        self._outage = Outage(client.reconnect_timeout_s)
        self._heard_at = time.monotonic()

    @property
    def finished(self) -> bool:
        return self._seq.finished

    @property
    def last_seq(self) -> int:
        return self._seq.last_seq

    def start_after(self, seq: int) -> None:
        """Set the position to resume after, once known (before reading any event)."""
        if self._backfilled:
            raise RuntimeError("start_after: events were already read")
        self._seq = EventSequencer(self._seq.request_id, seq)

    async def open(self, timeout: float = SUBSCRIBE_TIMEOUT_S) -> AsyncSubscription:
        """SUBSCRIBE and wait for the confirmation, so later publishes are guaranteed heard."""
        try:
            self._inbox = await self._client.hub.subscribe(self._channel, timeout)
        except asyncio.TimeoutError:
            raise StreamTimeout(
                f"subscribe to {self._channel} not confirmed in {timeout}s") from None
        return self

    async def close(self) -> None:
        if self._inbox is not None:
            inbox, self._inbox = self._inbox, None
            await self._client.hub.unsubscribe(self._channel, inbox)

    async def __aenter__(self) -> AsyncSubscription:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _fill_from_log(self, limit: int = 0) -> list[TokenEvent]:
        """Events from the replay log after the last one delivered (at most ``limit``)."""
        key = self._client.keys.events(self._seq.request_id)
        start = self._seq.next_seq
        redis = self._client.redis
        end = start + limit - 1 if limit > 0 else -1
        events = _decode_all(await redis.lrange(key, start, end))  # type: ignore[misc]
        if log_misaligned(events, start):
            events = _decode_all(await redis.lrange(key, 0, -1))  # type: ignore[misc]
        return self._seq.push(events)

    async def _step(self, wait: float) -> list[TokenEvent]:
        """Everything that is ready after at most one wait: all queued messages at once."""
        if not self._backfilled:
            self._backfilled = True
            return await self._fill_from_log()
        inbox = self._inbox
        if inbox is None:
            raise RuntimeError("subscription is not open")
        await inbox.wait(wait)
        items = inbox.take()
        now = time.monotonic()
        if not items:
            if self._trust_quiet(now):
                return []
        else:
            self._heard_at = now
        messages = [item for item in items if item is not None]
        ready = self._seq.push(_decode_all(messages)) if messages else []
        if len(messages) < len(items) or self._seq.has_gap:
            # reconnected or a seq skipped: the log has whatever pub/sub lost
            self._heard_at = now
            ready += await self._fill_from_log()
        elif not items:  # quiet: a bounded look, the rest may be on its way by pub/sub
            self._heard_at = now
            ready += await self._fill_from_log(QUIET_LOG_READ_MAX)
        return ready

    def _trust_quiet(self, now: float) -> bool:
        """A quiet channel while the shared connection hears others is just quiet: pub/sub
        on a live connection loses nothing (a reconnect is announced by a ``None``), and
        re-reading the log there would decode, under load, events already on their way.
        Past ``QUIET_LOG_READ_S`` the log is read anyway, as a last safety net."""
        return (self._client.hub.heard_within(self._client.poll_interval_s, self._channel)
                and now - self._heard_at < QUIET_LOG_READ_S)

    async def next_events(self, timeout: float) -> list[TokenEvent]:
        """Wait up to ``timeout`` seconds; return the next events in order (maybe none)."""
        deadline = time.monotonic() + timeout
        while not self.finished:
            left = max(0.0, deadline - time.monotonic())
            try:
                ready = await self._step(min(left, self._client.poll_interval_s))
                self._outage.ok()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                self._outage.failed(exc)
                ready = []
                await asyncio.sleep(min(0.1, left))
            if ready or left <= 0:
                return ready
        return []

    async def events(self, timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        """Yield events through the terminal one; ``StreamTimeout`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StreamTimeout(f"no terminal event for {self._seq.request_id} in {timeout}s")
            for event in await self.next_events(60.0 if left is None else left):
                yield event


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
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.ttls = ttls or Ttls()
        self.poll_interval_s = poll_interval_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.replication = replication or Replication()  # cluster only: WAIT after enqueue
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
        the tenant's share, ``protocol.fair``); returns the request id. On a cluster it is
        accepted once replicated (``NotReplicatedError`` otherwise)."""
        if self.keys.cluster:
            await aenqueue(self.redis, EnqueuePlan(self.keys, request, self.ttls,
                                                   self.replication, weight))
            return request.request_id
        script, keys, argv = enqueue_script(self.keys, request, self.ttls, weight)
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
        raw = await self.redis.lrange(self.keys.events(request_id), 0, -1)  # type: ignore[misc]
        return _decode_all(raw)

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> str:
        """Cancel; returns the state found (see ``FerryClient.cancel``)."""
        script, keys, argv = cancel_script(self.keys, request_id, reason, self.ttls)
        return as_str(await self.redis.eval(script, len(keys), *keys, *argv))  # type: ignore[misc]

    async def ping(self) -> bool:
        return bool(await self.redis.ping())  # type: ignore[misc]

    async def queue_lag(self) -> int:
        """Entries not yet delivered to any worker, summed over the priority lanes."""
        pipe = self.redis.pipeline(transaction=False)
        queue_commands(pipe, self.keys)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:  # a missing stream is an empty lane; anything else is real
            if isinstance(reply, (RedisConnectionError, RedisTimeoutError)):
                raise reply
        return sum(lag for _depth, lag in queue_lags(replies, self.keys).values())

    async def live_workers(self) -> list[WorkerHeartbeat]:
        """Heartbeats of workers whose key has not expired; prunes dead ids from the set."""
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
