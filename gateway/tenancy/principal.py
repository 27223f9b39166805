"""Who is calling: the tenant that owns the jobs, files and batches its requests create.

``require_api_key`` (``gateway.admission``) resolves the caller's key to its tenant once
(``gateway.tenancy.tenants``) and keeps it on the request; ``tenant`` and ``principal`` are the one
place every route asks. Another tenant's object is answered 404, never 403: its existence
is not disclosed.
"""

from __future__ import annotations

import re

from fastapi import Request

from gateway.errors import APIError
from gateway.tenancy.tenants import DEFAULT, Tenant, key_tenant_id
from protocol.models import ID_PATTERN, GenerateRequest
from protocol.tenants.ids import scoped_id

_ID_RE = re.compile(ID_PATTERN)

ANONYMOUS = DEFAULT.id
"""The owner of everything a gateway without keys creates: the default tenant."""


def tenant(request: Request) -> Tenant:
    """The caller's tenant (the route already checked the key)."""
    return getattr(request.state, "tenant", DEFAULT)


def principal(request: Request) -> str:
    """The owner id of this request's caller: its tenant's id."""
    return tenant(request).id


def key_principal(api_key: str, secret: bytes) -> str:
    """The tenant id of a key given in ``FERRY_API_KEYS``, under the deployment's naming
    secret (``gateway.tenancy.naming``)."""
    return key_tenant_id(api_key, secret)


def scoped(who: Tenant, requests: list[GenerateRequest]) -> list[GenerateRequest]:
    """The requests as ``who``'s: its tenant named, each id moved into its namespace
    (``protocol.tenants.ids``), its prefix-cache group named (``protocol.tenants.cache_scope``); 400
    naming ``request_id`` for an id that cannot be."""
    try:
        return [r.model_copy(update={"tenant": who.wire, "cache_scope": who.prefix_cache_group,
                                     "request_id": scoped_id(who.id, r.request_id)})
                for r in requests]
    except ValueError as exc:
        raise APIError(400, str(exc), param="request_id") from None


def job_id(who: Tenant, public: str) -> str | None:
    """The Redis id of ``who``'s job ``public``, or None if it cannot name one of its jobs
    (the route answers 404, as for an unknown id)."""
    if not _ID_RE.fullmatch(public):
        return None
    try:
        return scoped_id(who.id, public)
    except ValueError:
        return None
