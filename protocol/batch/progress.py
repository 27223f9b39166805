"""One batch's progress as a batcher drives it: the lease, the feeding cursor, the lines
in flight, results recorded exactly once, and the finalization.

Every write here is a script fenced by the batch's lease (the keys of one batch only, so
one Redis Cluster slot): a batcher that lost its lease (it stalled past the lease and
another took over) gets ``LeaseLost`` and writes nothing more. Results are recorded at
most once per line whoever records them: ``RECORD_LUA`` sets a line's field only if
neither result hash has it, and moves the counters in the same script. With the
deterministic request id of each line (``protocol.batch.records.line_request_id``: enqueueing it
again is refused while its job exists), that is what makes "every line gets exactly one
result" hold across a batcher killed at any point, two batchers racing, and a restart of
Redis with an append-only file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.batch.store import TRANSITION_LUA
from protocol.keys import Keys
from protocol.store import as_str

_LEASE_HELD = "redis.call('GET', KEYS[2]) == ARGV[1]"

# KEYS: batch, lease, inflight. ARGV: batcher, expected fed, new fed, line indexes...
# Moves the feeding cursor and marks the lines about to be enqueued as in flight; 'moved'
# when the cursor is not where this batcher thought (it re-reads), 'status' once the batch
# stopped running (cancel, expiry).
FEED_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 'status' end
if tonumber(redis.call('HGET', KEYS[1], 'fed') or '0') ~= tonumber(ARGV[2]) then
  return 'moved'
end
for i = 4, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
redis.call('HSET', KEYS[1], 'fed', ARGV[3])
return 'ok'
"""

# KEYS: batch, lease, output, errors, inflight. ARGV: batcher, then per line: index,
# 'output' or 'errors', the result line, prompt tokens, completion tokens, prompt tokens
# served from the prefix cache. A line that already has a result keeps it. Returns how
# many were recorded now, or 'lost'.
RECORD_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
local recorded = 0
for i = 2, #ARGV, 6 do
  local index = ARGV[i]
  if redis.call('HEXISTS', KEYS[3], index) == 0 and redis.call('HEXISTS', KEYS[4], index) == 0 then
    local ok = ARGV[i + 1] == 'output'
    redis.call('HSET', ok and KEYS[3] or KEYS[4], index, ARGV[i + 2])
    redis.call('HINCRBY', KEYS[1], ok and 'completed' or 'failed', 1)
    redis.call('HINCRBY', KEYS[1], ok and 'output_bytes' or 'error_bytes', #ARGV[i + 2] + 1)
    redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[i + 3])
    redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[i + 4])
    redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[i + 5])
    recorded = recorded + 1
  end
  redis.call('SREM', KEYS[5], index)
end
return recorded
"""

# KEYS: batch, lease. ARGV: batcher, output file id, error file id (candidates). The ids
# a finished batch will name, chosen once: a retried finalization reuses them.
RESERVE_FILES_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
if tonumber(redis.call('HGET', KEYS[1], 'completed') or '0') > 0 then
  redis.call('HSETNX', KEYS[1], 'output_file_id', ARGV[2])
end
if tonumber(redis.call('HGET', KEYS[1], 'failed') or '0') > 0 then
  redis.call('HSETNX', KEYS[1], 'error_file_id', ARGV[3])
end
return 'ok'
"""

# KEYS: batch, lease, output, errors, inflight. ARGV: batcher, allowed statuses, final
# status, its timestamp field, now, ttl of the record, ttl of the results.
FINALIZE_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if not string.find(ARGV[2], ',' .. status .. ',', 1, true) then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[3], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[7])
redis.call('EXPIRE', KEYS[4], ARGV[7])
redis.call('DEL', KEYS[5])
return 'ok'
"""

# KEYS: batch, lease. ARGV: batcher, field, value, ... (what validation learns).
UPDATE_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 'ok'
"""

# KEYS: batch, lease. ARGV: batcher. One more unexpected failure of the batch's run,
# counted in the record so that every batcher, after any restart, sees the same count.
FAILURE_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
return tostring(redis.call('HINCRBY', KEYS[1], 'failures', 1))
"""

# KEYS: batch, lease. ARGV: batcher. A batch given up: it has as many requests as lines
# it reported (each non-blank line got one result, or as many as could be reported).
SETTLE_TOTAL_LUA = f"""
if not ({_LEASE_HELD}) then return 'lost' end
local done = tonumber(redis.call('HGET', KEYS[1], 'completed') or '0') +
  tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
redis.call('HSET', KEYS[1], 'total', done)
return 'ok'
"""

# KEYS: lease. ARGV: batcher, ttl ms. Take a free lease, or one's own again (a batcher
# restarted under the same id after its process was reaped: ``ferry up``).
ACQUIRE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: batcher, ttl ms. Renew (or release, ttl 0) only one's own lease.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) <= 0 then redis.call('DEL', KEYS[1]) else
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


class LeaseLost(Exception):
    """This batcher no longer holds the batch's lease: stop driving it, write nothing."""


