"""Tenant quotas, counted in Redis so that every gateway process agrees.

* ``max_priority``: the lowest ``priority`` (the highest lane) a tenant may ask for;
* ``tokens_per_minute``: the token budget (``protocol.tenants.fair.cost_hint``: the prompt plus
  every candidate's ``max_tokens``) admitted per clock minute, one counter per tenant and
  minute (``INCRBY`` under a script, so concurrent gateways cannot overshoot together);
* ``max_concurrent``: requests admitted and not yet ended. A ZSET per tenant holds the
  request ids admitted, scored by when they expire at the latest; nobody has to remember
  to decrement it: when it looks full, the gateway reads the members' job hashes and the
  admission script drops those whose job has ended (or expired, or whose worker died and
  the job was finished by another), so a crash, cancel or expiry anywhere frees the slot.

Admission is one script per quota that cleans, counts and adds, so a burst on several
gateways admits exactly the limit. A member admitted a moment ago has no job hash yet (it
is enqueued after admission): it counts until ``ENQUEUE_GRACE_S`` after its admission
(dropping it as "expired" let 40 simultaneous requests through a limit of 3 in 12), and
the script drops a member only if its score is still the one read (re-admitted: kept).

Tokenizer calls (``/tokenize``, ``/detokenize``, ``/tokenizer_info``) have a quota of their
own, ``tokenizer_max_inflight`` (a gateway setting; a tenant's ``max_concurrent`` if lower):
the calls of one tenant in flight, fleet-wide, in a ZSET per tenant scored by each call's
deadline (``TOKENIZER_LUA``: clean, count, add), released when the call ends, so a gateway
that dies mid-call frees its slots at their deadlines. It bounds how many of a tenant's
calls Redis holds (its list of waiting calls and their replies) and how many the workers'
responders answer for it at once; past it, a 429.

A request that exceeds a quota by itself (a ``priority`` the tenant may not use, more
prompts than ``max_concurrent``, a budget over ``tokens_per_minute``) can never be
admitted: 403 ``permission_error`` naming the parameter, never retried by SDKs. A
request over what is left now: 429 with ``Retry-After``. Both name the quota.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import APIError
from gateway.tenancy.tenants import Tenant
from protocol.aclient import AsyncFerryClient
from protocol.keys import Keys
from protocol.models import TERMINAL_STATES, GenerateRequest
from protocol.tenants.fair import cost_hint

ENQUEUE_GRACE_S = 60.0
"""How long an admitted request without a job hash still counts as in flight: it is being
enqueued (a gateway that died in between frees its slot after this long)."""

# KEYS: the minute's counter. ARGV: cost, limit, ttl. Returns the count before, or -1
# when it was admitted.
TPM_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return used end
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return -1
"""

# KEYS: the in-flight ZSET. ARGV: now, limit, expiry, k, k ids, then (member, score) pairs
# seen ended (dropped if their score is unchanged). Returns the count in flight, or -1
# when the ids were added.
CONCURRENT_LUA = """
local now, k = tonumber(ARGV[1]), tonumber(ARGV[4])
for i = 5 + k, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n + k > tonumber(ARGV[2]) then return n end
for i = 5, 4 + k do redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - now) + 60)
return -1
"""


# KEYS: the tenant's tokenizer ZSET. ARGV: now, limit, the call's id, its deadline. Returns
# the calls in flight, or -1 when this one was added.
TOKENIZER_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then return n end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
local ttl = math.ceil(tonumber(ARGV[4]) - tonumber(ARGV[1])) + 1
redis.call('EXPIRE', KEYS[1], ttl, 'NX')
redis.call('EXPIRE', KEYS[1], ttl, 'GT')
return -1
"""


def tokenizer_key(keys: Keys, tenant: str) -> str:
    """ZSET: the tenant's tokenizer calls in flight (reply ids), scored by their deadline."""
    return f"{keys.prefix}:tenant:{{{tenant}}}:tokenizer"


def inflight_key(keys: Keys, tenant: str) -> str:
    """ZSET: the tenant's admitted request ids (scoped), scored by their latest expiry."""
    return f"{keys.prefix}:tenant:{{{tenant}}}:inflight"


def tpm_key(keys: Keys, tenant: str, minute: int) -> str:
    """STRING: tokens admitted for the tenant in one clock minute (TTL two minutes)."""
    return f"{keys.prefix}:tenant:{{{tenant}}}:tpm:{minute}"


def _over(quota: str, message: str, retry_after_s: int) -> APIError:
    return APIError(429, f"quota {quota}: {message}", code=f"quota_{quota}",
                    headers={"Retry-After": str(max(1, retry_after_s))})


def _never(quota: str, param: str, message: str) -> APIError:
    """A request this tenant may never make: retrying cannot help, so no 429."""
    return APIError(403, f"quota {quota}: {message}", param=param, type_="permission_error",
                    code=f"quota_{quota}")


