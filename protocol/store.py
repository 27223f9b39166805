"""The Redis side of the contract: which commands each party runs, built in one place.

Functions taking ``pipe`` only *queue* commands on a pipeline, so the same helper serves a
sync ``redis.Redis.pipeline()`` and a ``redis.asyncio`` one (whose command methods are not
coroutines either); the caller executes it. Use ``transaction=True`` pipelines (MULTI/EXEC,
the redis-py default): a subscriber that receives a PUBLISHed event must find the same
event already in the replay log, or gap filling would not work.

State changes that must not race (enqueue vs. a reused id, cancel vs. a worker starting
the job) are small Lua scripts, run atomically by Redis; their text is here too so a
service in another language can run the very same scripts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import ResponseError

from protocol.codec import (
    encode_cancel,
    encode_event,
    encode_heartbeat,
    encode_request,
    status_to_hash,
)
from protocol.keys import Keys
from protocol.models import Cancel, GenerateRequest, JobStatus, TokenEvent, Usage, WorkerHeartbeat
from protocol.tenants.fair import PUSH_BODY, push_args
from protocol.tenants.fair import bell as fair_bell

StartDecision = Literal["run", "skip", "cancel", "duplicate"]


@dataclass(frozen=True)
class Ttls:
    """Seconds each key lives. The job hash must outlive the longest queue wait."""

    job_s: int = 24 * 3600
    events_s: int = 3600
    cancelled_s: int = 24 * 3600
    # A worker's heartbeat key lives this long after its last beat; its absence is the
    # worker's death: others then take over its entries (worker/service/redis/leases.py), so it
    # must cover a few missed beats (WorkerSettings checks >= 2 beat intervals).
    heartbeat_s: float = 4.0


_TERMINAL_LUA = "state == 'done' or state == 'failed' or state == 'cancelled' or state == 'timeout'"

# KEYS: job, the request's lane stream, events, cancelled, then the lane's fair backlog
# (ready, vtc, weights, bell, the tenant's backlog: ``protocol.tenants.fair``). ARGV: request_id,
# created_at, model or '', job ttl, tenant, weight, cost, msgpack request. Refuses (returns
# nil) a request id whose job hash still exists. The request waits in its tenant's backlog
# until a worker's fair pull moves it into the stream; that worker's START_JOB_LUA then
# names the entry in the job hash (``entry_id``, ``stream``): workers never write a job's
# hash, log or channel for any other entry (a duplicate XADD).
ENQUEUE_LUA = PUSH_BODY + """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', 'queued', 'created_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'model', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
push(5, 5)
return 1
"""

# KEYS: job, cancelled, events. ARGV: reason, now, cancelled ttl, control channel,
# msgpack Cancel, tokens channel, msgpack terminal event, events ttl, job ttl.
# A queued job is finished right here (so readers stop waiting even with no worker up);
# a running one is left to its worker, which hears the control message. On a cluster the
# token channel is a sharded one (SPUBLISH, in the job's slot); the control channel stays
# classic (PUBLISH reaches every node's subscribers).
def _cancel_lua(publish_tokens: str) -> str:
    return f"""
local state = redis.call('HGET', KEYS[1], 'state')
if {_TERMINAL_LUA} then return state end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[5])
if state == 'queued' and redis.call('LLEN', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finish_reason', 'cancelled',
             'error', ARGV[1], 'finished_at', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[9])
  redis.call('RPUSH', KEYS[3], ARGV[7])
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  redis.call('{publish_tokens}', ARGV[6], ARGV[7])
  return 'cancelled'
end
return state or 'unknown'
"""


CANCEL_LUA = _cancel_lua("PUBLISH")
CANCEL_LUA_CLUSTER = _cancel_lua("SPUBLISH")

# KEYS: job, cancelled. ARGV: request_id, worker_id, now, job ttl, entry id, stream, and
# the entry's ``origin`` ('' if none: the id it had before the fair pull adopted it).
# 'duplicate': the job belongs to another stream entry (or finished before entries were
#   recorded): this entry must not touch it; dead-letter the entry.
# 'skip': already finished (e.g. reclaimed after its worker wrote the result), or
#   cancelled before any worker took it (CANCEL_LUA ended it, terminal event included, and
#   no entry was ever named: the fair backlog still held it): just XACK, no dead letter.
# 'cancel': cancelled while running: emit a terminal 'cancelled' event, then XACK.
# An entry with no job hash (a producer that XADDed directly) claims the id here.
START_JOB_LUA = f"""
local owner = redis.call('HMGET', KEYS[1], 'entry_id', 'stream')
local state = redis.call('HGET', KEYS[1], 'state')
if owner[1] and owner[1] ~= ARGV[7] and (owner[1] ~= ARGV[5] or owner[2] ~= ARGV[6]) then
  return 'duplicate'
