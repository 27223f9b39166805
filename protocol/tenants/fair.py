"""The fair backlog: a weighted fair share of every lane for every tenant, kept in Redis.

Producers do not XADD a request to its lane stream: they push it onto its tenant's
*backlog* for that lane (a LIST), and register the tenant in the lane's *ready* set (a
ZSET scored by the tenant's virtual token counter, as in VTC: "Fairness in Serving Large
Language Models", OSDI 2024). A worker pulls through one script (``PULL_LUA``) that picks
the ready tenant with the lowest counter, moves the head of its backlog into the lane
stream and XREADGROUPs it for the calling consumer, all atomically: from then on the
entry is an ordinary stream entry (PEL, leases, reaper and takeover are unchanged). The
counter is charged the request's prompt tokens (``prompt_hint``) divided by its tenant's
weight; the worker charges the rest of what it really served (the generated tokens, and
any error in the prompt estimate) when the request ends (``CHARGE_LUA``). Charging the
whole budget (prompt + ``max_tokens``) at the pull instead would make a late tenant pay
for tokens not yet served and alternate with a flooding tenant's pulls, where VTC serves
it at once. A tenant (re)entering the ready set starts at
max(its counter, the lowest ready counter) (or the floor the last tenant left at, if
none is ready; a thousandth of a token under it, so it wins a tie), so idle time banks no
credit: a late tenant with little work is served
at once, a flooding one cannot starve the others, and nothing idles while anyone waits.

Every worker pulls from the same keys, so the shares hold fleet-wide, not per worker. The
keys of one lane stream share its hash tag (``{stream}:fair:*``), so on a Redis Cluster
each shard keeps its own counters (see ``docs/tenants.md`` for how that composes).

Entries that an older producer XADDed straight into the lane stream are *adopted* by the
next pull: read, acknowledged, deleted, and pushed onto the default tenant's backlog,
tagged with their original entry id (``origin``), which ``START_JOB_LUA`` accepts as the
job's own entry. They are then served as the default tenant, in turn.

A backlog item is a fixed header, ``%012d`` cost then the origin id padded to 48
characters, followed by the msgpack request.
"""

from __future__ import annotations

import math
from typing import Any

from protocol.models import GenerateRequest
from protocol.tenants.ids import DEFAULT_TENANT

MIN_WEIGHT = 1e-3
MAX_WEIGHT = 1e3
"""The weights a tenant may have. A weight divides every charge: one near zero (``1e-320``)
or infinite drove a counter, and from it the lane's floor, to infinity, where every tenant
ties for good. The pull clamps a weight it finds outside this range (an older producer's)."""

PREFER_SCAN = 16
PREFER_TENANTS = 32
"""How far a pull looks past requests offered to another worker (``protocol/affinity``):
items per tenant's backlog, tenants in counter order. Past that it takes nothing this
pass; the preferred worker, or any worker once the steal time passes, does."""

DIRECT_COST = 64
"""What an adopted (directly XADDed) entry is charged up front; corrected when it ends."""

COST_FIELD = "cost"
ORIGIN_FIELD = "origin"
_HEADER = 12 + 48


def backlog(stream: str, tenant: str) -> str:
    """LIST: one tenant's requests waiting for this lane stream, oldest first."""
    return f"{stream}:fair:q:{tenant}"


def ready(stream: str) -> str:
    """ZSET: tenants with a non-empty backlog for this lane, scored by their counter."""
    return f"{stream}:fair:ready"


def counters(stream: str) -> str:
    """HASH: tenant -> virtual token counter (``:floor``: where the last leaver stood)."""
    return f"{stream}:fair:vtc"


def weights(stream: str) -> str:
    """HASH: tenant -> weight, as its latest producer declared it."""
    return f"{stream}:fair:w"


def bell(stream: str) -> str:
    """STREAM: one entry per request waiting in this lane's backlogs (the pull trims one
    per request it takes): its length is the backlog's depth (what KEDA's ``streamLength``
    and ``queue_lags`` read), and every push wakes the workers blocked on it."""
    return f"{stream}:fair:bell"


def fair_keys(stream: str) -> list[str]:
    """The keys of one lane's fair backlog that every script gets, in script order."""
    return [ready(stream), counters(stream), weights(stream), bell(stream)]


def check_weight(weight: float) -> float:
    """``weight`` as a float, or ValueError unless it is finite and within
    [``MIN_WEIGHT``, ``MAX_WEIGHT``]."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            MIN_WEIGHT <= weight <= MAX_WEIGHT):  # NaN fails every comparison
        raise ValueError(f"weight: {weight!r} must be a number from {MIN_WEIGHT:g} to "
                         f"{MAX_WEIGHT:g}")
    return float(weight)


def prompt_hint(request: GenerateRequest) -> int:
    """The prompt's tokens, known before any tokenizer runs: its token ids, or about four
    characters a token. What the fair pull charges (the prompt is served at once, by the
    prefill); the generated tokens are charged when they have been served."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.prompt is not None:
        prompt = math.ceil(len(request.prompt) / 4)
    else:
        prompt = math.ceil(sum(len(m.content) for m in request.messages or []) / 4)
    return max(1, prompt)


