"""Operators: who may register fleet-wide LoRA adapters and act on any tenant's.

A tenant's key loads adapters into its own namespace only (``protocol/lora/registry.py``). An
operator names registry keys as they are: a plain name is fleet-wide, ``{tenant}::name``
is that tenant's. Operators are the callers of an ``FERRY_ADMIN_KEYS`` key, the keys of a
tenant with ``admin = true`` in the tenants file, and everyone on a gateway without keys
(its single tenant is the whole deployment, so nothing changes there).

``require_lora_key`` guards the LoRA routes in place of ``require_api_key``: an admin key
is checked first (every stored key compared in constant time), then a tenant's key as on
any ``/v1`` route.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway.admission import require_api_key
from gateway.tenancy.principal import tenant
from gateway.tenancy.tenants import DEFAULT, Tenant


@dataclass(frozen=True)
class LoraCaller:
    """Who calls a LoRA route: its tenant (the default one for an admin key) and whether
    it acts as an operator."""

    tenant: Tenant
    operator: bool


async def require_lora_key(request: Request) -> None:
    """An admin key makes the caller an operator; anything else must be a tenant's key
    (401 otherwise, as on every ``/v1`` route)."""
    admin_keys: tuple[str, ...] = request.app.state.settings.admin_keys
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if admin_keys and scheme.lower() == "bearer":
        given = token.strip().encode()
        matched = False
        for key in admin_keys:
            matched |= hmac.compare_digest(given, key.encode())
        if matched:
            request.state.tenant = DEFAULT
            request.state.lora_operator = True
            return
    await require_api_key(request)


def lora_caller(request: Request) -> LoraCaller:
    """The caller of a LoRA route (after ``require_lora_key``)."""
    who = tenant(request)
    unauthenticated = not request.app.state.tenants.authenticated
    operator = bool(getattr(request.state, "lora_operator", False)) or who.admin \
        or unauthenticated
    return LoraCaller(who, operator)
