"""ServedModels with LoRA adapters, on a stub client (no Redis): adapters are served names
read once per TTL, a miss is re-read before the 404, the resolver is the last chance, a
failed read keeps the last one (base models go on), a tenant's allowlist filters the
fleet-wide ones, and a tenant's own adapters are its alone, under their plain names."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import APIError
from gateway.served.models import ServedModels
from gateway.tenancy.tenants import DEFAULT, Tenant
from protocol.keys import Keys
from protocol.lora.registry import LoraRecord
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

    def register(self, name: str, owner: str | None = None) -> None:
        key = name if owner is None else f"{owner}::{name}"
        record = LoraRecord(name=key, path=f"/lora/{name}", parent="base", owner=owner)
        self.redis.hashes.setdefault(self.keys.lora_adapters("base"), {})[
            key.encode()] = record.encode().encode()


def _served(ttl_s: float = 60.0) -> tuple[ServedModels, _Client]:
    client = _Client()
    return ServedModels(client, None, ttl_s=ttl_s), client  # type: ignore[arg-type]


def test_adapters_are_served_names_read_once_per_ttl() -> None:
    async def run() -> None:
        served, client = _served()
        client.register("a1")
        assert await served.names() == ["base", "a1"]
        assert await served.resolve("a1") == "a1" and await served.resolve(None) == "base"
        assert (await served.route("a1")).base == "base"
        assert (await served.route("base")).base == "base"
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
        assert caught.value.message.split("served:")[1] == " base)"  # no adapter listed
        asked: list[tuple[str, Any]] = []

        async def resolver(name: str, tenant: Tenant | None) -> bool:
            asked.append((name, tenant))
            if name == "c1":
                client.register(name)  # loaded from FERRY_LORA_DIR: fleet-wide
            return name == "c1"

        served.resolver = resolver
        assert await served.resolve("c1", only_a) == "c1"
        with pytest.raises(APIError):
            await served.resolve("d1")
        assert asked == [("c1", only_a), ("d1", DEFAULT)]

    asyncio.run(run())


def test_own_adapters_are_their_tenants_alone() -> None:
    """Two tenants' ``sql`` are two adapters; each sees and routes to its own under the
    plain name, the other's key is not a name anyone can ask for, and an own adapter hides
    a fleet-wide one of the same name."""
    async def run() -> None:
        served, client = _served()
        client.register("sql", owner="alpha")
        client.register("sql", owner="beta")
        client.register("shared")
        alpha, beta, none = Tenant("alpha"), Tenant("beta"), Tenant("gamma")
        assert await served.names(tenant=alpha) == ["base", "shared", "sql"]
        assert await served.names(tenant=none) == ["base", "shared"]
        assert (await served.route("sql", alpha)).key == "alpha::sql"
        assert (await served.route("sql", beta)).key == "beta::sql"
        route = await served.route("sql", alpha)
        assert (route.name, route.base) == ("sql", "base")
        for who, name in ((none, "sql"), (beta, "alpha::sql"), (DEFAULT, "beta::sql")):
            with pytest.raises(APIError) as caught:
                await served.route(name, who)
            assert caught.value.status == 404 and caught.value.code == "model_not_found"
        client.register("shared", owner="alpha")
        served.forget_adapters()
        assert (await served.route("shared", alpha)).key == "alpha::shared"
        assert (await served.route("shared", beta)).key == "shared"

    asyncio.run(run())