def cost_hint(request: GenerateRequest) -> int:
    """The tokens a request may cost at most: the prompt plus every candidate's
    ``max_tokens`` (what the ``tokens_per_minute`` quota counts at admission)."""
    return prompt_hint(request) + request.params.max_tokens * request.params.num_candidates


# Shared Lua: a weight as the scripts use it (clamped: a bad one an older producer wrote
# must not make a counter infinite), a counter that is not finite read as 0 (one an older
# version let grow infinite heals when its tenant re-enters), and the lift rule.
_LIFT = f"""
local function finite(x)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return 0 end
  return x
end
local function weight_of(w, tenant)
  local x = tonumber(redis.call('HGET', w, tenant) or '1')
  if x == nil or x ~= x then return 1 end
  return math.min(math.max(x, {MIN_WEIGHT!r}), {MAX_WEIGHT!r})
end
""" + """
local function lift(ready, vtc, tenant)
  if redis.call('ZSCORE', ready, tenant) then return end
  local c = finite(tonumber(redis.call('HGET', vtc, tenant) or '0'))
  local low = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  local floor = finite(tonumber(low[2] or redis.call('HGET', vtc, ':floor') or '0'))
  -- just under the floor: an arriving tenant goes first among equals (a tie would go
  -- to the smaller id), for a thousandth of a token of credit
  if floor > c then c = floor - 0.001 end
  redis.call('HSET', vtc, tenant, c)
  redis.call('ZADD', ready, c, tenant)
end
"""

# The push, as a Lua fragment: KEYS[a..a+4] = ready, vtc, weights, bell, backlog;
# ARGV[b..b+3] = tenant, weight, cost, msgpack request.
PUSH_BODY = _LIFT + """
local function push(a, b)
  local tenant = ARGV[b]
  redis.call('RPUSH', KEYS[a + 4], string.format('%012d%-48s', tonumber(ARGV[b + 2]), '')
             .. ARGV[b + 3])
  redis.call('HSET', KEYS[a + 2], tenant, ARGV[b + 1])
  lift(KEYS[a], KEYS[a + 1], tenant)
  redis.call('XADD', KEYS[a + 3], '*', 't', tenant)
end
"""

PUSH_LUA = PUSH_BODY + "push(1, 1)\nreturn 1\n"


def push_args(keys_stream: str, request: GenerateRequest, weight: float,
              payload: bytes) -> tuple[list[str], list[Any]]:
    """(KEYS, ARGV) of ``PUSH_LUA`` (or of ``push(a, b)`` inside a bigger script)."""
    tenant = request.tenant or DEFAULT_TENANT
    return ([*fair_keys(keys_stream), backlog(keys_stream, tenant)],
            [tenant, repr(check_weight(weight)), prompt_hint(request), payload])


