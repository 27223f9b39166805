"""One pub/sub connection of a hub (``protocol.cluster.pubsub_hub``): its reader task, its
watchdog, its reconnects, and the two dialects it speaks.

A link subscribes what its hub says is wanted on it (again after every reconnect), hands
each message to the hub's inboxes for that channel, and reports everything else to the
hub: confirmations, a server-side unsubscribe (sharded pub/sub, when a slot moves), an
error reply (``MOVED``), and its own loss of connection. The hub decides what that means;
the link only keeps its connection alive, with bounded waits everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError, ResponseError

_RETRY_S = 0.1
_RETRY_CAP_S = 2.0
PING_INTERVAL_S = 5.0
"""A quiet connection is PINGed this often; no reply within the next interval: it is
considered dead (a half-open TCP connection would otherwise look quiet forever)."""


@dataclass(frozen=True)
class Dialect:
    """The commands and reply kinds of one flavour of pub/sub."""

    subscribe: str
    unsubscribe: str
    message: bytes
    confirm: bytes
    dropped: bytes | None  # a server-side unsubscribe (sharded: the slot moved away)
    per_command: int  # channels per SUBSCRIBE (sharded: one, channels differ in slot)


CLASSIC = Dialect("SUBSCRIBE", "UNSUBSCRIBE", b"message", b"subscribe", None, 512)
SHARDED = Dialect("SSUBSCRIBE", "SUNSUBSCRIBE", b"smessage", b"ssubscribe", b"sunsubscribe", 1)


def connection_factory(connection_class: Any, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A maker of pub/sub connections with ``kwargs``, speaking RESP2: over RESP3 messages
    are push notifications that redis-py stringifies for a debug log, per message.
    (Maintenance notifications need RESP3: not on these connections.)"""
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("maint_notifications")}
    kwargs["protocol"] = 2
    return lambda: connection_class(**kwargs)


class LinkOwner(Protocol):
    """What a link asks of its hub (``protocol.cluster.pubsub_hub.PubSubHub``)."""

    dialect: Dialect
    ping_interval_s: float

    def routes_here(self, key: bytes, link: Link) -> bool: ...
    def wanted(self, link: Link) -> list[bytes]: ...
    def inboxes(self, key: bytes) -> list[Any]: ...
    def control(self, link: Link, reply: Any) -> None: ...
    def error_reply(self, link: Link, exc: ResponseError) -> None: ...
    async def link_down(self, link: Link) -> None: ...
    def spawn(self, coro: Any) -> None: ...


class Link:
    """One pub/sub connection of a hub: its reader task, watchdog and reconnects."""

    def __init__(self, hub: LinkOwner, name: str, new_connection: Callable[[], Any]) -> None:
        self.hub = hub
        self.name = name
        self._new_connection = new_connection
        self.conn: Any = None  # an aredis Connection while one is up
        self.lock = asyncio.Lock()  # one writer of commands on the connection at a time
        self.reader: asyncio.Task[None] | None = None
        self.last_rx = 0.0
        self.reconnects = 0
        self.retired = False  # no channel routes here any more (a failed-over master)

    def heard_within(self, seconds: float) -> bool:
        if self.conn is None:
            return False
        return asyncio.get_running_loop().time() - self.last_rx < seconds

    def ensure_reader(self) -> None:
        if self.reader is None or self.reader.done():
            self.retired = False
            self.reader = asyncio.create_task(self._run(), name=f"ferry-pubsub-{self.name}")

    async def send(self, command: str, key: bytes, unless_wanted: bool = False) -> None:
        async with self.lock:
            if unless_wanted and self.hub.routes_here(key, self):
                return  # wanted again meanwhile
            if self.conn is not None:
                await self.conn.send_command(command, key, check_health=False)

    async def aclose(self) -> None:
        self.retired = True
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(RedisError, OSError):
                await conn.disconnect(nowait=True)

    async def _run(self) -> None:
        delay, first = _RETRY_S, True
        while not self.retired:
            try:
                await self._connect()
                if not first:
                    self.reconnects += 1
                first, delay = False, _RETRY_S
                await self._pump()
            except (RedisError, OSError, asyncio.TimeoutError):
                pass
            except Exception:  # never let a reader die: reconnect instead
                pass
            self._drop()
            await self.hub.link_down(self)  # subscribers re-read their logs
            if self.retired:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_CAP_S)

    async def _connect(self) -> None:
        conn = self._new_connection()
        await asyncio.wait_for(conn.connect(), 10.0)
        dialect = self.hub.dialect
        async with self.lock:
            self.conn = conn
            self.last_rx = asyncio.get_running_loop().time()
            wanted = self.hub.wanted(self)
            for i in range(0, len(wanted), dialect.per_command):
                await asyncio.wait_for(conn.send_command(
                    dialect.subscribe, *wanted[i:i + dialect.per_command],
                    check_health=False), 10.0)

    async def _pump(self) -> None:
        conn, loop, hub = self.conn, asyncio.get_running_loop(), self.hub
        message = hub.dialect.message
        watchdog = asyncio.create_task(self._watch(conn))
        try:
            while True:
                try:
                    reply = await conn.read_response(
                        timeout=math.inf, disconnect_on_error=False, push_request=True)
                except ResponseError as exc:  # e.g. MOVED for one channel: not a dead link
                    hub.error_reply(self, exc)
                    continue
                self.last_rx = loop.time()
                # isinstance, not type(): over RESP3, hiredis returns a list subclass
                if isinstance(reply, list) and reply and reply[0] == message:
                    for inbox in hub.inboxes(reply[1]):
                        inbox.put(reply[2])
                else:
                    hub.control(self, reply)
        finally:
            watchdog.cancel()

    async def _watch(self, conn: Any) -> None:
        """PING a quiet connection; close it if even that gets no reply in time."""
        loop, interval = asyncio.get_running_loop(), self.hub.ping_interval_s
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            while True:
                await asyncio.sleep(interval)
                quiet = loop.time() - self.last_rx
                if quiet > 2 * interval:
                    break
                if quiet > interval:
                    await asyncio.wait_for(self._ping(conn), interval)
        await conn.disconnect(nowait=True)  # the reader's read fails: it reconnects

    async def _ping(self, conn: Any) -> None:
        async with self.lock:
            await conn.send_command("PING", check_health=False)

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.hub.spawn(conn.disconnect(nowait=True))


