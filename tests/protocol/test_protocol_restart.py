"""The Redis test helper (AOF, kill -9, restart) and a stream that survives a Redis crash."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis

from protocol.aclient import AsyncFerryClient
from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import TokenEvent, Usage
from protocol.store import Ttls, push_event
from tests.redis_server import RedisServer

KEYS = Keys()


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as server:
        yield server


def _push(r: redis.Redis, event: TokenEvent) -> None:
    pipe = r.pipeline()
    push_event(pipe, KEYS, event, Ttls())
    pipe.execute()


def test_kill_and_restart_keep_port_and_aof_data(aof_server: RedisServer) -> None:
    port, client = aof_server.port, aof_server.client()
    client.set("k", "v")
    aof_server.kill()
    assert not aof_server.running
    with pytest.raises(redis.ConnectionError):
        client.ping()
    aof_server.start()
    assert aof_server.port == port and client.get("k") == b"v"
    aof_server.restart(hard=False)
    assert client.get("k") == b"v"
    client.close()


def test_no_aof_loses_data_on_restart() -> None:
    with RedisServer() as server:
        client = server.client()
        client.set("k", "v")
        server.restart()
        assert client.get("k") is None
        client.close()


def test_stream_survives_a_redis_kill(aof_server: RedisServer) -> None:
    writer = aof_server.client()
    client = FerryClient(aof_server.client(), poll_interval_s=0.2)
    with client.subscribe("r") as sub:
        _push(writer, TokenEvent(request_id="r", seq=0, text="a"))
        first = sub.next_events(5)
        aof_server.restart()  # kill -9, then up again on the same port with the AOF

        def publish_rest() -> None:
            _push(writer, TokenEvent(request_id="r", seq=1, text="b"))
            _push(writer, TokenEvent(request_id="r", seq=2, text="c", finish_reason="stop",
                                     usage=Usage()))

        thread = threading.Thread(target=publish_rest)
        thread.start()
        rest = list(sub.events(timeout=10))
        thread.join()
    assert [e.text for e in first + rest] == ["a", "b", "c"]
    writer.close()
    client.close()


def test_async_stream_survives_a_redis_kill(aof_server: RedisServer) -> None:
    writer = aof_server.client()

    async def scenario() -> list[str]:
        client = AsyncFerryClient(aredis.Redis.from_url(aof_server.url), poll_interval_s=0.2)
        async with client.subscribe("r") as sub:
            _push(writer, TokenEvent(request_id="r", seq=0, text="a"))
            first = await sub.next_events(5)
            aof_server.restart()
            _push(writer, TokenEvent(request_id="r", seq=1, text="b"))
            _push(writer, TokenEvent(request_id="r", seq=2, text="c", finish_reason="stop"))
            rest = [e async for e in sub.events(timeout=10)]
        await client.aclose()
        return [e.text for e in first + rest]

    assert asyncio.run(scenario()) == ["a", "b", "c"]
    writer.close()
