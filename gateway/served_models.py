"""Which model names this gateway answers to: one name everywhere, unknown names are 404.

The names are the configured ``served_model_name`` (``FERRY_SERVED_MODEL_NAME``) and the
models that live workers advertise in their heartbeats (``ferry worker
--served-model-name``, default the checkpoint directory's name). A request naming another
model gets 404 ``model_not_found``, as vLLM answers, instead of a completion from a model
it did not ask for; a request naming none is answered as the served model, and that is the
name ``/v1/models`` lists. While nothing is configured and no worker is live, any name is
accepted: the request waits in the queue for whichever worker comes.

The heartbeat read is cached for ``ttl_s`` so that a burst of requests costs one Redis
round trip, not one each; an empty read is not cached, and a name missing from the cache
is looked up again before the 404 (a worker that just started is not refused).

LoRA adapters (``protocol/lora.py``) are served names too: each served base model's
registered adapters, read from Redis with the same TTL and re-read before a 404. A request
naming an adapter keeps the adapter's name as its ``model`` (the worker maps it to the
adapter over its base model). A tenant with an adapter allowlist (``lora_adapters`` in the
tenants file) gets 404 for any other adapter, as if it did not exist, and a name that is
neither served nor registered may still be loaded on first use from ``FERRY_LORA_DIR``
(``resolver``, set by the app: ``gateway/lora.py``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

from gateway.errors import APIError
from gateway.tenancy.tenants import Tenant, TenantDirectory
from protocol.aclient import AsyncFerryClient
from protocol.lora import LoraRecord, aread_adapters
from protocol.models import WorkerHeartbeat
from protocol.shard_health import ShardDownError

log = structlog.get_logger("ferry.gateway")

FALLBACK_NAME = "default"
"""Answered when nothing is configured and no worker is live (the embedded model's name)."""

Resolver = Callable[[str, Tenant | None], Awaitable[bool]]
"""Loads an unknown name as an adapter on first use (True: it is registered now)."""


class ServedModels:
    def __init__(self, client: AsyncFerryClient, configured: str | None, ttl_s: float = 2.0):
        self.client = client
        self.configured = configured
        self.ttl_s = ttl_s
        self.resolver: Resolver | None = None
        self.tenants: TenantDirectory | None = None  # the Batch API's owners' allowlists
        self._workers: list[WorkerHeartbeat] = []
        self._read_at = float("-inf")
        self._adapters: dict[str, LoraRecord] = {}
        self._adapters_at = float("-inf")

    async def workers(self, fresh: bool = False) -> list[WorkerHeartbeat]:
        stale = time.monotonic() - self._read_at > self.ttl_s or not self._workers
        if fresh or stale:
            try:
                self._workers = await self.client.live_workers()
            except ShardDownError:  # the heartbeats' shard is lost: go on with the last seen
                return self._workers
            self._read_at = time.monotonic()
        return self._workers

    async def base_names(self, fresh: bool = False) -> list[str]:
        """Served base models, the configured one first (no adapters)."""
        advertised = sorted({w.model for w in await self.workers(fresh)})
        if self.configured is None:
            return advertised
        return [self.configured, *(n for n in advertised if n != self.configured)]

    async def adapters(self, fresh: bool = False, tenant: Tenant | None = None
                       ) -> dict[str, LoraRecord]:
        """The registered adapters of every served base model, by name (those ``tenant``
        may use). A failed read keeps the last one: base models go on being served."""
        if fresh or time.monotonic() - self._adapters_at > self.ttl_s:
            bases = await self.base_names()  # a fresh caller has just read the heartbeats
            found: dict[str, LoraRecord] = {}
            try:
                for base in bases:
                    records = await aread_adapters(self.client.redis, self.client.keys, base)
                    found.update({n: r for n, r in records.items() if n not in bases})
            except (RedisError, ShardDownError) as exc:
                log.warning("lora_adapters_unreadable", error=f"{type(exc).__name__}: {exc}")
            else:
                self._adapters, self._adapters_at = found, time.monotonic()
        if tenant is None:
            return dict(self._adapters)
        return {n: r for n, r in self._adapters.items() if tenant.may_use_adapter(n)}

    def forget_adapters(self) -> None:
        """The next read goes to Redis (after this gateway loaded or unloaded one)."""
        self._adapters_at = float("-inf")

    async def names(self, fresh: bool = False, tenant: Tenant | None = None) -> list[str]:
        """Served names: the base models (the configured one first), then the adapters."""
        bases = await self.base_names(fresh)
        return [*bases, *sorted(await self.adapters(fresh, tenant))]

    async def base_of(self, name: str) -> str:
        """The base model that serves ``name``: its parent for an adapter, else itself."""
        record = (await self.adapters()).get(name)
        return name if record is None else record.parent

    def tenant_of(self, owner: str) -> Tenant | None:
        """The tenant named ``owner`` (a batch's owner), for its adapter allowlist."""
        return None if self.tenants is None else self.tenants.tenant(owner)

    async def resolve(self, requested: str | None, tenant: Tenant | None = None) -> str:
        """The name to answer with; ``APIError`` 404 for a model this gateway does not
        serve, or an adapter ``tenant`` may not use."""
        if requested is None:
            bases = await self.base_names()
            return bases[0] if bases else FALLBACK_NAME
        for fresh in (False, True):
            bases = await self.base_names(fresh)
            if not bases or requested in bases:
                return requested
            if requested in await self.adapters(fresh, tenant):
                return requested
        if self.resolver is not None and await self.resolver(requested, tenant):
            return requested
        names = await self.names(tenant=tenant)
        raise APIError(
            404, f"model: the model {requested!r} does not exist (served: "
            f"{', '.join(names)})", param="model", code="model_not_found")