# KEYS: stream, ready, vtc, weights, bell. ARGV: group, consumer, count, direct cost,
# default tenant, backlog key prefix. Returns {bell last id, stream last id, ms until the
# soonest item passed over for another worker may be taken (-1: none), id, fields, ...}.
PULL_LUA = _LIFT + f"""
local SCAN, TENANTS = {PREFER_SCAN}, {PREFER_TENANTS}
""" + """
local stream, ready, vtc, w = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, me, prefix, dflt = ARGV[1], ARGV[2], ARGV[6], ARGV[5]
local out, taken = {}, 0
local adopted = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', 100, 'STREAMS',
                           stream, '>')
if adopted then
  for _, e in ipairs(adopted[1][2]) do
    local id, f = e[1], e[2]
    local data
    for i = 1, #f, 2 do if f[i] == 'data' then data = f[i + 1] end end
    if data then
      redis.call('XACK', stream, group, id)
      redis.call('XDEL', stream, id)
      redis.call('RPUSH', prefix .. dflt, string.format('%012d%-48s', tonumber(ARGV[4]), id)
                 .. data)
      lift(ready, vtc, dflt)
      redis.call('XADD', KEYS[5], '*', 't', dflt)
    else  -- no request in it: the caller dead-letters it
      out[#out + 1] = id
      out[#out + 1] = f
    end
  end
end
-- a preference mark (protocol/affinity/mark.py) offers an item to one worker until its
-- steal time: another worker looks past it, at most SCAN items deep in at most TENANTS
-- tenants in counter order, and reports how soon the first it passed becomes free
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local soonest = -1
local function pick(tenant)
  local items = redis.call('LRANGE', prefix .. tenant, 0, SCAN - 1)
  for i, item in ipairs(items) do
    if string.byte(item, 61) ~= 64 then return i - 1, item, string.sub(item, 61), '', '' end
    local nl = string.find(item, '\\n', 88, true)
    local steal, who = tonumber(string.sub(item, 75, 87)), string.sub(item, 88, nl - 1)
    if who == me or steal <= now then
      return i - 1, item, string.sub(item, nl + 1), who, string.sub(item, 62, 74)
    end
    if soonest < 0 or steal - now < soonest then soonest = steal - now end
  end
  return nil, #items
end
for n = 1, tonumber(ARGV[3]) do
  local lows = redis.call('ZRANGE', ready, 0, TENANTS - 1, 'WITHSCORES')
  if not lows[1] then break end
  local tenant, c, at, item, data, who, marked
  for j = 1, #lows, 2 do
    local found
    found, item, data, who, marked = pick(lows[j])
    if found then tenant, c, at = lows[j], tonumber(lows[j + 1]), found; break end
    if item == 0 then  -- an empty backlog left in the ready set: heal it, as the pop did
      redis.call('ZREM', ready, lows[j])
      redis.call('HSET', vtc, ':floor', tonumber(lows[j + 1]))
    end
  end
  if not tenant then break end
  if at == 0 then
    redis.call('LPOP', prefix .. tenant)
  else
    redis.call('LSET', prefix .. tenant, at, ':taken:' .. me)
    redis.call('LREM', prefix .. tenant, 1, ':taken:' .. me)
  end
  local cost = tonumber(string.sub(item, 1, 12))
  local origin = string.gsub(string.sub(item, 13, 60), ' ', '')
  local fields = {'data', data, 'cost', cost, 'tenant', tenant}
  if origin ~= '' then fields[#fields + 1] = 'origin'; fields[#fields + 1] = origin end
  if who ~= '' then
    fields[#fields + 1] = 'prefer'; fields[#fields + 1] = who
    fields[#fields + 1] = 'marked'; fields[#fields + 1] = marked
    fields[#fields + 1] = 'pulled'; fields[#fields + 1] = tostring(now)
  end
  redis.call('XADD', stream, '*', unpack(fields))
  local got = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', 1, 'STREAMS',
                         stream, '>')
  out[#out + 1] = got[1][2][1][1]
  out[#out + 1] = got[1][2][1][2]
  taken = taken + 1
  c = c + cost / weight_of(w, tenant)
  redis.call('HSET', vtc, tenant, c)
  if redis.call('LLEN', prefix .. tenant) > 0 then
    redis.call('ZADD', ready, c, tenant)
  else
    redis.call('ZREM', ready, tenant)
    redis.call('HSET', vtc, ':floor', c)
  end
end
if taken > 0 then
  redis.call('XTRIM', KEYS[5], 'MAXLEN', math.max(0, redis.call('XLEN', KEYS[5]) - taken))
end
local last_bell = redis.call('XREVRANGE', KEYS[5], '+', '-', 'COUNT', 1)
local last_entry = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
table.insert(out, 1, tostring(soonest))
table.insert(out, 1, last_entry[1] and last_entry[1][1] or '0-0')
table.insert(out, 1, last_bell[1] and last_bell[1][1] or '0-0')
return out
"""

# KEYS: vtc, ready, weights. ARGV: tenant, tokens (may be negative). The correction once
# a request ends: what it really used minus what the pull charged, divided by the weight.
CHARGE_LUA = _LIFT + """
local w = weight_of(KEYS[3], ARGV[1])
local c = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') + tonumber(ARGV[2]) / w
redis.call('HSET', KEYS[1], ARGV[1], c)
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then redis.call('ZADD', KEYS[2], c, ARGV[1]) end
return tostring(c)
"""


def pull(r: Any, stream: str, group: str, consumer: str, count: int
         ) -> tuple[list[tuple[Any, dict[Any, Any]]], tuple[Any, Any]]:
    """Up to ``count`` entries for ``consumer`` from ``stream``'s fair backlog (sync
    client), as XREADGROUP would give them, and the (bell, stream) ids to block after."""
    entries, marks, _soonest = pull_marked(r, stream, group, consumer, count)
    return entries, marks


def pull_marked(r: Any, stream: str, group: str, consumer: str, count: int
                ) -> tuple[list[tuple[Any, dict[Any, Any]]], tuple[Any, Any], int]:
    """``pull``, plus the milliseconds until the soonest request this pull passed over
    (offered to another worker) may be taken by any worker (-1: none was passed over)."""
    reply = r.execute_command(
        "EVAL", PULL_LUA, 5, stream, ready(stream), counters(stream), weights(stream),
        bell(stream), group, consumer, count, DIRECT_COST, DEFAULT_TENANT,
        backlog(stream, ""))
    marks = (reply[0], reply[1])
    entries = []
    for i in range(3, len(reply), 2):
        flat = reply[i + 1]
        entries.append((reply[i], dict(zip(flat[::2], flat[1::2], strict=True))))
    return entries, marks, int(reply[2])


def queue_charge(pipe: Any, stream: str, tenant: str, tokens: int) -> None:
    """Queue adding ``tokens`` (divided by the tenant's weight) to its counter on a lane."""
    pipe.execute_command("EVAL", CHARGE_LUA, 3, counters(stream), ready(stream),
                         weights(stream), tenant, tokens)