@dataclass(frozen=True)
class LineResult:
    """One line's result: the JSON line of the output (``ok``) or the error file."""

    index: int
    ok: bool
    line: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of its prompt tokens, served from the prefix cache


class BatchProgress:
    """The fenced operations of one batch for one batcher (``batcher`` is its lease value)."""

    def __init__(self, redis: Any, keys: Keys, batch_id: str, batcher: str,
                 lease_ms: int) -> None:
        self.redis = redis
        self.keys = keys
        self.batch_id = batch_id
        self.batcher = batcher
        self.lease_ms = lease_ms
        self._batch = keys.batch(batch_id)
        self._lease = keys.batch_lease(batch_id)
        self._output = keys.batch_output(batch_id)
        self._errors = keys.batch_errors(batch_id)
        self._inflight = keys.batch_inflight(batch_id)

    async def _fenced(self, script: str, keys: Sequence[str], *args: Any) -> str:
        out = as_str(await self.redis.eval(script, len(keys), *keys, self.batcher, *args))
        if out == "lost":
            raise LeaseLost(self.batch_id)
        return out

    async def acquire(self) -> bool:
        """Take the lease if nobody else holds it."""
        return bool(int(await self.redis.eval(ACQUIRE_LUA, 1, self._lease, self.batcher,
                                              self.lease_ms)))

    async def renew(self) -> None:
        """Extend the lease; ``LeaseLost`` if another batcher holds it now."""
        if not int(await self.redis.eval(RENEW_LUA, 1, self._lease, self.batcher,
                                         self.lease_ms)):
            raise LeaseLost(self.batch_id)

    async def release(self) -> None:
        await self.redis.eval(RENEW_LUA, 1, self._lease, self.batcher, 0)

    async def feed(self, fed: int, new_fed: int, indexes: Sequence[int]) -> str:
        """Move the cursor from ``fed`` to ``new_fed``, ``indexes`` in flight: 'ok',
        'moved' (the cursor is elsewhere) or 'status' (the batch stopped running)."""
        return await self._fenced(FEED_LUA, [self._batch, self._lease, self._inflight],
                                  fed, new_fed, *indexes)

    async def record(self, results: Sequence[LineResult]) -> int:
        """Record each line's result unless it has one; returns how many were new."""
        if not results:
            return 0
        args = [x for r in results for x in (r.index, "output" if r.ok else "errors", r.line,
                                             r.prompt_tokens, r.completion_tokens,
                                             r.cached_tokens)]
        keys = [self._batch, self._lease, self._output, self._errors, self._inflight]
        return int(await self._fenced(RECORD_LUA, keys, *args))

    async def inflight(self) -> list[int]:
        return sorted(int(i) for i in await self.redis.smembers(self._inflight))

    async def recorded(self, indexes: Sequence[int]) -> set[int]:
        """Which of ``indexes`` already have a result."""
        pipe = self.redis.pipeline(transaction=False)
        for index in indexes:
            pipe.hexists(self._output, index)
            pipe.hexists(self._errors, index)
        found = await pipe.execute()
        return {i for k, i in enumerate(indexes) if found[2 * k] or found[2 * k + 1]}

    async def transition(self, allowed: Sequence[str], status: str, now: int,
                         **fields: Any) -> str:
        """As ``BatchStore.transition``, fenced; 'ok' or the status found."""
        extra = [x for name, value in fields.items() for x in (name, str(value))]
        return await self._fenced(TRANSITION_LUA, [self._batch, self._lease],
                                  f",{','.join(allowed)},", status, f"{status}_at", now, *extra)

    async def update(self, **fields: Any) -> None:
        """Set record fields (``total``, ``lines``, ``model``, ``errors``)."""
        args = [x for name, value in fields.items() for x in (
            name, json.dumps(value) if isinstance(value, dict | list) else str(value))]
        await self._fenced(UPDATE_LUA, [self._batch, self._lease], *args)

    async def count_failure(self) -> int:
        """One more unexpected failure of this batch's run; the count so far."""
        return int(await self._fenced(FAILURE_LUA, [self._batch, self._lease]))

    async def settle_total(self) -> None:
        """``total`` = the results recorded (a batch given up: ``BatchRun.give_up``)."""
        await self._fenced(SETTLE_TOTAL_LUA, [self._batch, self._lease])

    async def reserve_files(self, output_id: str, error_id: str) -> None:
        await self._fenced(RESERVE_FILES_LUA, [self._batch, self._lease], output_id, error_id)

    async def finalize(self, allowed: Sequence[str], status: str, now: int, record_ttl_s: int,
                       results_ttl_s: int) -> str:
        keys = [self._batch, self._lease, self._output, self._errors, self._inflight]
        return await self._fenced(FINALIZE_LUA, keys, f",{','.join(allowed)},", status,
                                  f"{status}_at", now, record_ttl_s, results_ttl_s)
