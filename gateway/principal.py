"""Who is calling: the principal that owns the files and batches it creates.

Until tenants exist this is the API key itself, named by a stable, non-secret id (a hash
prefix, so Redis and logs never hold the key), or one anonymous principal when the gateway
runs without keys. ``principal`` is the one place that decides it: tenants will map the
key to its tenant's id here, and every Batch API route already asks only this function.
Another principal's object is answered 404, never 403: its existence is not disclosed.
"""

from __future__ import annotations

import hashlib

from fastapi import Request

from gateway.settings import GatewaySettings

ANONYMOUS = "anonymous"


def principal(request: Request) -> str:
    """The owner id of this request's caller (the route already checked the key)."""
    settings: GatewaySettings = request.app.state.settings
    if not settings.api_keys:
        return ANONYMOUS
    _scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return key_principal(token.strip())


def key_principal(api_key: str) -> str:
    """``key-`` and 16 hex digits of the key's SHA-256: stable across restarts and
    gateways, safe in key names, and useless for recovering the key."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
