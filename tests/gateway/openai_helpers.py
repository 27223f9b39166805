"""Shared by the gateway's client tests: a gateway and a fake worker on the module's
Redis, the official SDK pointed at it, raw posts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(GatewaySettings(redis_url=redis_server.url, keepalive_s=0.5,
                                       max_messages=200_000)) as server:
        yield server


@pytest.fixture
def worker(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["Hel", "lo", "!"])) as fake:
        yield fake


def sdk(gw: GatewayServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def post(gw: GatewayServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=15, **kw)


def raw(gw: GatewayServer, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", content=text.encode(), timeout=15,
                      headers={"content-type": "application/json"})


def raw_stream(gw: GatewayServer, path: str, body: Any) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed response, as sent (``[DONE]`` left out)."""
    with httpx.stream("POST", f"{gw.url}{path}", json=body, timeout=15) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line[6:]) for line in reply.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]
