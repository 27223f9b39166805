"""The fair backlog's worker-side Lua: the pull and the end-of-request charge, with the
weight clamp and the lift rule every fair script shares.

``PULL_LUA`` picks the ready tenant with the lowest virtual token counter, looks past
items a preference mark offers to another worker (at most ``PREFER_SCAN`` items deep in
``PREFER_TENANTS`` tenants), moves the item into the lane stream and reads it for the
calling consumer, charging the counter its cost over the tenant's weight. ``CHARGE_LUA``
corrects a counter once a request ends. ``protocol/tenants/fair.py`` owns the keys, the
push and the Python calls that run these scripts; the design is described there.
"""

from __future__ import annotations

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

# Shared Lua: a weight as the scripts use it (clamped: a bad one an older producer wrote
# must not make a counter infinite), a counter that is not finite read as 0 (one an older
# version let grow infinite heals when its tenant re-enters), and the lift rule.
LIFT_LUA = f"""
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

# KEYS: stream, ready, vtc, weights, bell. ARGV: group, consumer, count, direct cost,
# default tenant, backlog key prefix. Returns {bell last id, stream last id, ms until the
# soonest item passed over for another worker may be taken (-1: none), id, fields, ...}.
PULL_LUA = LIFT_LUA + f"""
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
CHARGE_LUA = LIFT_LUA + """
local w = weight_of(KEYS[3], ARGV[1])
local c = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') + tonumber(ARGV[2]) / w
redis.call('HSET', KEYS[1], ARGV[1], c)
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then redis.call('ZADD', KEYS[2], c, ARGV[1]) end
return tostring(c)
"""
