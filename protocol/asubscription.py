"""One request's event feed on asyncio (``AsyncSubscription``), as the gateway reads it.

Messages arrive through the client's shared ``PubSubHub`` (one pub/sub connection for all
subscriptions); gaps, reconnects and quiet intervals are filled from the replay log, so
the feed is gap-free and in order (``protocol.client`` describes the algorithm). It needs
only what ``EventSource`` names of its client, so it does not import the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.cluster.pubsub_hub import Inbox, PubSubHub
from protocol.codec import decode_event_trusted
from protocol.keys import Keys
from protocol.models import TokenEvent
from protocol.streaming import EventSequencer, Outage, StreamTimeout, log_misaligned


class EventSource(Protocol):
    """What a subscription reads through: ``AsyncFerryClient`` is one."""

    keys: Keys
    redis: Any
    poll_interval_s: float
    reconnect_timeout_s: float

    @property
    def hub(self) -> PubSubHub: ...


SUBSCRIBE_TIMEOUT_S = 10.0
QUIET_LOG_READ_S = 5.0
QUIET_LOG_READ_MAX = 256


def decode_all(raw_items: list[Any]) -> list[TokenEvent]:
    """Events from pub/sub or the replay log: written by our workers, so the fast decoder
    (version-checked; anything unusual still validated strictly)."""
    return [decode_event_trusted(item) for item in raw_items]


class AsyncSubscription:
    """One request's event feed; ``async with`` it *before* enqueueing.

    Messages arrive through the client's shared ``PubSubHub`` (one pub/sub connection
    for all subscriptions); gaps and quiet intervals are filled from the replay log.
    """

    def __init__(self, client: EventSource, request_id: str, after_seq: int = -1) -> None:
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
        events = decode_all(await redis.lrange(key, start, end))  # type: ignore[misc]
        if log_misaligned(events, start):
            events = decode_all(await redis.lrange(key, 0, -1))  # type: ignore[misc]
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
        ready = self._seq.push(decode_all(messages)) if messages else []
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
