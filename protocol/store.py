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
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import ResponseError

from protocol.codec import (
    REQUEST_FIELD,
    encode_cancel,
    encode_event,
    encode_heartbeat,
    encode_request,
    status_to_hash,
)
from protocol.keys import Keys
from protocol.models import Cancel, GenerateRequest, JobStatus, TokenEvent, Usage, WorkerHeartbeat

StartDecision = Literal["run", "skip", "cancel"]


@dataclass(frozen=True)
class Ttls:
    """Seconds each key lives. The job hash must outlive the longest queue wait."""

    job_s: int = 24 * 3600
    events_s: int = 3600
    cancelled_s: int = 24 * 3600
    heartbeat_s: int = 15


_TERMINAL_LUA = "state == 'done' or state == 'failed' or state == 'cancelled' or state == 'timeout'"

# KEYS: job, requests, events, cancelled. ARGV: request_id, created_at, model or '', job ttl,
# msgpack request. Refuses (returns nil) a request id whose job hash still exists.
ENQUEUE_LUA = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', 'queued', 'created_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'model', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return redis.call('XADD', KEYS[2], '*', '{REQUEST_FIELD}', ARGV[5])
"""

# KEYS: job, cancelled, events. ARGV: reason, now, cancelled ttl, control channel,
# msgpack Cancel, tokens channel, msgpack terminal event, events ttl, job ttl.
# A queued job is finished right here (so readers stop waiting even with no worker up);
# a running one is left to its worker, which hears the control message.
CANCEL_LUA = f"""
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
  redis.call('PUBLISH', ARGV[6], ARGV[7])
  return 'cancelled'
end
return state or 'unknown'
"""

# KEYS: job, cancelled. ARGV: request_id, worker_id, now, job ttl.
# 'skip': already finished (e.g. reclaimed after its worker wrote the result): just XACK.
# 'cancel': cancelled while queued/running: emit a terminal 'cancelled' event, then XACK.
START_JOB_LUA = f"""
local state = redis.call('HGET', KEYS[1], 'state')
if {_TERMINAL_LUA} then return 'skip' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'cancel' end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', 'running',
           'worker_id', ARGV[2], 'started_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 'run'
"""


class DuplicateRequestError(ValueError):
    """The request id is already in use (its job hash has not expired)."""


# --- producer side -----------------------------------------------------------------------


def enqueue_script(
    keys: Keys, request: GenerateRequest, ttls: Ttls
) -> tuple[str, list[str], list[Any]]:
    """(script, KEYS, ARGV) for ``EVAL``: job hash state=queued, then XADD the request."""
    rid = request.request_id
    script_keys = [keys.job(rid), keys.requests, keys.events(rid), keys.cancelled(rid)]
    argv = [rid, repr(request.created_at), request.model or "", ttls.job_s,
            encode_request(request)]
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
    return CANCEL_LUA, script_keys, argv


def as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- worker side -------------------------------------------------------------------------


def start_job(
    r: Any, keys: Keys, request_id: str, worker_id: str, ttls: Ttls, now: float | None = None
) -> StartDecision:
    """Atomically move a job to running unless it is finished or cancelled (sync client)."""
    now = time.time() if now is None else now
    script_keys = [keys.job(request_id), keys.cancelled(request_id)]
    out = r.eval(START_JOB_LUA, 2, *script_keys, request_id, worker_id, repr(now), ttls.job_s)
    decision = as_str(out)
    if decision not in ("run", "skip", "cancel"):
        raise RuntimeError(f"start_job: unexpected script reply {decision!r}")
    return decision  # type: ignore[return-value]


def push_event(pipe: Any, keys: Keys, event: TokenEvent, ttls: Ttls) -> None:
    """Queue PUBLISH + RPUSH (+EXPIRE) of one event. Event ``seq`` must equal the log length."""
    data = encode_event(event)
    pipe.publish(keys.tokens(event.request_id), data)
    pipe.rpush(keys.events(event.request_id), data)
    pipe.expire(keys.events(event.request_id), ttls.events_s)


def write_result(pipe: Any, keys: Keys, status: JobStatus, ttls: Ttls) -> None:
    """Queue HSET of the job hash (state and result fields) and refresh its TTL."""
    pipe.hset(keys.job(status.request_id), mapping=status_to_hash(status))
    pipe.expire(keys.job(status.request_id), ttls.job_s)


def ack(pipe: Any, keys: Keys, entry_id: str | bytes) -> None:
    """Queue XACK of a requests-stream entry; do it last, after the terminal event."""
    pipe.xack(keys.requests, keys.group, entry_id)


def finish(
    pipe: Any, keys: Keys, event: TokenEvent, status: JobStatus, entry_id: str | bytes,
    ttls: Ttls,
) -> None:
    """Queue everything a terminal step needs, in contract order: event, result, XACK."""
    push_event(pipe, keys, event, ttls)
    write_result(pipe, keys, status, ttls)
    ack(pipe, keys, entry_id)


def dead_letter(
    pipe: Any, keys: Keys, entry_id: str | bytes, fields: dict[Any, Any], reason: str
) -> None:
    """Queue moving an undecodable entry to the dead-letter stream, then XACK it."""
    raw = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD, b""))
    entry = {"entry_id": as_str(entry_id), "reason": reason[:2000], REQUEST_FIELD: raw}
    pipe.xadd(keys.dead_letter, entry, maxlen=100_000, approximate=True)
    ack(pipe, keys, entry_id)


def write_heartbeat(pipe: Any, keys: Keys, heartbeat: WorkerHeartbeat, ttls: Ttls) -> None:
    """Queue SET of the heartbeat key with its TTL and registration in the workers set."""
    pipe.set(keys.worker(heartbeat.worker_id), encode_heartbeat(heartbeat), ex=ttls.heartbeat_s)
    pipe.sadd(keys.workers, heartbeat.worker_id)


def remove_heartbeat(pipe: Any, keys: Keys, worker_id: str) -> None:
    """Queue removal of a worker's heartbeat, on clean shutdown."""
    pipe.delete(keys.worker(worker_id))
    pipe.srem(keys.workers, worker_id)


def ensure_group(r: Any, keys: Keys) -> None:
    """Create the stream and consumer group if missing (sync client). Idempotent."""
    try:
        r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
