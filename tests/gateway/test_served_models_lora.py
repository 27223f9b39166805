"""ServedModels with LoRA adapters, on a stub client (no Redis): adapters are served names
read once per TTL, a miss is re-read before the 404, the resolver is the last chance, a
failed read keeps the last one (base models go on), and a tenant's allowlist filters."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import APIError
from gateway.served_models import ServedModels
from gateway.tenancy.tenants import Tenant
from protocol.keys import Keys
from protocol.lora import LoraRecord
from protocol.models import WorkerHeartbeat


class _Redis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[bytes, bytes]] = {}
        self.reads = 0
        self.down = False

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        self.reads += 1
        if self.down:
            raise RedisConnectionError("gone")
        return dict(self.hashes.get(key, {}))


class _Client:
    def __init__(self) -> None:
        self.redis = _Redis()
        self.keys = Keys()

    async def live_workers(self) -> list[WorkerHeartbeat]:
        now = time.time()
        return [WorkerHeartbeat(worker_id="w1", model="base", started_at=now, updated_at=now)]

    def register(self, name: str) -> None:
        record = LoraRecord(name=name, path=f"/lora/{name}", parent="base")
        self.redis.hashes.setdefault(self.keys.lora_adapters("base"), {})[
            name.encode()] = record.encode().encode()


def _served(ttl_s: float = 60.0) -> tuple[ServedModels, _Client]:
    client = _Client()
    return ServedModels(client, None, ttl_s=ttl_s), client  # type: ignore[arg-type]


def test_adapters_are_served_names_read_once_per_ttl() -> None:
    async def run() -> None:
        served, client = _served()
        client.register("a1")
        assert await served.names() == ["base", "a1"]
        assert await served.resolve("a1") == "a1" and await served.resolve(None) == "base"
        assert await served.base_of("a1") == "base" and await served.base_of("base") == "base"
        reads = client.redis.reads
        for _ in range(5):
            await served.resolve("a1")
            await served.resolve("base")
        assert client.redis.reads == reads  # cached

        client.register("a2")  # registered elsewhere: the miss is re-read
        assert await served.resolve("a2") == "a2"
        with pytest.raises(APIError) as caught:
            await served.resolve("nope")
        assert caught.value.status == 404 and caught.value.code == "model_not_found"

    asyncio.run(run())


def test_a_failed_read_keeps_the_last_adapters() -> None:
    async def run() -> None:
        served, client = _served(ttl_s=0.0)
        client.register("a1")
        assert await served.resolve("a1") == "a1"
        client.redis.down = True
        assert await served.resolve("a1") == "a1"
        assert await served.resolve("base") == "base"

    asyncio.run(run())


def test_tenant_allowlist_and_resolver() -> None:
    async def run() -> None:
        served, client = _served()
        client.register("a1")
        client.register("b1")
        only_a = Tenant("t", lora_adapters=frozenset({"a1", "c1"}))
        assert await served.names(tenant=only_a) == ["base", "a1"]
        with pytest.raises(APIError) as caught:
            await served.resolve("b1", only_a)
        assert "b1" not in caught.value.message.split("served:")[1]
        asked: list[tuple[str, Any]] = []

        async def resolver(name: str, tenant: Tenant | None) -> bool:
            asked.append((name, tenant))
            return name == "c1"

        served.resolver = resolver
        assert await served.resolve("c1", only_a) == "c1"
        with pytest.raises(APIError):
            await served.resolve("d1")
        assert asked == [("c1", only_a), ("d1", None)]

    asyncio.run(run())
