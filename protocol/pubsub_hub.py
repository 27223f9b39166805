"""One pub/sub connection for every subscription of an ``AsyncFerryClient``.

Why: with a connection per stream, the gateway held one Redis connection and one reader
per open HTTP stream. redis-py's default pool (100) ran out at about 64 streams, and
every message paid a whole ``get_message`` call of its own. Here one reader task parses
every message and drops it in the queue of each subscription to that channel.

A ``None`` put in a queue means "something may have been missed": the reader lost its
connection, or redis-py re-subscribed after reconnecting. The subscription then reads
its replay log, exactly as after a quiet poll interval, so the log stays the one source
of truth and nothing is lost across a Redis restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

Inbox = asyncio.Queue  # of bytes (a message) or None (read the log)
_RETRY_S = 0.2


class PubSubHub:
    """``subscribe(channel)`` -> a queue fed by the one shared reader; ``unsubscribe``."""

    def __init__(self, redis: aredis.Redis) -> None:
        self._pubsub = redis.pubsub()
        self._inboxes: dict[bytes, list[Inbox[Any]]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._lock = asyncio.Lock()  # one SUBSCRIBE/UNSUBSCRIBE at a time
        self._reader: asyncio.Task[None] | None = None

    async def subscribe(self, channel: str, timeout: float) -> Inbox[Any]:
        """Subscribe and wait for Redis' confirmation: later publishes are then heard.

        Raises ``asyncio.TimeoutError`` if it is not confirmed within ``timeout``.
        """
        key = channel.encode()
        inbox: Inbox[Any] = Inbox()
        async with self._lock:
            inboxes = self._inboxes.setdefault(key, [])
            inboxes.append(inbox)
            if len(inboxes) == 1:
                self._confirmed[key] = asyncio.Event()
                try:
                    await self._pubsub.subscribe(key)
                except BaseException:
                    self._forget(key, inbox)
                    raise
            confirmed = self._confirmed[key]
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="ferry-pubsub-hub")
        try:
            await asyncio.wait_for(confirmed.wait(), timeout)
        except BaseException:
            await self.unsubscribe(channel, inbox)
            raise
        return inbox

    async def unsubscribe(self, channel: str, inbox: Inbox[Any]) -> None:
        key = channel.encode()
        async with self._lock:
            if self._forget(key, inbox):
                # Best effort: if Redis is away, the channel is dropped on reconnect or its
                # messages find no inbox; either way nothing leaks to a caller.
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.unsubscribe(key)

    def _forget(self, key: bytes, inbox: Inbox[Any]) -> bool:
        """Remove one inbox; True when it was the channel's last."""
        inboxes = self._inboxes.get(key, [])
        if inbox in inboxes:
            inboxes.remove(inbox)
        if inboxes or key not in self._inboxes:
            return False
        del self._inboxes[key]
        self._confirmed.pop(key, None)
        return True

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()

    async def _read(self) -> None:
        while True:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                self._wake_all()  # each subscription polls its log (and sees the outage)
                await asyncio.sleep(_RETRY_S)
                continue
            if msg is not None:
                self._dispatch(msg)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        key, kind = msg["channel"], msg["type"]
        inboxes = self._inboxes.get(key, ())
        if kind == "message":
            for inbox in inboxes:
                inbox.put_nowait(msg["data"])
        elif kind == "subscribe":
            confirmed = self._confirmed.get(key)
            if confirmed is not None and not confirmed.is_set():
                confirmed.set()
            else:  # re-subscribed after a reconnect: messages may have been missed
                for inbox in inboxes:
                    inbox.put_nowait(None)

    def _wake_all(self) -> None:
        for inboxes in self._inboxes.values():
            for inbox in inboxes:
                inbox.put_nowait(None)
