"""The tokenizer requests' queue in Redis: one list per tenant, served round robin, and the
bells that wake the workers' responder threads.

One list for every caller let one tenant's flood of large ``/tokenize`` calls queue ahead
of everyone else's (another tenant's p50 went from 0.02 s to 9.6 s). So each tenant has a
list of its own and the responders take one call per tenant in turn:

* ``{base}:q:{tenant}`` (LIST): the tenant's waiting calls, oldest first; an item is the
  call's cost (its msgpack size, ``%010d``) and then the msgpack ``TokenizerRequest``;
* ``{base}:ready`` (ZSET): the tenants with waiting calls, scored by their turn, so the
  lowest is served next; a tenant served goes to the back (``{base}:turn``, the last turn
  given, is a counter);
* ``{base}`` (LIST): one bell per call pushed, which every responder thread BLPOPs (an item
  that is not a bell is a call an older producer pushed: it is answered as it is);
* ``{base}:small`` (LIST): one bell per small call (at most ``SMALL_BYTES``), for the
  threads that take only small calls, so a short call is not stuck behind long ones.

``base`` is ``Keys.tokenizer_requests(model)``: every key carries the model's hash tag, so
the scripts stay on one slot of a Redis Cluster. Every key has a TTL, refreshed by each
push. A bell can outlive its call (taken by another thread, or taken back by the gateway):
the pop then finds nothing, which costs one script call; a responder also pops after each
idle poll, so a call whose bell was lost (a worker killed between the two) waits one poll.
"""

from __future__ import annotations

from typing import Any

BELL = b"1"
SMALL_BYTES = 16 * 1024
"""Calls up to this size (the msgpack request: a prompt of a few thousand characters) ring
the small bell too; a worker keeps one responder thread for them."""
_HEADER = 10

# KEYS: queue, ready, turn, bell, small bell. ARGV: tenant, item, small (0/1), ttl.
PUSH_LUA = """
redis.call('RPUSH', KEYS[1], ARGV[2])
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
end
redis.call('RPUSH', KEYS[4], '1')
if ARGV[3] == '1' then redis.call('RPUSH', KEYS[5], '1') end
for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# KEYS: ready, turn. ARGV: the queues' prefix, the largest cost taken (-1: any). Returns the
# item (header included) of the first tenant in turn whose next call fits, or false.
POP_LUA = """
local most = tonumber(ARGV[2])
for _, tenant in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local queue = ARGV[1] .. tenant
  local head = redis.call('LINDEX', queue, 0)
  if not head then
    redis.call('ZREM', KEYS[1], tenant)
  elseif most < 0 or tonumber(string.sub(head, 1, 10)) <= most then
    redis.call('LPOP', queue)
    if redis.call('LLEN', queue) > 0 then
      redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), tenant)
    else
      redis.call('ZREM', KEYS[1], tenant)
    end
    return head
  end
end
return false
"""

# KEYS: queue, ready. ARGV: the item, its tenant. A call nobody answered in time, taken
# back off its list (and its tenant out of turn if that was its last).
TAKE_BACK_LUA = """
local removed = redis.call('LREM', KEYS[1], 1, ARGV[1])
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('ZREM', KEYS[2], ARGV[2]) end
return removed
"""


def queue_key(base: str, tenant: str) -> str:
    """LIST: one tenant's waiting calls (``base``: ``Keys.tokenizer_requests(model)``)."""
    return f"{base}:q:{tenant}"


def ready_key(base: str) -> str:
    """ZSET: the tenants with waiting calls, by turn."""
    return f"{base}:ready"


def turn_key(base: str) -> str:
    """STRING: the last turn given (a counter)."""
    return f"{base}:turn"


def small_bell_key(base: str) -> str:
    """LIST: one bell per small call."""
    return f"{base}:small"


def item(payload: bytes) -> bytes:
    """A queue item: the call's cost (its size), then the msgpack request."""
    return b"%010d" % len(payload) + payload


def payload_of(raw: bytes) -> bytes:
    """The msgpack request of a queue item."""
    return raw[_HEADER:]


def push_args(base: str, tenant: str, entry: bytes, ttl_s: int) -> tuple[list[str], list[Any]]:
    """``PUSH_LUA``'s keys and arguments for one call (``entry``: ``item(payload)``)."""
    small = len(entry) - _HEADER <= SMALL_BYTES
    return ([queue_key(base, tenant), ready_key(base), turn_key(base), base,
             small_bell_key(base)], [tenant, entry, int(small), ttl_s])


def pop_args(base: str, small_only: bool) -> tuple[list[str], list[Any]]:
    """``POP_LUA``'s keys and arguments: any call, or only a small one."""
    return [ready_key(base), turn_key(base)], [f"{base}:q:", SMALL_BYTES if small_only else -1]
