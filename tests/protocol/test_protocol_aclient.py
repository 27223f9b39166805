"""The asyncio client and the worker-side store helpers, against a real redis-server."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis
import redis.asyncio as aredis

from protocol.aclient import AsyncFerryClient
from protocol.codec import encode_event, request_fields
from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent, Usage, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, push_event, remove_heartbeat, write_heartbeat
from protocol.streaming import StreamTimeout
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
TTLS = Ttls()


def _run(coro_fn: object, url: str, **kwargs: object) -> object:
    async def main() -> object:
        client = AsyncFerryClient(aredis.Redis.from_url(url), **kwargs)  # type: ignore[arg-type]
        try:
            return await coro_fn(client)  # type: ignore[operator]
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_async_generate_stream_result(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    request = GenerateRequest(prompt="hi", request_id="a1")

    async def scenario(client: AsyncFerryClient) -> object:
        status = await client.generate(request, timeout=10)
        replay = [e.seq async for e in client.stream("a1")]
        resumed = [e.seq async for e in client.stream("a1", after_seq=1)]
        return status, replay, resumed, await client.result("a1")

    with FakeWorker(redis_server.url, Script(tokens=["x", "y", "z"], delay_s=0.01)):
        status, replay, resumed, stored = _run(scenario, redis_server.url)  # type: ignore[misc]
    assert status.text == "xyz" and status.state == "done"
    assert replay == [0, 1, 2] and resumed == [2]
    assert stored.state == "done" and stored.token_ids == [1, 2, 3]


def test_async_gap_fill_and_timeout(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    async def scenario(client: AsyncFerryClient) -> object:
        async with client.subscribe("g1") as sub:
            pipe = redis_client.pipeline()
            push_event(pipe, KEYS, TokenEvent(request_id="g1", seq=0, text="a"), TTLS)
            pipe.execute()
            lost = TokenEvent(request_id="g1", seq=1, text="b")
            redis_client.rpush(KEYS.events("g1"), encode_event(lost))  # never published
            final = TokenEvent(request_id="g1", seq=2, finish_reason="length", usage=Usage())
            pipe = redis_client.pipeline()
            push_event(pipe, KEYS, final, TTLS)
            pipe.execute()
            seqs = [e.seq async for e in sub.events(timeout=5)]
        with pytest.raises(StreamTimeout):
            async for _ in client.stream("nothing", timeout=0.2):
                pass
        return seqs

    assert _run(scenario, redis_server.url, poll_interval_s=30.0) == [0, 1, 2]


def test_async_cancel_queue_lag_and_workers(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async def scenario(client: AsyncFerryClient) -> object:
        lag_empty = await client.queue_lag()
        await client.ensure_group()
        await client.ensure_group()  # idempotent
        for i in range(3):
            await client.enqueue(GenerateRequest(prompt="x", request_id=f"q{i}"))
        lag = await client.queue_lag()
        cancelled = await client.cancel("q0")
        return lag_empty, lag, cancelled, await client.live_workers(), await client.ping()

    lag_empty, lag, cancelled, workers, pong = _run(scenario, redis_server.url)  # type: ignore[misc]
    assert (lag_empty, lag, cancelled, workers, pong) == (0, 3, "cancelled", [], True)


def test_heartbeats_define_live_workers(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    now = time.time()
    pipe = redis_client.pipeline()
    for wid in ("w1", "w2"):
        beat = WorkerHeartbeat(worker_id=wid, model="m", started_at=now, updated_at=now)
        write_heartbeat(pipe, KEYS, beat, TTLS)
    pipe.execute()
    assert 0 < redis_client.ttl(KEYS.worker("w1")) <= TTLS.heartbeat_s
    redis_client.delete(KEYS.worker("w2"))  # as if its TTL ran out

    async def scenario(client: AsyncFerryClient) -> object:
        return [w.worker_id for w in await client.live_workers()]

    assert _run(scenario, redis_server.url) == ["w1"]
    assert redis_client.smembers(KEYS.workers) == {b"w1"}  # the dead id was pruned
    pipe = redis_client.pipeline()
    remove_heartbeat(pipe, KEYS, "w1")
    pipe.execute()
    assert not redis_client.exists(KEYS.worker("w1"))


def test_undecodable_entry_goes_to_dead_letter(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    ensure_group(redis_client, KEYS)
    redis_client.xadd(KEYS.requests, {"data": msgpack.packb({"version": 1, "prompt": 3})})
    redis_client.xadd(KEYS.requests, {"junk": b"\xc1"})
    good = GenerateRequest(prompt="fine")
    redis_client.xadd(KEYS.requests, request_fields(good))  # type: ignore[arg-type]
    with FakeWorker(redis_server.url) as worker:
        deadline = time.monotonic() + 5
        while len(worker.seen) + len(worker.dead) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    dead = redis_client.xrange(KEYS.dead_letter)
    # (an entry with no request is answered by the pull itself, before the adopted ones)
    assert sorted(fields[b"reason"].split(b":")[0] for _id, fields in dead) == [b"data",
                                                                                b"prompt"]
    assert worker.seen == [good]
    assert redis_client.xpending(KEYS.requests, KEYS.group)["pending"] == 0
