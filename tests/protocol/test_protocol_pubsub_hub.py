"""The asyncio client's shared pub/sub connection, against a real redis-server."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aredis

from protocol.aclient import AsyncFerryClient
from protocol.keys import Keys
from protocol.models import TokenEvent
from protocol.store import Ttls, push_event
from tests.redis_server import RedisServer

KEYS, TTLS = Keys(), Ttls()


def _publish(r: redis.Redis, request_id: str, seq: int, text: str) -> None:
    pipe = r.pipeline()
    push_event(pipe, KEYS, TokenEvent(request_id=request_id, seq=seq, text=text), TTLS)
    pipe.execute()


def _pubsub_clients(r: redis.Redis) -> int:
    return sum(1 for c in r.client_list() if int(c.get("sub", 0)) > 0)


def test_many_subscriptions_share_one_connection(redis_server: RedisServer,
                                                 redis_client: redis.Redis) -> None:
    async def scenario() -> tuple[int, list[str], int]:
        client = AsyncFerryClient(aredis.Redis.from_url(redis_server.url))
        subs = [await client.subscribe(f"hub-{i}").open() for i in range(150)]
        connections = await asyncio.to_thread(_pubsub_clients, redis_client)
        for i in range(150):
            _publish(redis_client, f"hub-{i}", 0, f"t{i}")
        texts = []
        for sub in subs:
            texts += [e.text for e in await sub.next_events(5.0)]
        for sub in subs:
            await sub.close()
        after = await asyncio.to_thread(_pubsub_clients, redis_client)
        await client.aclose()
        return connections, texts, after

    connections, texts, after = asyncio.run(scenario())
    assert connections == 1
    assert texts == [f"t{i}" for i in range(150)]
    assert after == 0  # the last unsubscribe leaves the connection with no channel


def test_two_followers_of_one_request_both_hear_it(redis_server: RedisServer,
                                                   redis_client: redis.Redis) -> None:
    async def scenario() -> tuple[list[str], list[str], list[str]]:
        client = AsyncFerryClient(aredis.Redis.from_url(redis_server.url))
        first = await client.subscribe("twice").open()
        second = await client.subscribe("twice").open()
        _publish(redis_client, "twice", 0, "a")
        got_first = [e.text for e in await first.next_events(5.0)]
        got_second = [e.text for e in await second.next_events(5.0)]
        await first.close()  # the other follower keeps the channel
        _publish(redis_client, "twice", 1, "b")
        still = [e.text for e in await second.next_events(5.0)]
        await second.close()
        await client.aclose()
        return got_first, got_second, still

    assert asyncio.run(scenario()) == (["a"], ["a"], ["b"])
