"""Tenants on the wire: who a request belongs to, and the request-id namespace it lives in.

A request names its tenant in ``GenerateRequest.tenant``; a request without one (every
producer older than protocol version 4) belongs to the default tenant. Request ids are
per tenant: the id every Redis key of a tenant's request is built from is *scoped*,
``{tenant}::{id}``, so no tenant can claim, read or cancel another's id, and the default
tenant keeps its plain ids (its keys keep today's names). ``::`` never appears in a plain
id, so the two namespaces cannot overlap. The gateway maps a caller's plain id to the
scoped one and back; a direct producer naming a tenant writes the scoped id itself.
"""

from __future__ import annotations

import re

DEFAULT_TENANT = "default"
"""The tenant of a request that names none: old producers, and a gateway without keys."""

TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"
"""Tenant ids become part of Redis key names: short, key-safe, and never ``::``. Python
checks it with ``fullmatch`` (``re.match`` lets ``$`` match before a final newline, and a
name ending in one was accepted here but refused by the models' pattern)."""

SEPARATOR = "::"
_TENANT_RE = re.compile(TENANT_PATTERN)


def check_tenant(tenant: str) -> str:
    """``tenant`` itself, or ValueError naming the rule it breaks."""
    if not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"tenant: {tenant!r} must match {TENANT_PATTERN}")
    return tenant


def scoped_id(tenant: str, request_id: str) -> str:
    """The id a tenant's ``request_id`` has in Redis (the default tenant's is unchanged)."""
    if SEPARATOR in request_id:
        raise ValueError(f"request_id: {request_id!r} must not contain {SEPARATOR!r}")
    if tenant == DEFAULT_TENANT:
        return request_id
    return f"{check_tenant(tenant)}{SEPARATOR}{request_id}"


def public_id(tenant: str, scoped: str) -> str:
    """The id its tenant knows a scoped id by (the inverse of ``scoped_id``)."""
    prefix = f"{tenant}{SEPARATOR}"
    return scoped[len(prefix):] if tenant != DEFAULT_TENANT and scoped.startswith(prefix) \
        else scoped


def tenant_of_id(scoped: str) -> str:
    """The tenant a scoped id belongs to (the default tenant for a plain id)."""
    head, sep, _ = scoped.partition(SEPARATOR)
    return head if sep else DEFAULT_TENANT


def check_scoped(tenant: str | None, request_id: str) -> None:
    """ValueError unless ``request_id`` lies in ``tenant``'s namespace (``None``: default)."""
    owner = tenant_of_id(request_id)
    expected = tenant or DEFAULT_TENANT
    if owner != expected or request_id.count(SEPARATOR) > 1:
        raise ValueError(f"request_id: {request_id!r} is not in tenant {expected!r}'s "
                         f"namespace (a tenant's ids are '<tenant>{SEPARATOR}<id>')")
