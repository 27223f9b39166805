"""The prefix-cache partition of a request: the KV blocks it may share are its tenant's,
an operator's sharing group's, and within either only those of the same cache salt.

A shared prefix cache is a timing oracle: a prompt that another request computed comes
back sooner. So blocks are shared only inside a partition (``worker/engine/kv/block_manager.py``
roots every block key in it): by default a tenant's own (``GenerateRequest.tenant``); the
gateway names a group in ``cache_scope`` for tenants an operator lets share on purpose
(``docs/tenants.md``); ``cache_salt`` (vLLM's field) narrows either further, for callers
that must not time each other inside one tenant.
"""

from __future__ import annotations

import json

from protocol.tenants.ids import DEFAULT_TENANT

MAX_CACHE_SALT_CHARS = 256
"""A salt's length bound: enough for any key or digest, too little to carry data."""


def check_cache_salt(salt: str | None) -> None:
    """ValueError naming ``cache_salt`` unless it is absent or printable text."""
    if salt is not None and not salt.isprintable():
        raise ValueError("cache_salt: must be printable characters (no control characters "
                         "or line breaks)")


def cache_partition(tenant: str | None, cache_scope: str | None,
                    cache_salt: str | None) -> str | None:
    """The engine's ``cache_scope`` for a request: None (the shared default space) for the
    default tenant without group or salt, else a JSON list naming the kind of space (a
    tenant's or a group's, so a group never lands in a tenant's space of the same name),
    its name and the salt."""
    if cache_scope is None and cache_salt is None and tenant in (None, DEFAULT_TENANT):
        return None
    space = ["group", cache_scope] if cache_scope is not None else \
        ["tenant", tenant or DEFAULT_TENANT]
    return json.dumps([*space, cache_salt])
