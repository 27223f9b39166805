"""An asyncio client's reads of a Redis Cluster, shard by shard (``AsyncShards``): each
bounded, a lost shard skipped and probed in the background (``protocol/cluster/shard_health.py``).

The gateway's ``AsyncFerryClient`` reads the queue's lag of every shard before admitting a
request, enqueues on a request's own shard, and counts live workers for readiness. Each of
those reads here waits at most ``timeout_s`` for one shard (cancelled before redis-py's
own socket timeout, so its retries and topology re-reads never start); a shard that fails
or stalls is lost for this client, its requests refused at once (``ShardDownError``), and
a task of its own PINGs it every second until it answers. The other shards go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protocol.cluster.nodes import TRANSIENT_CLUSTER_ERRORS
from protocol.cluster.shard_health import LostShard, ShardDownError, ShardHealth, _aping, aprobe
from protocol.keys import Keys
from protocol.store import queue_commands, queue_lags

T = TypeVar("T")

SHARD_TIMEOUT_S = 2.0
"""Cluster: the longest one shard's read may take before the shard counts as lost."""

_SHARD_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_CLUSTER_ERRORS,
                                                  asyncio.TimeoutError)


class AsyncShards:
    """The shards of one asyncio cluster client ``redis`` as ``keys`` names them."""

    def __init__(self, redis: Any, keys: Keys, timeout_s: float = SHARD_TIMEOUT_S) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout_s = timeout_s
        self.health = ShardHealth(keys.shards)
        self._prober: asyncio.Task[None] | None = None

    def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()

    def check(self, request_id: str) -> None:
        """``ShardDownError`` at once for a request whose stream shard is lost."""
        self._probe_lost()
        shard = self.keys.shard_of(request_id)
        if self.health.is_lost(shard):
            raise ShardDownError(shard)

    async def confirm(self, request_ids: list[str]) -> None:
        """PING the master of each of these requests' shards not known lost (at once,
        bounded); one that does not answer is marked lost (``check`` then refuses its
        requests). For an admission that reads nothing else of the shards."""
        shards = {self.keys.shard_of(rid) for rid in request_ids}
        await asyncio.gather(*(self._ping(k) for k in shards if not self.health.is_lost(k)))

    async def lost(self) -> dict[int, LostShard]:
        """The shards this client cannot reach, after a PING of every other shard's master
        (bounded, at once); the lost ones are probed in the background."""
        await self.redis.initialize()  # a no-op once the topology is known
        await asyncio.gather(*(self._ping(k) for k in self.health.usable()))
        self._probe_lost()
        return self.health.lost()

    async def _ping(self, shard: int) -> None:
        why = await _aping(self.redis, self.keys.shard_streams(shard)[0], self.timeout_s)
        if why is not None:
            self.health.failed(shard, why)

    def _probe_lost(self) -> None:
        """Probe the lost shards whose probe is due, on a task of its own (one at a time):
        nobody waits for a shard that may not answer."""
        if self._prober is not None and not self._prober.done():
            return
        due = self.health.due()
        if due:
            self._prober = asyncio.get_running_loop().create_task(self._probe(due))

    async def _probe(self, shards: list[int]) -> None:
        for k in shards:
            why = await aprobe(self.redis, self.keys.shard_streams(k)[0], self.timeout_s)
            if why is None:
                self.health.recovered(k)
            else:
                self.health.failed(k, why)

    async def run(self, shard: int, work: Awaitable[T], timeout: float | None = None) -> T:
        """``work`` for one shard, bounded; a shard already lost is not tried, one that
        fails or stalls is marked lost. Raises ``ShardDownError`` for both."""
        if self.health.is_lost(shard):
            if asyncio.iscoroutine(work):
                work.close()
            raise ShardDownError(shard)
        try:
            return await asyncio.wait_for(work, timeout or self.timeout_s)
        except _SHARD_ERRORS as exc:
            if isinstance(exc, ShardDownError):
                raise
            self.health.failed(shard, exc)
            raise ShardDownError(shard) from exc

    async def lags(self) -> dict[int, int]:
        """Each reachable shard's lag (its lanes and fair backlogs), read shard by shard at
        once, each bounded; a shard that fails is left out and marked lost."""
        keys = self.keys

        async def lag(k: int) -> int:
            pipe = self.redis.pipeline(transaction=False)
            streams = keys.shard_streams(k)
            queue_commands(pipe, keys, streams)
            replies = await pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, (RedisConnectionError, RedisTimeoutError)):
                    raise reply
            return sum(lag for _d, lag in queue_lags(replies, keys, streams).values())

        self._probe_lost()
        shards = self.health.usable()
        got = await asyncio.gather(*(self.run(k, lag(k)) for k in shards),
                                   return_exceptions=True)
        for reply in got:
            if isinstance(reply, BaseException) and not isinstance(reply, ShardDownError):
                raise reply
        return {k: n for k, n in zip(shards, got, strict=True) if isinstance(n, int)}
