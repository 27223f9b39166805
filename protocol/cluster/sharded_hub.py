"""The pub/sub hub on a Redis Cluster: one SSUBSCRIBE connection per master, routed by slot.

A sharded channel lives on the master owning its slot, and only that node delivers its
messages, so the gateway needs a connection to every master holding a followed stream. The
``PubSubHub``'s registry of inboxes stays one; what changes is routing: each channel goes
to the link of its slot's master (redis-py's slot cache says which), and that cache is
refreshed when the topology changes under a link:

* **A link loses its connection** (its master was killed): every subscriber on it re-reads
  its replay log, the topology is refreshed, and each channel whose slot now has another
  master (the promoted replica) is subscribed there; a link nothing routes to any more is
  retired. Until the promotion, the link keeps retrying with backoff, refreshing each time.
* **The server drops a channel** (``sunsubscribe``: its slot moved away) or answers
  ``MOVED``: refresh, and move the channels to their new masters.

Messages published while a channel moved are in the replay log, which every moved
subscriber re-reads (it gets a ``None``): nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from protocol.cluster.nodes import TRANSIENT_CLUSTER_ERRORS, arefresh_topology
from protocol.cluster.pubsub_hub import PING_INTERVAL_S, PubSubHub
from protocol.cluster.pubsub_link import SHARDED, Link, connection_factory


class ShardedPubSubHub(PubSubHub):
    """A ``PubSubHub`` over an asyncio ``RedisCluster``: SSUBSCRIBE, a link per master."""

    dialect = SHARDED

    def __init__(self, cluster: Any, ping_interval_s: float = PING_INTERVAL_S) -> None:
        super().__init__(None, ping_interval_s)  # type: ignore[arg-type]
        self._cluster = cluster
        self._refreshing: asyncio.Task[None] | None = None

    def link_for(self, key: bytes) -> Link:
        node = self._cluster.nodes_manager.get_node_from_slot(key_slot(key))
        return self._link(node.name, connection_factory(node.connection_class,
                                                        node.connection_kwargs))

    async def route(self, key: bytes) -> Link:
        """The link of ``key``'s master, learning the topology first if needed (and again,
        with backoff, while the slot has no master: the caller's timeout bounds this)."""
        delay = 0.05
        while True:
            with contextlib.suppress(*TRANSIENT_CLUSTER_ERRORS):
                await self._cluster.initialize()
                return self.link_for(key)
            await self._refresh()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def link_down(self, link: Link) -> None:
        await super().link_down(link)
        await self._refresh()
        self._reroute(link)

    def dropped(self, link: Link, key: bytes) -> None:
        self._refresh_then_reroute(link)

    def error_reply(self, link: Link, exc: ResponseError) -> None:
        self._refresh_then_reroute(link)

    def _refresh_then_reroute(self, link: Link) -> None:
        async def run() -> None:
            await self._refresh()
            self._reroute(link)

        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(run())

    async def _refresh(self) -> None:
        await arefresh_topology(self._cluster)

    def _reroute(self, old: Link) -> None:
        """Subscribe every wanted channel whose master is no longer ``old``'s node on its
        new link, and tell its subscribers to re-read their logs (the confirmation does);
        retire ``old`` once nothing routes to it."""
        for key in list(self._inboxes):
            link = self._routed(key)
            if link is None or link is old:  # no master yet (the next refresh), or stays
                continue
            link.ensure_reader()
            if link.conn is not None:  # else its connect subscribes everything it wants
                self.spawn(link.send(self.dialect.subscribe, key))
            self.spawn(old.send(self.dialect.unsubscribe, key, unless_wanted=True))
        if not self.wanted(old):
            self.retire(old)
