"""The gateway's side of the fleet's LoRA adapters: load (check, then register), unload,
and the ``FERRY_LORA_DIR`` resolver.

The gateway has no torch and no weights, so it never opens an adapter itself: a worker of
the base model loads it against its weights (the ``check_lora`` tokenizer op) and answers
200 or 400 with the reason (another base model, a missing target module, a rank over
``FERRY_MAX_LORA_RANK``, a corrupt file, a path outside its adapter roots). Only a checked
adapter is registered in the fleet's hash (``protocol/lora/registry.py``), from which every
worker, including ones started later, loads it. Registration is one script: of two
gateways loading one name, one wins and the other answers "already loaded", and a
namespace's limit holds across gateways.

Adapters are owned: a tenant's load lands in its own namespace (``{tenant}::name``), so it
can neither see, replace, unload nor squat another's; an operator (``gateway/tenancy/
operators.py``) names registry keys directly and registers fleet-wide adapters. Another
tenant's adapter is answered exactly like a missing one. No answer shows a server path.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass

import structlog

from gateway.errors import APIError
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.operators import LoraCaller
from gateway.tenancy.tenants import Tenant
from gateway.tokenizer_client import TokenizerClient
from protocol.aclient import AsyncFerryClient
from protocol.lora.paths import NOT_ALLOWED, lexically_allowed
from protocol.lora.registry import (
    ADAPTER_NAME_PATTERN,
    LoraRecord,
    LoraSource,
    adapter_key,
    aregister_adapter,
    aunregister_adapter,
    owner_of,
)
from protocol.tenants.ids import DEFAULT_TENANT, SEPARATOR, TENANT_PATTERN

log = structlog.get_logger("ferry.gateway")

_NAME_RE = re.compile(ADAPTER_NAME_PATTERN)
_TENANT_RE = re.compile(TENANT_PATTERN)


def valid_name(name: str) -> bool:
    """A caller's adapter name: the pattern, no ``::`` (a namespace's separator) and no
    path step (``.``, ``..``: the resolver joins it to ``FERRY_LORA_DIR``)."""
    return bool(_NAME_RE.fullmatch(name)) and SEPARATOR not in name and set(name) != {"."}


@dataclass(frozen=True)
class Loaded:
    """A registered adapter as its caller knows it."""

    name: str
    record: LoraRecord


class LoraAdapters:
    def __init__(self, client: AsyncFerryClient, served: ServedModels,
                 tokenizer: TokenizerClient, settings: GatewaySettings) -> None:
        self.client = client
        self.served = served
        self.tokenizer = tokenizer
        self.settings = settings
        self._loading: dict[str, asyncio.Future[bool]] = {}

    def registry_key(self, name: str, caller: LoraCaller) -> str:
        """The registry key ``caller``'s ``name`` stands for; 400 naming ``lora_name`` for a
        name no one may register. An operator's ``tenant::name`` is that tenant's."""
        owner: str | None
        owner, sep, plain = name.partition(SEPARATOR)
        if not sep:
            owner, plain = None, name
        scoped_ok = owner is None or (caller.operator and owner != DEFAULT_TENANT
                                      and _TENANT_RE.fullmatch(owner) is not None)
        if not valid_name(plain) or not scoped_ok:
            raise APIError(400, f"lora_name: {name!r} must match {ADAPTER_NAME_PATTERN} "
                           "without '::' (and not be only dots)", param="lora_name")
        if owner is not None:
            return f"{owner}{SEPARATOR}{plain}"
        return adapter_key(None if caller.operator else caller.tenant.id, plain)

    async def load(self, name: str, path: str, caller: LoraCaller,
                   replace: bool = False) -> Loaded:
        """Check ``path`` on a worker and register it as ``caller``'s adapter ``name`` of
        the served base model (``replace``: over its own adapter of that name); 400 naming
        ``lora_name`` or ``lora_path``, 403 over the namespace's limit, 503 when no worker
        answers."""
        key = self.registry_key(name, caller)
        limit = self._limit(caller, key)
        roots = self.settings.adapter_roots
        if roots and not lexically_allowed(path, roots):
            raise APIError(400, NOT_ALLOWED, param="lora_path")
        return await self._register(key, name, path, limit, replace, "api", caller.tenant)

    def _limit(self, caller: LoraCaller, key: str) -> int:
        if owner_of(key) is None:
            return self.settings.lora_max_fleet_adapters
        if caller.operator:
            return self.settings.lora_max_adapters_per_tenant
        limit = caller.tenant.own_adapter_limit(self.settings.lora_max_adapters_per_tenant)
        if limit == 0:
            raise APIError(403, "lora_name: this API key may not load LoRA adapters",
                           param="lora_name", type_="permission_error",
                           code="permission_denied")
        return limit

    async def _register(self, key: str, name: str, path: str, limit: int, replace: bool,
                        source: LoraSource, tenant: Tenant) -> Loaded:
        plain = name.partition(SEPARATOR)[2] or name
        base = await self.served.resolve(None)
        if plain == base or plain in await self.served.base_names(fresh=True):
            raise APIError(400, f"lora_name: {name!r} is the name of a served base model",
                           param="lora_name")
        records = await self.served.adapters(fresh=True)
        if not replace and key in records:
            raise _already_loaded(name)
        if key not in records and _count(records, key, base) >= limit:
            raise _full(limit, base)  # before a worker spends a load on it
        try:
            await self.tokenizer.ask(base, "check_lora", lora_name=plain, lora_path=path)
        except APIError as exc:
            if exc.status != 400:
                raise
            raise APIError(400, exc.message, param="lora_path") from None
        record = LoraRecord(name=key, path=path, parent=base, owner=owner_of(key),
                            source=source)
        outcome = await aregister_adapter(self.client.redis, self.client.keys, record, limit,
                                          replace)
        if outcome == "exists":
            raise _already_loaded(name)  # another gateway registered it meanwhile
        if outcome == "full":
            raise _full(limit, base)
        self.served.forget_adapters()
        log.info("lora_adapter_loaded", adapter=key, parent=base, source=source,
                 outcome=outcome, tenant=tenant.id)
        return Loaded(name, record)

    async def unload(self, name: str, caller: LoraCaller) -> Loaded:
        """Unregister ``caller``'s adapter ``name`` (workers drop it once its running
        requests end); 404 for a name that is not registered in its namespace, exactly as
        for one that does not exist anywhere."""
        try:
            key = self.registry_key(name, caller)
        except APIError:
            key = None
        record = None if key is None else (await self.served.adapters(fresh=True)).get(key)
        if record is None or not await aunregister_adapter(
                self.client.redis, self.client.keys, record.parent, record.name):
            raise APIError(404, f"lora_name: no LoRA adapter {name!r} is loaded",
                           param="lora_name", code="model_not_found")
        self.served.forget_adapters()
        log.info("lora_adapter_unloaded", adapter=record.name, parent=record.parent,
                 tenant=caller.tenant.id)
        return Loaded(name, record)

    async def from_dir(self, name: str, tenant: Tenant) -> bool:
        """The resolver: True once ``$FERRY_LORA_DIR/<name>`` is registered as a fleet-wide
        adapter (loaded now, or by another request or gateway meanwhile); False when there
        is no such directory, ``tenant``'s allowlist does not admit it, or a worker finds
        it outside its roots (the request's 404). One load per name runs in this gateway
        at a time; the requests that come meanwhile wait for it."""
        root = self.settings.lora_dir
        if root is None or not valid_name(name) or not tenant.may_use_adapter(name):
            return False
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            return False
        pending = self._loading.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load_dir(name, path, tenant))
            self._loading[name] = pending
            pending.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(pending)

    async def _load_dir(self, name: str, path: str, tenant: Tenant) -> bool:
        try:
            await self._register(name, name, path, self.settings.lora_max_fleet_adapters,
                                 False, "dir", tenant)
        except APIError as exc:
            if name in await self.served.adapters(fresh=True):
                return True  # registered by someone else meanwhile
            if exc.status == 400 and exc.message == NOT_ALLOWED:
                return False  # e.g. a symlink out of the directory: as if not there
            if exc.status == 400:
                raise APIError(400, f"model: {name!r} in FERRY_LORA_DIR is not a usable "
                               f"LoRA adapter: {exc.message}", param="model") from None
            raise
        return True


def _count(records: dict[str, LoraRecord], key: str, base: str) -> int:
    """How many adapters of ``base`` ``key``'s namespace holds (the script's count)."""
    owner = owner_of(key)
    return sum(r.owner == owner and r.parent == base for r in records.values())


def _full(limit: int, base: str) -> APIError:
    return APIError(403, f"lora_name: this namespace has {limit} LoRA adapters of {base!r} "
                    "loaded (the limit); unload one first", param="lora_name",
                    type_="permission_error", code="lora_adapter_limit")


def _already_loaded(name: str) -> APIError:
    return APIError(400, f"lora_name: the LoRA adapter {name!r} has already been loaded",
                    param="lora_name")
