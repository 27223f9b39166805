"""Synchronous Python client: enqueue a job, stream its tokens, read its result, cancel it.

Any Python service can use Ferry with this and a ``redis.Redis``; no HTTP involved. The
asyncio twin is ``protocol.aclient``; both share the scripts (``protocol.store``) and the
ordering logic (``protocol.streaming``) so they cannot drift apart.

Streaming never misses a token: subscribe first, wait for Redis to confirm, then read the
replay log, then follow pub/sub, re-reading the log whenever ``seq`` jumps or the channel
stays quiet (a message lost during a reconnect is thereby recovered).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.affinity.router import AffinitySettings, Router
from protocol.cluster.enqueue import EnqueuePlan
from protocol.cluster.enqueue import enqueue as cluster_enqueue
from protocol.cluster.keys import keys_for
from protocol.cluster.nodes import (
    TRANSIENT_CLUSTER_ERRORS,
    Replication,
    cluster_client,
    refresh_topology,
)
from protocol.cluster.shard_slots import DEFAULT_SHARDS
from protocol.codec import decode_event, status_from_hash
from protocol.keys import Keys
from protocol.models import GenerateRequest, JobStatus, TokenEvent
from protocol.store import (
    DuplicateRequestError,
    Ttls,
    as_str,
    cancel_script,
    enqueue_script,
    ensure_group,
)
from protocol.streaming import (
    EventSequencer,
    Outage,
    StreamTimeout,
    decode_log,
    log_misaligned,
    status_from_events,
)

SUBSCRIBE_TIMEOUT_S = 10.0
_SHARDED = {"ssubscribe": "subscribe", "smessage": "message"}


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class Subscription:
    """One request's event feed; open it *before* enqueueing to be sure nothing is missed."""

    def __init__(self, client: FerryClient, request_id: str, after_seq: int = -1) -> None:
        self._client = client
        self._seq = EventSequencer(request_id, after_seq)
        self._pubsub = client.redis.pubsub()
        self._sharded = client.keys.cluster  # SSUBSCRIBE: the channel lives in one shard
        self._unsubscribed = False  # sharded, after a failover: SSUBSCRIBE still to send
        self._channel = client.keys.tokens(request_id)
        self._backfilled = False
        self._outage = Outage(client.reconnect_timeout_s)

    @property
    def finished(self) -> bool:
        return self._seq.finished

    def _message(self, timeout: float) -> dict[str, Any] | None:
        """The next pub/sub message, sharded ones typed like classic ones."""
        if not self._sharded:
            return self._pubsub.get_message(timeout=timeout)  # type: ignore[no-any-return]
        self._ensure_subscribed()
        if self._unsubscribed:  # no master took it yet: wait as a quiet channel would
            time.sleep(min(timeout, 0.1))
            return None
        msg = self._pubsub.get_sharded_message(timeout=timeout)
        if msg is not None:
            msg = {**msg, "type": _SHARDED.get(msg["type"], msg["type"])}
        return msg  # type: ignore[no-any-return]

    def open(self, timeout: float = SUBSCRIBE_TIMEOUT_S) -> Subscription:
        """SUBSCRIBE and wait for the confirmation, so later publishes are guaranteed heard."""
        if self._sharded:
            self._pubsub.ssubscribe(self._channel)
        else:
            self._pubsub.subscribe(self._channel)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._message(left)
            if msg is not None and msg["type"] == "subscribe":
                return self
        self.close()
        raise StreamTimeout(f"subscribe to {self._channel} not confirmed in {timeout}s")

    def close(self) -> None:
        self._pubsub.close()

    def _resubscribe_sharded(self) -> None:
        """After a connection error on a cluster: the channel's master may have failed
        over, and redis-py's sharded pub/sub keeps dialling the old one, so subscribe
        anew on whichever master the refreshed topology names (its confirmation makes the
        next step re-read the log). A classic pub/sub re-subscribes by itself."""
        if not self._sharded:
            return
        with contextlib.suppress(Exception):
            self._pubsub.close()
        refresh_topology(self._client.redis)
        self._pubsub = self._client.redis.pubsub()
        self._unsubscribed = True

    def _ensure_subscribed(self) -> None:
        """Sharded: SSUBSCRIBE again after ``_resubscribe_sharded`` until a master takes it
        (until then the quiet-channel log reads keep the stream going)."""
        if self._unsubscribed:
            with contextlib.suppress(*TRANSIENT_CLUSTER_ERRORS):
                self._pubsub.ssubscribe(self._channel)
                self._unsubscribed = False

    def __enter__(self) -> Subscription:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _fill_from_log(self) -> list[TokenEvent]:
        key = self._client.keys.events(self._seq.request_id)
        start = self._seq.next_seq
        events = decode_log(self._client.redis.lrange(key, start, -1))
        if log_misaligned(events, start):
            events = decode_log(self._client.redis.lrange(key, 0, -1))
        return self._seq.push(events)

    def _step(self, wait: float) -> list[TokenEvent]:
        if not self._backfilled:
            self._backfilled = True
            return self._fill_from_log()
        msg = self._message(wait)
        if msg is None or msg["type"] == "subscribe":
            return self._fill_from_log()  # quiet, or resubscribed: maybe a message was lost
        if msg["type"] != "message":
            return []
        ready = self._seq.push([decode_event(msg["data"])])
        return ready + self._fill_from_log() if self._seq.has_gap else ready

    def next_events(self, timeout: float) -> list[TokenEvent]:
        """Wait up to ``timeout`` seconds; return the next events in order (maybe none)."""
        deadline = time.monotonic() + timeout
        while not self.finished:
            left = max(0.0, deadline - time.monotonic())
            try:
                ready = self._step(min(left, self._client.poll_interval_s))
                self._outage.ok()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                self._outage.failed(exc)
                self._resubscribe_sharded()
                ready = []
                time.sleep(min(0.1, left))
            if ready or left <= 0:
                return ready
        return []

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield events through the terminal one; ``StreamTimeout`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished:
            left = _remaining(deadline)
            if left is not None and left <= 0:
                raise StreamTimeout(f"no terminal event for {self._seq.request_id} in {timeout}s")
            yield from self.next_events(60.0 if left is None else left)


class FerryClient:
    """Producer-side API over a ``redis.Redis``, or a ``redis.cluster.RedisCluster`` with
    ``ClusterKeys`` (``decode_responses`` must be off)."""

    def __init__(
        self,
        client: Any,
        keys: Keys | None = None,
        ttls: Ttls | None = None,
        poll_interval_s: float = 1.0,
        reconnect_timeout_s: float = 10.0,
        replication: Replication | None = None,
        affinity: AffinitySettings | None = None,
    ) -> None:
        self.redis = client
        self.keys = keys or Keys()
        self.ttls = ttls or Ttls()
        self.poll_interval_s = poll_interval_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.replication = replication or Replication()  # cluster only: WAIT after enqueue
        self.router = Router(self.keys, affinity)  # prefix affinity (protocol/affinity)

    @classmethod
    def from_url(cls, url: str, prefix: str = "ferry", cluster: bool = False,
                 shards: int = DEFAULT_SHARDS, **kwargs: Any) -> FerryClient:
        """A client on the Redis ``url`` names, or on the cluster it is a node of."""
        client = cluster_client(url) if cluster else redis.Redis.from_url(url)
        return cls(client, keys=keys_for(prefix, cluster, shards), **kwargs)

    def close(self) -> None:
        self.redis.close()

    def ensure_group(self) -> None:
        ensure_group(self.redis, self.keys)

    def enqueue(self, request: GenerateRequest, weight: float = 1.0) -> str:
        """Record the job as queued and push it onto its tenant's fair backlog (``weight``:
        the tenant's share, ``protocol.tenants.fair``); returns the request id. On a cluster it is
        accepted once replicated (``NotReplicatedError`` otherwise)."""
        if self.keys.cluster:
            cluster_enqueue(self.redis, EnqueuePlan(self.keys, request, self.ttls,
                                                    self.replication, weight,
                                                    self.router.mark_for(self.redis, request)))
            return request.request_id
        script, keys, argv = enqueue_script(self.keys, request, self.ttls, weight,
                                            self.router.mark_for(self.redis, request))
        if self.redis.eval(script, len(keys), *keys, *argv) is None:
            raise DuplicateRequestError(f"request_id: {request.request_id!r} is already in use")
        return request.request_id

    def subscribe(self, request_id: str, after_seq: int = -1) -> Subscription:
        """A not-yet-open subscription; use it as a context manager."""
        return Subscription(self, request_id, after_seq)

    def stream(
        self, request_id: str, after_seq: int = -1, timeout: float | None = None
    ) -> Iterator[TokenEvent]:
        """Events after ``after_seq`` through the terminal one, in order, without duplicates."""
        with self.subscribe(request_id, after_seq) as sub:
            yield from sub.events(timeout)

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> JobStatus:
        """Enqueue and wait for the whole result; cancels the job if ``timeout`` expires."""
        with self.subscribe(request.request_id) as sub:
            self.enqueue(request)
            try:
                events = list(sub.events(timeout))
            except StreamTimeout:
                self.cancel(request.request_id, reason="client timeout")
                raise
        return status_from_events(request, events)

    def result(self, request_id: str) -> JobStatus | None:
        """The job hash as a JobStatus, or None if unknown or expired."""
        fields = self.redis.hgetall(self.keys.job(request_id))
        return status_from_hash(fields) if fields else None

    def cancel(self, request_id: str, reason: str = "cancelled by client") -> str:
        """Cancel; returns the state found: 'cancelled' (was queued, now finished),
        'running' (its worker will stop it), a terminal state (too late) or 'unknown'."""
        script, keys, argv = cancel_script(self.keys, request_id, reason, self.ttls)
        return as_str(self.redis.eval(script, len(keys), *keys, *argv))
