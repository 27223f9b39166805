"""The asyncio client's shared pub/sub connection, against a real redis-server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from redis._parsers import _AsyncRESP3Parser

from protocol.aclient import AsyncFerryClient
from protocol.codec import encode_event
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


async def _settled(read: Any, want: int, timeout: float = 5.0) -> int:
    """``read()`` once it equals ``want`` (UNSUBSCRIBE is sent by the hub's reader task, so
    it lands a moment after ``close``), or its last value at the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (value := await asyncio.to_thread(read)) != want:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.02)
    return int(value)


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
        after = await _settled(lambda: _pubsub_clients(redis_client), 0)
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


@pytest.mark.parametrize("protocol,pure_python", [(2, False), (3, False), (3, True)],
                         ids=["resp2", "resp3", "resp3-pure-python-parser"])
def test_messages_arrive_by_pub_sub_not_by_log_polling(
    redis_server: RedisServer, redis_client: redis.Redis, protocol: int, pure_python: bool
) -> None:
    """An event only PUBLISHed (not in the log) must arrive at once: the log is re-read
    only after a minute of quiet here, so nothing but the hub can deliver it."""

    async def scenario() -> tuple[list[str], float]:
        parser = {"parser_class": _AsyncRESP3Parser} if pure_python else {}
        client = AsyncFerryClient(
            aredis.Redis.from_url(redis_server.url, protocol=protocol, **parser),
            poll_interval_s=60.0)
        sub = await client.subscribe("live").open()
        await sub.next_events(0)  # the initial backfill: the log is empty
        start = time.monotonic()
        data = encode_event(TokenEvent(request_id="live", seq=0, text="x"))
        await asyncio.to_thread(redis_client.publish, KEYS.tokens("live"), data)
        got = [e.text for e in await sub.next_events(10.0)]
        took = time.monotonic() - start
        await sub.close()
        await client.aclose()
        return got, took

    got, took = asyncio.run(scenario())
    assert got == ["x"] and took < 5.0


def test_a_reconnect_subscribes_only_what_is_still_wanted(redis_server: RedisServer,
                                                          redis_client: redis.Redis) -> None:
    async def scenario() -> tuple[list[bytes], list[str]]:
        client = AsyncFerryClient(aredis.Redis.from_url(redis_server.url), poll_interval_s=0.2)
        kept = await client.subscribe("kept").open()
        ended = await client.subscribe("ended").open()
        await asyncio.to_thread(redis_client.execute_command, "CLIENT", "KILL", "TYPE",
                                "pubsub")
        await ended.close()  # may race the reconnect: either way it must not come back
        for _ in range(100):
            if client.hub.reconnects:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        channels = await asyncio.to_thread(redis_client.pubsub_channels)
        _publish(redis_client, "kept", 0, "after")
        texts = [e.text for e in await kept.next_events(5.0)]
        await kept.close()
        await client.aclose()
        return sorted(channels), texts

    channels, texts = asyncio.run(scenario())
    assert channels == [KEYS.tokens("kept").encode()]
    assert texts == ["after"]