end
if {_TERMINAL_LUA} then
  if owner[1] or state == 'cancelled' then return 'skip' end
  return 'duplicate'
end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'entry_id', ARGV[5], 'stream', ARGV[6],
           'worker_id', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then return 'cancel' end
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[3])
return 'run'
"""
# (``worker_id`` names whoever took the entry last, also on 'cancel': on a cluster that
# field is the write fence, ``worker/service/outbox/cluster_push.py``.)

class DuplicateRequestError(ValueError):
    """The request id is already in use (its job hash has not expired)."""


# --- producer side -----------------------------------------------------------------------


def enqueue_script(
    keys: Keys, request: GenerateRequest, ttls: Ttls, weight: float = 1.0, mark: bytes = b""
) -> tuple[str, list[str], list[Any]]:
    """(script, KEYS, ARGV) for ``EVAL``: job hash state=queued, then push the request
    onto its tenant's fair backlog (``weight``: the tenant's share, ``protocol.tenants.fair``;
    ``mark``: a preference for the worker holding its prefix, ``protocol/affinity/mark.py``)."""
    rid = request.request_id
    stream = keys.stream_for(rid, request.priority)
    fair_keys, fair_argv = push_args(stream, request, weight, mark + encode_request(request))
    script_keys = [keys.job(rid), stream, keys.events(rid), keys.cancelled(rid), *fair_keys]
    argv = [rid, repr(request.created_at), request.model or "", ttls.job_s, *fair_argv]
    return ENQUEUE_LUA, script_keys, argv


def cancel_script(
    keys: Keys, request_id: str, reason: str, ttls: Ttls, now: float | None = None
) -> tuple[str, list[str], list[Any]]:
    """(script, KEYS, ARGV) for ``EVAL`` of a cancel; returns the state it found."""
    now = time.time() if now is None else now
    terminal = TokenEvent(
        request_id=request_id, seq=0, finish_reason="cancelled", error=reason, usage=Usage()
    )
    script_keys = [keys.job(request_id), keys.cancelled(request_id), keys.events(request_id)]
    argv = [
        reason, repr(now), ttls.cancelled_s, keys.control,
        encode_cancel(Cancel(request_id=request_id, reason=reason)),
        keys.tokens(request_id), encode_event(terminal), ttls.events_s, ttls.job_s,
    ]
    return CANCEL_LUA_CLUSTER if keys.cluster else CANCEL_LUA, script_keys, argv


def as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- worker side -------------------------------------------------------------------------


def start_job(
    r: Any, keys: Keys, request_id: str, worker_id: str, ttls: Ttls, now: float | None = None,
    *, entry_id: str | bytes, stream: str | None = None, origin: str = "",
) -> StartDecision:
    """Atomically move a job to running unless it is finished, cancelled or owned by
    another entry (sync client). ``stream`` defaults to the normal lane; ``origin`` is the
    entry's ``origin`` field, if the fair pull adopted it (``protocol.tenants.fair``)."""
    now = time.time() if now is None else now
    script_keys = [keys.job(request_id), keys.cancelled(request_id)]
    out = r.eval(START_JOB_LUA, 2, *script_keys, request_id, worker_id, repr(now), ttls.job_s,
                 as_str(entry_id), stream or keys.requests, origin)
    decision = as_str(out)
    if decision not in ("run", "skip", "cancel", "duplicate"):
        raise RuntimeError(f"start_job: unexpected script reply {decision!r}")
    return decision  # type: ignore[return-value]


