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

LoRA adapters (``protocol/lora/registry.py``) are served names too: each served base model's
registered adapters, read from Redis with the same TTL and re-read before a 404 (with no
base model known, the registry's own list of models). Names are per caller: a tenant sees
its own adapters by their plain names and the fleet-wide ones its allowlist
(``lora_adapters`` in the tenants file) admits, its own first; anything else is 404, as if
it did not exist. ``route`` gives the registry key a request carries in ``model`` (the
worker maps it to the adapter over its base model) beside the caller's name, which
responses echo. A name that is neither served nor registered may still be loaded on first
use from ``FERRY_LORA_DIR`` (``resolver``, set by the app: ``gateway/served/lora.py``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from gateway.errors import APIError
from gateway.tenancy.tenants import DEFAULT, Tenant, TenantDirectory
from protocol.aclient import AsyncFerryClient
from protocol.cluster.shard_health import ShardDownError
from protocol.lora.registry import LoraRecord, aread_adapter_models, aread_adapters, public_name
from protocol.models import WorkerHeartbeat
from protocol.tenants.ids import SEPARATOR

log = structlog.get_logger("ferry.gateway")

FALLBACK_NAME = "default"
"""Answered when nothing is configured and no worker is live (the embedded model's name)."""

Resolver = Callable[[str, Tenant], Awaitable[bool]]
"""Loads an unknown name as an adapter on first use (True: it is registered now)."""


@dataclass(frozen=True)
class Route:
    """What a request's ``model`` is for its caller: the name it gave (responses echo it),
    the key the request carries (an adapter's registry key, else the name) and the base
    model that serves it."""

    name: str
    key: str
    base: str


def visible(records: Mapping[str, LoraRecord], tenant: Tenant) -> dict[str, LoraRecord]:
    """The adapters ``tenant`` may use, by the names it knows them by: its own, and the
    fleet-wide ones its allowlist admits (an own adapter hides a fleet-wide one of the same
    name)."""
    fleet = {k: r for k, r in records.items() if r.owner is None and tenant.may_use_adapter(k)}
    own = {public_name(tenant.id, k): r for k, r in records.items()
           if r.owner is not None and r.owner == tenant.id}
    return fleet | own


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

    async def adapters(self, fresh: bool = False) -> dict[str, LoraRecord]:
        """Every registered adapter of the served base models (with none known, of every
        model the registry lists), by registry key. A failed read keeps the last one:
        base models go on being served."""
        if fresh or time.monotonic() - self._adapters_at > self.ttl_s:
            found: dict[str, LoraRecord] = {}
            try:
                bases = await self.base_names()  # a fresh caller has just read the heartbeats
                models = bases or await aread_adapter_models(self.client.redis,
                                                             self.client.keys)
                for base in models:
                    records = await aread_adapters(self.client.redis, self.client.keys, base)
                    found.update({n: r for n, r in records.items() if n not in bases})
            except (RedisError, ShardDownError) as exc:
                log.warning("lora_adapters_unreadable", error=f"{type(exc).__name__}: {exc}")
            else:
                self._adapters, self._adapters_at = found, time.monotonic()
        return dict(self._adapters)

    async def tenant_adapters(self, tenant: Tenant, fresh: bool = False
                              ) -> dict[str, LoraRecord]:
        """The adapters ``tenant`` may use, by the names it knows them by (``visible``)."""
        return visible(await self.adapters(fresh), tenant)

    def forget_adapters(self) -> None:
        """The next read goes to Redis (after this gateway loaded or unloaded one)."""
        self._adapters_at = float("-inf")

    async def names(self, fresh: bool = False, tenant: Tenant = DEFAULT) -> list[str]:
        """Served names: the base models (the configured one first), then the adapters
        ``tenant`` may use."""
        bases = await self.base_names(fresh)
        return [*bases, *sorted(await self.tenant_adapters(tenant, fresh))]

    def tenant_of(self, owner: str) -> Tenant:
        """The tenant named ``owner`` (a batch's owner), for its adapters and allowlist."""
        return DEFAULT if self.tenants is None else self.tenants.tenant(owner)

    async def resolve(self, requested: str | None, tenant: Tenant = DEFAULT) -> str:
        """The name to answer with (``route``'s ``name``)."""
        return (await self.route(requested, tenant)).name

    async def route(self, requested: str | None, tenant: Tenant = DEFAULT) -> Route:
        """Where a request naming ``requested`` goes; ``APIError`` 404 for a model this
        gateway does not serve, or an adapter ``tenant`` may not use (another tenant's is
        not found, exactly like a missing one)."""
        if requested is None:
            bases = await self.base_names()
            base = bases[0] if bases else FALLBACK_NAME
            return Route(base, base, base)
        if SEPARATOR not in requested:  # no caller's name holds '::': not another's key
            found = await self._find(requested, tenant)
            if found is not None:
                return found
            if self.resolver is not None and await self.resolver(requested, tenant):
                record = (await self.tenant_adapters(tenant, fresh=True)).get(requested)
                if record is not None:
                    return Route(requested, record.name, record.parent)
        bases = await self.base_names()
        raise APIError(
            404, f"model: the model {requested!r} does not exist (served: "
            f"{', '.join(bases) or 'none yet'})", param="model", code="model_not_found")

    async def _find(self, requested: str, tenant: Tenant) -> Route | None:
        """A served base model or one of ``tenant``'s adapters (cached, then fresh); with
        no base model known, any other name but a fleet-wide adapter ``tenant`` may not
        use waits in the queue for whichever worker comes."""
        for fresh in (False, True):
            bases = await self.base_names(fresh)
            if requested in bases:
                return Route(requested, requested, requested)
            records = await self.adapters(fresh)
            record = visible(records, tenant).get(requested)
            if record is not None:
                return Route(requested, record.name, record.parent)
        if not bases and requested not in records:
            return Route(requested, requested, requested)
        return None
