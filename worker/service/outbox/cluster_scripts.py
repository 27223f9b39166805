"""The cluster outbox's Lua: one fenced push per master per step (``cluster_push.py``).

The fence is the single-Redis one (``leases.FENCED_PUSH``) moved to where a request's keys
live: its job hash's ``worker_id`` instead of the stream's PEL, the same ``foreign`` and
``seq`` checks, SPUBLISH instead of PUBLISH, and no XACK (the entry is in another slot).
"""

from __future__ import annotations

from worker.service.redis.connection import LuaScript

# One call per master per step (measured with the pusher alone on the dev machine: a
# script call per request cost 30-40% more Redis CPU per event, 13.0 vs 9.8 us on one
# master, 15.8 vs 11.2 on three). The keys of many slots cannot be declared
# (the cluster refuses a cross-slot call), so they travel in ARGV and the script is flagged
# allow-cross-slot-keys: Redis still checks every key it touches is on this node and stops
# with "non local key" if not (the slot moved: refresh and resend; what ran is a 'dup').
# ARGV: consumer, events ttl, job ttl, request count, then per request: its events list,
# its job hash, entry id, stream, tokens channel, claim ('1': take the job over, for dead
# letters), event count, then per event: seq, msgpack event, n (> 0 for a terminal event:
# n job hash field/value pairs follow). Returns per request one outcome per event: 'ok',
# 'dup', 'lost' (the job names another worker), 'foreign' (another entry's job) or
# 'gap:<log length>'.
FENCED_PUSH_NODE = LuaScript("""#!lua flags=allow-cross-slot-keys
local consumer, out, a = ARGV[1], {}, 4
for g = 1, tonumber(ARGV[4]) do
  local log, job, eid, stream = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local chan, claim, count = ARGV[a + 5], ARGV[a + 6], tonumber(ARGV[a + 7])
  a = a + 7
  local owner = redis.call('HMGET', job, 'entry_id', 'stream', 'worker_id', 'state')
  local foreign = owner[1] and (owner[1] ~= eid or owner[2] ~= stream)
  local state = owner[4]
  local ended = state == 'done' or state == 'failed' or state == 'cancelled' or
    state == 'timeout'
  if claim == '1' and not foreign and not ended then
    redis.call('HSET', job, 'worker_id', consumer)
    owner[3] = consumer
  end
  local mine = owner[3] == consumer or (not owner[3] and state == 'queued')
  local n = redis.call('LLEN', log)
  local res = {}
  for i = 1, count do
    local seq, nf = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
    if foreign then
      res[i] = 'foreign'
    elseif not mine then
      res[i] = 'lost'
    elseif n > seq then
      res[i] = 'dup'
    elseif n < seq then
      res[i] = 'gap:' .. n
    else
      redis.call('RPUSH', log, ARGV[a + 2])
      redis.call('SPUBLISH', chan, ARGV[a + 2])
      n = n + 1
      if nf > 0 then
        redis.call('HSET', job, unpack(ARGV, a + 4, a + 3 + 2 * nf))
        redis.call('EXPIRE', job, ARGV[3])
      end
      res[i] = 'ok'
    end
    a = a + 3 + 2 * nf
  end
  if n > 0 then redis.call('EXPIRE', log, ARGV[2]) end
  out[g] = res
end
return out
""")
MOVED_UNDER_US = ("non local key", "cluster is down")
"""Errors of FENCED_PUSH_NODE that mean the topology changed under the call: retry."""
