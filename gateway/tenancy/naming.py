"""The deployment's naming secret: the HMAC key ``FERRY_API_KEYS``' tenants are named with.

A tenant's name scopes its request ids, files, batches, quotas and fair-share counters in
Redis, and labels its metrics and log lines, so it must be the same on every gateway of a
deployment and across restarts, differ between keys, and reveal nothing about its key
(``gateway.tenancy.tenants.key_tenant_id``). The secret therefore lives beside the state it
names: one Redis string, ``{prefix}:tenant:naming-secret``, written once by the first
gateway that needs it and read by all the others.

Every authenticated request reads it (one small script: get, or set if missing), not only
the first: were Redis emptied under running gateways, one that kept its old secret in
memory would name a key's tenant apart from a gateway started afterwards (its jobs 404
on the other, its quotas counted twice). The first gateway to ask writes its secret back
and the others adopt whatever is stored, so they agree again at once.
"""

from __future__ import annotations

import secrets

import structlog

from gateway.tenancy.tenants import TenantDirectory
from protocol.aclient import AsyncFerryClient
from protocol.keys import Keys

log = structlog.get_logger("ferry.gateway")

# KEYS: the secret. ARGV: the secret to store if there is none. Returns the stored one.
SECRET_LUA = """
local stored = redis.call('GET', KEYS[1])
if stored then return stored end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""


def secret_key(keys: Keys) -> str:
    """STRING: 64 hex digits, never expires."""
    return f"{keys.prefix}:tenant:naming-secret"


async def naming_secret(client: AsyncFerryClient, candidate: bytes) -> bytes:
    """The deployment's secret; ``candidate`` becomes it if there is none yet."""
    value = await client.redis.eval(SECRET_LUA, 1, secret_key(client.keys),  # type: ignore[misc]
                                    candidate)
    return value if isinstance(value, bytes) else str(value).encode()


class NamedTenants:
    """One gateway's tenant directory with its ``FERRY_API_KEYS`` tenants named under the
    secret Redis holds now (a gateway starts without Redis: nothing is read before the
    first request)."""

    def __init__(self, client: AsyncFerryClient, directory: TenantDirectory) -> None:
        self.client = client
        self.unnamed = directory
        self.directory = directory
        self.secret = secrets.token_hex(32).encode()  # what this gateway offers if none
        self._named_with: bytes | None = None

    async def get(self) -> TenantDirectory:
        if not self.unnamed.needs_secret:
            return self.directory
        secret = await naming_secret(self.client, self.secret)
        if secret != self._named_with:
            self.directory = self.unnamed.named(secret)
            self.secret = self._named_with = secret
            log.info("api_key_tenants", tenants=[t.id for _, t in self.directory.by_hash or ()],
                     order="FERRY_API_KEYS")
        return self.directory
