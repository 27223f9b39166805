"""Tenant quotas, counted in Redis so that every gateway process agrees.

* ``max_priority``: the lowest ``priority`` (the highest lane) a tenant may ask for;
* ``tokens_per_minute``: the token budget (``protocol.fair.cost_hint``: the prompt plus
  every candidate's ``max_tokens``) admitted per clock minute, one counter per tenant and
  minute (``INCRBY`` under a script, so concurrent gateways cannot overshoot together);
* ``max_concurrent``: requests admitted and not yet ended. A ZSET per tenant holds the
  request ids admitted, scored by when they expire at the latest; nobody has to remember
  to decrement it: when it looks full, the members whose job has ended (or expired, or
  whose worker died and the job was finished by another) are swept out by reading their
  job hashes, so a crash, cancel or expiry anywhere frees the slot.

Over a quota: 429 with ``Retry-After`` and a message naming the quota.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import APIError
from gateway.tenancy.tenants import Tenant
from protocol.aclient import AsyncFerryClient
from protocol.fair import cost_hint
from protocol.keys import Keys
from protocol.models import TERMINAL_STATES, GenerateRequest

# KEYS: the minute's counter. ARGV: cost, limit, ttl. Returns the count before, or -1
# when it was admitted.
TPM_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) and used > 0 then return used end
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return -1
"""

# KEYS: the in-flight ZSET. ARGV: now, limit, expiry, ids... Returns the count in flight,
# or -1 when the ids were added.
CONCURRENT_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local n = redis.call('ZCARD', KEYS[1])
if n + #ARGV - 3 > tonumber(ARGV[2]) then return n end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - tonumber(ARGV[1])) + 60)
return -1
"""


def inflight_key(keys: Keys, tenant: str) -> str:
    """ZSET: the tenant's admitted request ids (scoped), scored by their latest expiry."""
    return f"{keys.prefix}:tenant:{{{tenant}}}:inflight"


def tpm_key(keys: Keys, tenant: str, minute: int) -> str:
    """STRING: tokens admitted for the tenant in one clock minute (TTL two minutes)."""
    return f"{keys.prefix}:tenant:{{{tenant}}}:tpm:{minute}"


def _over(quota: str, message: str, retry_after_s: int) -> APIError:
    return APIError(429, f"quota {quota}: {message}", code=f"quota_{quota}",
                    headers={"Retry-After": str(max(1, retry_after_s))})


class Quotas:
    """The quota checks of one gateway, on its async client."""

    def __init__(self, client: AsyncFerryClient, job_ttl_s: int, retry_after_s: int) -> None:
        self.client = client
        self.keys = client.keys
        self.job_ttl_s = job_ttl_s
        self.retry_after_s = retry_after_s

    async def admit(self, tenant: Tenant, requests: list[GenerateRequest]) -> None:
        """Raise 429 naming the first quota the requests would exceed; otherwise count
        them (tokens and concurrency) as admitted."""
        if tenant.max_priority is not None:
            low = min(r.priority for r in requests)
            if low < tenant.max_priority:
                raise _over("max_priority", f"priority {low} is higher than this tenant may "
                            f"use (lowest allowed: {tenant.max_priority})", self.retry_after_s)
        if tenant.tokens_per_minute is not None:
            await self._tokens(tenant, sum(cost_hint(r) for r in requests))
        if tenant.max_concurrent is not None:
            await self._concurrent(tenant, [r.request_id for r in requests])

    async def release(self, tenant: Tenant, request_ids: list[str]) -> None:
        """Give back the concurrency of requests that were admitted but not enqueued."""
        if tenant.max_concurrent is not None and request_ids:
            await self.client.redis.zrem(inflight_key(self.keys, tenant.id), *request_ids)

    async def _tokens(self, tenant: Tenant, cost: int) -> None:
        now = time.time()
        minute = int(now // 60)
        limit = tenant.tokens_per_minute or 0
        used = int(await self._eval(TPM_LUA, [tpm_key(self.keys, tenant.id, minute)],
                                    [cost, limit, 120]))
        if used >= 0:
            raise _over("tokens_per_minute", f"{used} of {limit} tokens used this minute; "
                        f"this request needs {cost}", int(60 - now % 60) + 1)

    async def _concurrent(self, tenant: Tenant, ids: list[str]) -> None:
        limit = tenant.max_concurrent or 0
        key = inflight_key(self.keys, tenant.id)
        for attempt in range(2):
            now = time.time()
            found = int(await self._eval(CONCURRENT_LUA, [key],
                                         [now, limit, now + self.job_ttl_s, *ids]))
            if found < 0:
                return
            if attempt == 0:
                await self._sweep(key)
        raise _over("max_concurrent", f"{found} requests of this tenant are in flight "
                    f"(limit {limit})", self.retry_after_s)

    async def _sweep(self, key: str) -> None:
        """Drop the members whose job has ended or expired."""
        redis = self.client.redis
        members = [m.decode() if isinstance(m, bytes) else str(m)
                   for m in await redis.zrange(key, 0, -1)]
        if not members:
            return
        pipe = redis.pipeline(transaction=False)
        for rid in members:
            pipe.hget(self.keys.job(rid), "state")
        states = await pipe.execute()
        ended = [rid for rid, state in zip(members, states, strict=True)
                 if state is None or _text(state) in TERMINAL_STATES]
        if ended:
            await redis.zrem(key, *ended)

    async def _eval(self, script: str, keys: list[str], argv: list[Any]) -> Any:
        return await self.client.redis.eval(script, len(keys), *keys, *argv)  # type: ignore[misc]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