def push_event(pipe: Any, keys: Keys, event: TokenEvent, ttls: Ttls) -> None:
    """Queue PUBLISH + RPUSH (+EXPIRE) of one event. Event ``seq`` must equal the log length."""
    data = encode_event(event)
    publish = pipe.spublish if keys.cluster else pipe.publish  # sharded on a cluster
    publish(keys.tokens(event.request_id), data)
    pipe.rpush(keys.events(event.request_id), data)
    pipe.expire(keys.events(event.request_id), ttls.events_s)


def write_result(pipe: Any, keys: Keys, status: JobStatus, ttls: Ttls) -> None:
    """Queue HSET of the job hash (state and result fields) and refresh its TTL."""
    pipe.hset(keys.job(status.request_id), mapping=status_to_hash(status))
    pipe.expire(keys.job(status.request_id), ttls.job_s)


def ack(pipe: Any, keys: Keys, entry_id: str | bytes, stream: str | None = None) -> None:
    """Queue XACK of a request-stream entry (normal lane unless ``stream``); do it last,
    after the terminal event."""
    pipe.xack(stream or keys.requests, keys.group, entry_id)


def finish(
    pipe: Any, keys: Keys, event: TokenEvent, status: JobStatus, entry_id: str | bytes,
    ttls: Ttls, stream: str | None = None,
) -> None:
    """Queue everything a terminal step needs, in contract order: event, result, XACK."""
    push_event(pipe, keys, event, ttls)
    write_result(pipe, keys, status, ttls)
    ack(pipe, keys, entry_id, stream)


def write_heartbeat(pipe: Any, keys: Keys, heartbeat: WorkerHeartbeat, ttls: Ttls) -> None:
    """Queue SET of the heartbeat key with its TTL and registration in the workers set."""
    pipe.set(keys.worker(heartbeat.worker_id), encode_heartbeat(heartbeat),
             px=max(1, round(ttls.heartbeat_s * 1000)))
    pipe.sadd(keys.workers, heartbeat.worker_id)


def remove_heartbeat(pipe: Any, keys: Keys, worker_id: str) -> None:
    """Queue removal of a worker's heartbeat, on clean shutdown."""
    pipe.delete(keys.worker(worker_id))
    pipe.srem(keys.workers, worker_id)


def ensure_group(r: Any, keys: Keys, streams: Sequence[str] | None = None) -> None:
    """Create every lane's stream (or ``streams``') and consumer group if missing (sync
    client). Idempotent."""
    for stream in keys.request_streams if streams is None else streams:
        try:
            r.xgroup_create(stream, keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def group_lag(depth: int, groups: list[dict[Any, Any]] | Exception, group: str) -> int:
    """Entries of one stream not yet delivered to ``group``, from XLEN and XINFO GROUPS
    (an error reply, e.g. the stream is missing: nothing queued; no group yet: all of it)."""
    if isinstance(groups, Exception):
        return 0
    for info in groups:
        if as_str(info.get("name", "")) == group:
            lag = info.get("lag")  # None after deletions: undelivered = length - pending
            return int(lag) if lag is not None else max(0, depth - int(info.get("pending") or 0))
    return depth


def queue_commands(pipe: Any, keys: Keys, streams: Sequence[str] | None = None) -> None:
    """Queue XLEN + XINFO GROUPS of every lane (or of ``streams``: one shard's, say), and
    the depth of its fair backlog (read the replies with ``queue_lags``)."""
    for stream in keys.request_streams if streams is None else streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.xlen(fair_bell(stream))


def queue_lags(replies: list[Any], keys: Keys, streams: Sequence[str] | None = None
               ) -> dict[str, tuple[int, int]]:
    """Per lane stream: (length, undelivered), from the replies of ``queue_commands`` (for
    the same ``streams``) executed with ``raise_on_error=False``. Undelivered counts the
    requests waiting in the lane's fair backlog too (``protocol.tenants.fair``): they are queued
    work like any other."""
    out = {}
    for i, stream in enumerate(keys.request_streams if streams is None else streams):
        depth, groups, waiting = replies[3 * i: 3 * i + 3]
        depth = 0 if isinstance(depth, Exception) else int(depth)
        waiting = 0 if isinstance(waiting, Exception) else int(waiting)
        out[stream] = (depth, group_lag(depth, groups, keys.group) + waiting)
    return out
