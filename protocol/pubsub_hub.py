"""One pub/sub connection for every subscription of an ``AsyncFerryClient``.

A gateway follows hundreds of requests at once; a pub/sub connection per stream would
exhaust the pool (and Redis' clients) long before the GPU is busy. The hub owns one
connection, subscribes a channel while at least one ``Inbox`` wants it, and one reader
task hands each message to the inboxes of its channel.

It drives that connection itself instead of through redis-py's ``PubSub`` because the
token path runs through it: ``PubSub.get_message`` costs tens of microseconds of
bookkeeping per message (health checks, retry wrappers, observability hooks), and its
reconnect re-subscribes every channel it ever had, including those of finished requests
whose unsubscribe failed while Redis was away. Here a reconnect subscribes exactly the
channels some inbox still wants, a confirmation for a channel nobody wants any more is
answered with an UNSUBSCRIBE, and every wait on Redis is bounded.

Subscribers learn of a reconnect by a ``None`` in their inbox: messages published while
the connection was down are lost to pub/sub, so they re-read the replay log.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

_RETRY_S = 0.1
_RETRY_CAP_S = 2.0
PING_INTERVAL_S = 5.0
"""A quiet connection is PINGed this often; no reply within the next interval: it is
considered dead (a half-open TCP connection would otherwise look quiet forever)."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Inbox:
    """One subscription's mailbox: msgpack messages and ``None`` (re-read the log) marks.

    ``take()`` hands over everything queued at once, so a reader woken once handles all
    the events that arrived since, in one go (one SSE write per wake-up)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[bytes | None] = []
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: bytes | None) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[bytes | None]:
        items, self._items = self._items, []
        return items

    async def wait(self, timeout: float) -> None:
        """Until something is queued, or ``timeout`` seconds have passed."""
        if self._items or timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = fut
        handle = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None


class PubSubHub:
    """``subscribe(channel)`` -> an ``Inbox`` fed by the one shared reader; ``unsubscribe``."""

    def __init__(self, redis: aredis.Redis, ping_interval_s: float = PING_INTERVAL_S) -> None:
        pool = redis.connection_pool
        # RESP2 on this one connection: messages are plain replies, while RESP3 sends them
        # as push notifications that redis-py stringifies for a debug log, per message.
        # (Maintenance notifications need RESP3: not on this connection.)
        kwargs = {k: v for k, v in pool.connection_kwargs.items()
                  if not k.startswith("maint_notifications")}
        kwargs["protocol"] = 2
        self._new_connection = lambda: pool.connection_class(**kwargs)
        self._ping_interval_s = ping_interval_s
        self._conn: Any = None  # an aredis Connection while one is up
        self._inboxes: dict[bytes, list[Inbox]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._lock = asyncio.Lock()  # one writer of commands on the connection at a time
        self._reader: asyncio.Task[None] | None = None
        self._last_rx = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()  # strong refs to fire-and-forget work
        self.reconnects = 0

    def heard_within(self, seconds: float) -> bool:
        """Whether the connection is up and delivered something in the last ``seconds``."""
        if self._conn is None:
            return False
        return asyncio.get_running_loop().time() - self._last_rx < seconds

    @property
    def channels(self) -> list[bytes]:
        """Channels some inbox wants (what the connection is, or will be, subscribed to)."""
        return list(self._inboxes)

    async def subscribe(self, channel: str, timeout: float) -> Inbox:
        """Subscribe and wait for Redis' confirmation: later publishes are then heard.

        Raises ``asyncio.TimeoutError`` if it is not confirmed within ``timeout``.
        """
        key, inbox = channel.encode(), Inbox()
        inboxes = self._inboxes.setdefault(key, [])
        inboxes.append(inbox)
        if len(inboxes) == 1:
            self._confirmed[key] = asyncio.Event()
        confirmed = self._confirmed[key]
        first = len(inboxes) == 1
        self._ensure_reader()

        async def confirm() -> None:
            if first:
                await self._send_if_connected("SUBSCRIBE", key)
            await confirmed.wait()

        try:
            await asyncio.wait_for(confirm(), timeout)
        except BaseException:
            await self.unsubscribe(channel, inbox)
            raise
        return inbox

    async def unsubscribe(self, channel: str, inbox: Inbox, timeout: float = 2.0) -> None:
        key = channel.encode()
        if not self._forget(key, inbox):
            return
        # Best effort and bounded: if Redis is away, the reconnect will not subscribe the
        # channel again (nobody wants it), and a late confirmation is answered with an
        # UNSUBSCRIBE; either way nothing leaks to a caller.
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(
                self._send_if_connected("UNSUBSCRIBE", key, unless_wanted=True), timeout)

    def _forget(self, key: bytes, inbox: Inbox) -> bool:
        """Remove one inbox; True when it was the channel's last."""
        inboxes = self._inboxes.get(key)
        if inboxes is None:
            return False
        if inbox in inboxes:
            inboxes.remove(inbox)
        if inboxes:
            return False
        del self._inboxes[key]
        self._confirmed.pop(key, None)
        return True

    async def _send_if_connected(self, command: str, key: bytes, unless_wanted: bool = False
                                 ) -> None:
        async with self._lock:
            if unless_wanted and key in self._inboxes:
                return  # wanted again meanwhile
            if self._conn is not None:
                await self._conn.send_command(command, key, check_health=False)

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(RedisError, OSError):
                await conn.disconnect(nowait=True)

    # --- the reader ----------------------------------------------------------------------

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._run(), name="ferry-pubsub-hub")

    async def _run(self) -> None:
        delay, first = _RETRY_S, True
        while True:
            try:
                await self._connect()
                if not first:
                    self.reconnects += 1
                first, delay = False, _RETRY_S
                await self._pump()
            except (RedisError, OSError, asyncio.TimeoutError):
                pass
            except Exception:  # never let the one reader die: reconnect instead
                pass
            self._drop()
            self._wake_all()  # each subscription reads its log (and sees the outage)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_CAP_S)

    async def _connect(self) -> None:
        conn = self._new_connection()
        await asyncio.wait_for(conn.connect(), 10.0)
        async with self._lock:
            self._conn = conn
            self._last_rx = asyncio.get_running_loop().time()
            wanted = list(self._inboxes)
            for i in range(0, len(wanted), 512):
                await asyncio.wait_for(conn.send_command(
                    "SUBSCRIBE", *wanted[i:i + 512], check_health=False), 10.0)

    async def _pump(self) -> None:
        conn, loop = self._conn, asyncio.get_running_loop()
        watchdog = asyncio.create_task(self._watch(conn))
        try:
            while True:
                reply = await conn.read_response(
                    timeout=math.inf, disconnect_on_error=False, push_request=True)
                self._last_rx = loop.time()
                # isinstance, not type(): over RESP3, hiredis returns a list subclass
                if isinstance(reply, list) and reply and reply[0] == b"message":
                    for inbox in self._inboxes.get(reply[1], ()):
                        inbox.put(reply[2])
                else:
                    self._control(reply)
        finally:
            watchdog.cancel()

    def _control(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 2 or reply[0] != b"subscribe":
            return  # unsubscribe confirmations, PING replies
        key = reply[1]
        if key not in self._inboxes:  # ended while the SUBSCRIBE was on its way
            self._spawn(self._send_if_connected("UNSUBSCRIBE", key, unless_wanted=True))
            return
        confirmed = self._confirmed.get(key)
        if confirmed is not None and not confirmed.is_set():
            confirmed.set()
        else:  # re-subscribed after a reconnect: messages may have been missed
            for inbox in self._inboxes[key]:
                inbox.put(None)

    async def _watch(self, conn: Any) -> None:
        """PING a quiet connection; close it if even that gets no reply in time."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            while True:
                await asyncio.sleep(self._ping_interval_s)
                quiet = loop.time() - self._last_rx
                if quiet > 2 * self._ping_interval_s:
                    break
                if quiet > self._ping_interval_s:
                    await asyncio.wait_for(self._ping(conn), self._ping_interval_s)
        await conn.disconnect(nowait=True)  # the reader's read fails: it reconnects

    async def _ping(self, conn: Any) -> None:
        async with self._lock:
            await conn.send_command("PING", check_health=False)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._spawn(conn.disconnect(nowait=True))

    def _spawn(self, coro: Any) -> None:
        async def quietly() -> None:
            with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(coro, 5.0)

        task = asyncio.get_running_loop().create_task(quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake_all(self) -> None:
        for inboxes in self._inboxes.values():
            for inbox in inboxes:
                inbox.put(None)
