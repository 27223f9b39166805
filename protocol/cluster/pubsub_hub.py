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

A ``Link`` is one such connection with its reader task; this hub has one. On a Redis
Cluster, ``protocol.cluster.sharded_hub.ShardedPubSubHub`` keeps the same registry of inboxes but
one link per master (SSUBSCRIBE), and routes each channel by its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError, ResponseError

from protocol.cluster.pubsub_link import CLASSIC, PING_INTERVAL_S, Link, connection_factory

__all__ = ["PING_INTERVAL_S", "Inbox", "PubSubHub"]


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

    dialect = CLASSIC

    def __init__(self, redis: aredis.Redis, ping_interval_s: float = PING_INTERVAL_S) -> None:
        self.ping_interval_s = ping_interval_s
        self._inboxes: dict[bytes, list[Inbox]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._links: dict[str, Link] = {}
        self._retired_reconnects = 0
        self._tasks: set[asyncio.Task[Any]] = set()  # strong refs to fire-and-forget work
        if redis is not None:  # a sharded hub makes a connection per node instead
            pool = redis.connection_pool
            self._single = connection_factory(pool.connection_class, pool.connection_kwargs)

    # --- routing (one link here; one per master in the sharded hub) ---------------------

    def link_for(self, key: bytes) -> Link:
        """The link a channel is (to be) subscribed on."""
        return self._link("redis", self._single)

    def _link(self, name: str, new_connection: Callable[[], Any]) -> Link:
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = Link(self, name, new_connection)
        return link

    def _routed(self, key: bytes) -> Link | None:
        try:
            return self.link_for(key)
        except Exception:  # a slot without a master, for a moment of a failover
            return None

    def routes_here(self, key: bytes, link: Link) -> bool:
        return key in self._inboxes and self._routed(key) is link

    def wanted(self, link: Link) -> list[bytes]:
        """Channels some inbox wants on ``link`` (subscribed again on a reconnect)."""
        return [key for key in self._inboxes if self._routed(key) is link]

    def inboxes(self, key: bytes) -> list[Inbox]:
        return self._inboxes.get(key, [])

    # --- the public side ----------------------------------------------------------------

    @property
    def reconnects(self) -> int:
        return self._retired_reconnects + sum(link.reconnects for link in self._links.values())

    def heard_within(self, seconds: float, channel: str | None = None) -> bool:
        """Whether the connection (of ``channel``, if given) is up and delivered something
        in the last ``seconds``."""
        if channel is not None:
            link = self._routed(channel.encode())
            return link is not None and link.heard_within(seconds)
        return any(link.heard_within(seconds) for link in self._links.values())

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

        async def confirm() -> None:
            link = await self.route(key)
            link.ensure_reader()
            if first:
                await link.send(self.dialect.subscribe, key)
            await confirmed.wait()

        try:
            await asyncio.wait_for(confirm(), timeout)
        except BaseException:
            await self.unsubscribe(channel, inbox)
            raise
        return inbox

    async def route(self, key: bytes) -> Link:
        """The link for ``key`` (the sharded hub waits out a slot without a master)."""
        return self.link_for(key)

    async def unsubscribe(self, channel: str, inbox: Inbox, timeout: float = 2.0) -> None:
        key = channel.encode()
        if not self._forget(key, inbox):
            return
        # Best effort and bounded: if Redis is away, the reconnect will not subscribe the
        # channel again (nobody wants it), and a late confirmation is answered with an
        # UNSUBSCRIBE; either way nothing leaks to a caller.
        link = self._routed(key)
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            if link is not None:
                await asyncio.wait_for(
                    link.send(self.dialect.unsubscribe, key, unless_wanted=True), timeout)

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

    async def aclose(self) -> None:
        for link in list(self._links.values()):
            await link.aclose()

    # --- what links report --------------------------------------------------------------

    def control(self, link: Link, reply: Any) -> None:
        """A reply that is not a message: confirmations, server-side unsubscribes, PONGs."""
        if not isinstance(reply, list) or len(reply) < 2:
            return
        kind, key = reply[0], reply[1]
        if kind == self.dialect.dropped and self.routes_here(key, link):
            self.dropped(link, key)
        if kind != self.dialect.confirm:
            return  # unsubscribe confirmations, PING replies
        if not self.routes_here(key, link):  # ended (or moved) while on its way
            self.spawn(link.send(self.dialect.unsubscribe, key, unless_wanted=True))
            return
        confirmed = self._confirmed.get(key)
        if confirmed is not None and not confirmed.is_set():
            confirmed.set()
        else:  # re-subscribed after a reconnect: messages may have been missed
            for inbox in self._inboxes[key]:
                inbox.put(None)

    def dropped(self, link: Link, key: bytes) -> None:
        """The server unsubscribed a wanted channel (only sharded pub/sub does)."""

    def error_reply(self, link: Link, exc: ResponseError) -> None:
        """An error reply on a pub/sub connection (a sharded hub's ``MOVED``)."""

    async def link_down(self, link: Link) -> None:
        """A link lost its connection: its subscribers re-read their replay logs."""
        for key in self.wanted(link):
            for inbox in self._inboxes[key]:
                inbox.put(None)

    def retire(self, link: Link) -> None:
        """Stop a link nothing routes to any more (a failed-over master's)."""
        if link.retired:
            return
        link.retired = True
        self._retired_reconnects += link.reconnects
        if self._links.get(link.name) is link:
            del self._links[link.name]
        if asyncio.current_task() is not link.reader:  # else its loop ends by itself
            self.spawn(link.aclose())

    def spawn(self, coro: Any) -> None:
        async def quietly() -> None:
            with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(coro, 5.0)

        task = asyncio.get_running_loop().create_task(quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