class Quotas:
    """The quota checks of one gateway, on its async client."""

    def __init__(self, client: AsyncFerryClient, job_ttl_s: int, retry_after_s: int) -> None:
        self.client = client
        self.keys = client.keys
        self.job_ttl_s = job_ttl_s
        self.retry_after_s = retry_after_s

    async def admit(self, tenant: Tenant, requests: list[GenerateRequest]) -> None:
        """403 for requests no wait can admit, 429 naming the first quota they would exceed
        now; otherwise count them (tokens and concurrency) as admitted."""
        cost = sum(cost_hint(r) for r in requests)
        _check_never(tenant, requests, cost)
        if tenant.tokens_per_minute is not None:
            await self._tokens(tenant, cost)
        if tenant.max_concurrent is not None:
            await self._concurrent(tenant, [r.request_id for r in requests])

    async def release(self, tenant: Tenant, request_ids: list[str]) -> None:
        """Give back the concurrency of requests that were admitted but not enqueued."""
        if tenant.max_concurrent is not None and request_ids:
            await self.client.redis.zrem(inflight_key(self.keys, tenant.id), *request_ids)

    async def admit_tokenizer(self, tenant: Tenant, call_id: str, deadline: float,
                              limit: int) -> None:
        """Count one tokenizer call of ``tenant`` as in flight until ``deadline`` (unix
        time) or ``release_tokenizer``; 429 when ``limit`` (or the tenant's
        ``max_concurrent``, if lower) are in flight already."""
        if tenant.max_concurrent is not None:
            limit = min(limit, tenant.max_concurrent)
        found = int(await self._eval(TOKENIZER_LUA, [tokenizer_key(self.keys, tenant.id)],
                                     [repr(time.time()), limit, call_id, repr(deadline)]))
        if found >= 0:
            raise _over("tokenizer_inflight", f"{found} tokenizer calls of this tenant are "
                        f"in flight (limit {limit})", self.retry_after_s)

    async def release_tokenizer(self, tenant: Tenant, call_id: str) -> None:
        await self.client.redis.zrem(tokenizer_key(self.keys, tenant.id), call_id)

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
        found = await self._add(key, limit, ids, [])
        if found >= 0:  # looks full: drop what has ended, then try again
            ended = await self._ended(key)
            if ended:
                found = await self._add(key, limit, ids, ended)
        if found >= 0:
            raise _over("max_concurrent", f"{found} requests of this tenant are in flight "
                        f"(limit {limit})", self.retry_after_s)

    async def _add(self, key: str, limit: int, ids: list[str], ended: list[Any]) -> int:
        now = time.time()
        return int(await self._eval(CONCURRENT_LUA, [key], [
            repr(now), limit, repr(now + self.job_ttl_s), len(ids), *ids, *ended]))

    async def _ended(self, key: str) -> list[Any]:
        """(member, score) pairs, flat, of the members whose job has ended or expired; a
        member without a job hash admitted under ``ENQUEUE_GRACE_S`` ago is being enqueued."""
        redis = self.client.redis
        members = [(_text(m), float(score))
                   for m, score in await redis.zrange(key, 0, -1, withscores=True)]
        if not members:
            return []
        pipe = redis.pipeline(transaction=False)
        for rid, _score in members:
            pipe.hget(self.keys.job(rid), "state")
        states = await pipe.execute()
        now = time.time()
        ended: list[Any] = []
        for (rid, score), state in zip(members, states, strict=True):
            admitted_at = score - self.job_ttl_s
            if state is None and now - admitted_at < ENQUEUE_GRACE_S:
                continue
            if state is None or _text(state) in TERMINAL_STATES:
                ended += [rid, repr(score)]
        return ended

    async def _eval(self, script: str, keys: list[str], argv: list[Any]) -> Any:
        return await self.client.redis.eval(script, len(keys), *keys, *argv)  # type: ignore[misc]


def _check_never(tenant: Tenant, requests: list[GenerateRequest], cost: int) -> None:
    """403 for what no wait can admit: a lane the tenant may not use, more prompts than its
    concurrency, a budget over its minute's tokens."""
    if tenant.max_priority is not None:
        low = min(r.priority for r in requests)
        if low < tenant.max_priority:
            raise _never("max_priority", "priority", f"priority {low} is higher than this "
                         f"tenant may use (lowest allowed: {tenant.max_priority})")
    if tenant.max_concurrent is not None and len(requests) > tenant.max_concurrent:
        raise _never("max_concurrent", "prompt", f"{len(requests)} prompts in one request "
                     f"exceed this tenant's {tenant.max_concurrent} requests in flight")
    if tenant.tokens_per_minute is not None and cost > tenant.tokens_per_minute:
        raise _never("tokens_per_minute", "max_tokens", f"this request may use {cost} "
                     f"tokens (prompt and max_tokens x candidates), more than this tenant's "
                     f"{tenant.tokens_per_minute} per minute")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
