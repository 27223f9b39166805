"""The gateway's side of the fleet's LoRA adapters: load (check, then register), unload,
and the ``FERRY_LORA_DIR`` resolver.

The gateway has no torch and no weights, so it never opens an adapter itself: a worker of
the base model loads it against its weights (the ``check_lora`` tokenizer op) and answers
200 or 400 with the reason (another base model, a missing target module, a rank over
``FERRY_MAX_LORA_RANK``, a corrupt file). Only a checked adapter is registered in the
fleet's hash (``protocol/lora.py``), from which every worker, including ones started
later, loads it. Registration is HSETNX: of two gateways loading one name, one wins and
the other answers "already loaded". ``lora_path`` names a directory that must be the same
files on every worker (a shared volume); with ``FERRY_LORA_DIR`` the gateway itself also
looks there, so that directory is mounted on gateways and workers alike.
"""

from __future__ import annotations

import asyncio
import os
import re

import structlog

from gateway.errors import APIError
from gateway.served_models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import Tenant
from gateway.tokenizer_client import TokenizerClient
from protocol.aclient import AsyncFerryClient
from protocol.lora import LORA_NAME_PATTERN, LoraRecord, aregister_adapter, aunregister_adapter

log = structlog.get_logger("ferry.gateway")

_NAME_RE = re.compile(LORA_NAME_PATTERN)


def valid_name(name: str) -> bool:
    """A name the registry takes and that is no path step (``.``, ``..``): the resolver
    joins it to ``FERRY_LORA_DIR``."""
    return bool(_NAME_RE.fullmatch(name)) and set(name) != {"."}


class LoraAdapters:
    def __init__(self, client: AsyncFerryClient, served: ServedModels,
                 tokenizer: TokenizerClient, settings: GatewaySettings) -> None:
        self.client = client
        self.served = served
        self.tokenizer = tokenizer
        self.settings = settings
        self._loading: dict[str, asyncio.Future[bool]] = {}

    async def load(self, name: str, path: str, tenant: Tenant | None = None) -> LoraRecord:
        """Check ``path`` on a worker and register it as adapter ``name`` of the served
        base model; ``APIError`` 400 naming ``lora_name`` or ``lora_path``, 403 for a
        name outside the tenant's allowlist, 503 when no worker answers."""
        if not valid_name(name):
            raise APIError(400, f"lora_name: {name!r} must match {LORA_NAME_PATTERN} (and "
                           "not be only dots)", param="lora_name")
        if tenant is not None and not tenant.may_use_adapter(name):
            raise APIError(403, f"lora_name: this API key may not load adapter {name!r}",
                           param="lora_name", type_="permission_error",
                           code="permission_denied")
        base = await self.served.resolve(None)
        if name == base or name in await self.served.base_names(fresh=True):
            raise APIError(400, f"lora_name: {name!r} is the name of a served base model",
                           param="lora_name")
        if name in await self.served.adapters(fresh=True):
            raise _already_loaded(name)
        try:
            await self.tokenizer.ask(base, "check_lora", lora_name=name, lora_path=path)
        except APIError as exc:
            if exc.status != 400:
                raise
            raise APIError(400, exc.message, param="lora_path") from None
        record = LoraRecord(name=name, path=path, parent=base)
        if not await aregister_adapter(self.client.redis, self.client.keys, record):
            raise _already_loaded(name)  # another gateway registered it meanwhile
        self.served.forget_adapters()
        log.info("lora_adapter_loaded", name=name, path=path, parent=base)
        return record

    async def unload(self, name: str, tenant: Tenant | None = None) -> LoraRecord:
        """Unregister adapter ``name`` (workers drop it once its running requests end);
        404 for a name that is not registered or not the tenant's to use."""
        record = (await self.served.adapters(fresh=True, tenant=tenant)).get(name)
        if record is None or not await aunregister_adapter(
                self.client.redis, self.client.keys, record.parent, name):
            raise APIError(404, f"lora_name: no LoRA adapter {name!r} is loaded",
                           param="lora_name", code="model_not_found")
        self.served.forget_adapters()
        log.info("lora_adapter_unloaded", name=name, parent=record.parent)
        return record

    async def from_dir(self, name: str, tenant: Tenant | None) -> bool:
        """The resolver: True once ``$FERRY_LORA_DIR/<name>`` is registered (loaded now,
        or by another request or gateway meanwhile); False when there is no such
        directory (the request's 404). One load per name runs in this gateway at a time;
        the requests that come meanwhile wait for it."""
        root = self.settings.lora_dir
        if root is None or not valid_name(name):
            return False
        if tenant is not None and not tenant.may_use_adapter(name):
            return False
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            return False
        pending = self._loading.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load_dir(name, path))
            self._loading[name] = pending
            pending.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(pending)

    async def _load_dir(self, name: str, path: str) -> bool:
        try:
            await self.load(name, path)
        except APIError as exc:
            if name in await self.served.adapters(fresh=True):
                return True  # registered by someone else meanwhile
            if exc.status == 400:
                raise APIError(400, f"model: {name!r} in FERRY_LORA_DIR is not a usable "
                               f"LoRA adapter: {exc.message}", param="model") from None
            raise
        return True


def _already_loaded(name: str) -> APIError:
    return APIError(400, f"lora_name: the LoRA adapter {name!r} has already been loaded",
                    param="lora_name")
