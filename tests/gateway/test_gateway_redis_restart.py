"""The gateway across a Redis restart: no error burst after, bounded 503s during, and the
shared pub/sub connection subscribed to nothing that has ended (issue 14, item 3)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

BODY = {"prompt": "x", "max_tokens": 4}


@pytest.fixture(scope="module")
def aof_server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(aof_server: RedisServer) -> Iterator[GatewayServer]:
    # stream_hold_s=0: headers right after the enqueue (these streams have no worker)
    settings = GatewaySettings(redis_url=aof_server.url, keepalive_s=0.5, redis_timeout_s=2.0,
                               max_queue_lag=None, stream_hold_s=0)
    with GatewayServer(settings) as server:
        yield server


async def _burst(url: str, n: int, stream: bool = False) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=n)) as http:
        return list(await asyncio.gather(*(
            http.post("/v1/completions", json={**BODY, "stream": stream}) for _ in range(n))))


def _token_channels(r: redis.Redis) -> list[bytes]:
    return sorted(r.pubsub_channels("ferry:tokens:*"))


def test_requests_after_a_restart_all_succeed(gateway: GatewayServer,
                                              aof_server: RedisServer) -> None:
    with FakeWorker(aof_server.url, Script(tokens=["a", "b"])):
        warm = asyncio.run(_burst(gateway.url, 48))  # fills the pool with connections
        assert [r.status_code for r in warm] == [200] * 48
    aof_server.restart()  # kill -9, then up again: every pooled connection is dead
    with FakeWorker(aof_server.url, Script(tokens=["a", "b"])):
        burst = asyncio.run(_burst(gateway.url, 48))
        assert [r.status_code for r in burst] == [200] * 48, [r.text for r in burst][:3]
        for _ in range(5):
            reply = httpx.post(f"{gateway.url}/v1/completions", json=BODY, timeout=30)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == "ab"


def test_redis_down_is_a_bounded_json_503(gateway: GatewayServer,
                                          aof_server: RedisServer) -> None:
    aof_server.kill()
    try:
        for path, body in (("/v1/completions", BODY),
                           ("/v1/completions", {**BODY, "stream": True}),
                           ("/v1/jobs", {"prompt": "x"})):
            start = time.monotonic()
            reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=30)
            took = time.monotonic() - start
            assert reply.status_code == 503, (path, reply.status_code, reply.text)
            assert reply.json()["error"]["type"] == "service_unavailable"
            assert reply.headers.get("retry-after")
            assert took < 10, (path, took)  # bounded: redis_timeout_s plus retries
        reply = httpx.get(f"{gateway.url}/v1/jobs/some-job", timeout=30)
        assert reply.status_code == 503 and reply.json()["error"]["message"]
    finally:
        aof_server.start()


def test_streams_that_ended_during_an_outage_are_not_resubscribed(
    gateway: GatewayServer, aof_server: RedisServer
) -> None:
    probe = aof_server.client()
    # No worker: a stream subscribes before it enqueues, and (no hold) its headers come
    # right after.
    streams = [httpx.stream("POST", f"{gateway.url}/v1/completions", timeout=30,
                            json={**BODY, "stream": True, "request_id": f"gone-{i}"})
               for i in range(6)]
    for stream in streams:
        assert stream.__enter__().status_code == 200
    assert len(_token_channels(probe)) == 6
    aof_server.kill()
    for stream in streams:  # the clients leave while Redis is away: unsubscribing fails
        stream.__exit__(None, None, None)
    time.sleep(0.5)
    aof_server.start()
    time.sleep(3.0)  # the hub reconnects by itself (several backoffs)
    assert _token_channels(probe) == []  # ... without the streams that ended meanwhile
    with FakeWorker(aof_server.url, Script(tokens=["a", "b"])):  # and it still serves
        reply = httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": True},
                           timeout=30)
        assert reply.status_code == 200 and '"text":"b"' in reply.text
    probe.close()
