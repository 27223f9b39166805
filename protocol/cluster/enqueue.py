"""The enqueue on a Redis Cluster: three steps in two slots, each replicated before it counts.

On one Redis, ``ENQUEUE_LUA`` refuses a reused id, XADDs the entry and names it in the job
hash, atomically. On a cluster the job hash lives in its request's slot and the entry in
its shard's stream, and no script can touch both, so:

1. ``RESERVE_LUA`` (request slot): refuse an id whose job hash exists, clear a stale log
   and cancel mark, write the job hash ``state=queued`` with a short TTL;
2. ``XADD`` the entry to the shard's lane stream, then ``WAIT`` on that connection;
3. ``RECORD_ENTRY_LUA`` (request slot): name the entry in the job hash unless a worker's
   ``START_JOB_LUA`` already did, give the hash its full TTL, then ``WAIT``.

Only then is the request accepted: replication is asynchronous, and a write a master
acknowledged can vanish with it, so each step that must survive a failover waits until
``Replication.replicas`` replicas have it; otherwise the request is cancelled (it was not
accepted, so it must not run: its entry, named in the job hash, is then only acknowledged
by the worker that reads it) and ``NotReplicatedError`` raised.

A producer that dies midway leaves a reservation that expires (``RESERVE_TTL_S``), or an
entry whose worker claims the id for it (``START_JOB_LUA`` writes ``entry_id``); an XADD
sent twice (its reply lost) leaves a second entry, which the worker dead-letters as a
duplicate without touching the job. Nothing half-done is ever served as something else.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis

from protocol.cluster.nodes import NotReplicatedError, Replication, arun_on_master, run_on_master
from protocol.codec import encode_request
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.store import DuplicateRequestError, Ttls, as_str, cancel_script
from protocol.tenants.fair import PUSH_LUA, push_args

RESERVE_TTL_S = 600

# KEYS: job, events, cancelled. ARGV: request_id, created_at, model or '', reserve ttl,
# the stream the entry goes to. Returns 1, or nil for an id in use.
RESERVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', 'queued', 'created_at', ARGV[2],
           'stream', ARGV[5])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'model', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: job. ARGV: entry id, stream, job ttl. Records the entry unless a worker's START_JOB
# did first; returns the recorded entry id (nil if the reservation is gone).
RECORD_ENTRY_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[1] ~= '' and not redis.call('HGET', KEYS[1], 'entry_id') then
  redis.call('HSET', KEYS[1], 'entry_id', ARGV[1], 'stream', ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('HGET', KEYS[1], 'entry_id')
"""


class EnqueuePlan:
    """The three steps of one request's enqueue, as commands (shared by both clients)."""

    def __init__(self, keys: Keys, request: GenerateRequest, ttls: Ttls,
                 replication: Replication, weight: float = 1.0, mark: bytes = b"") -> None:
        self.keys, self.request, self.ttls, self.weight = keys, request, ttls, weight
        self.mark = mark  # a preference for the worker holding its prefix (protocol/affinity)
        self.replication = replication
        self.request_id = request.request_id
        self.stream = keys.stream_for(self.request_id, request.priority)
        self.job_key = keys.job(self.request_id)

    def reserve(self) -> tuple[Any, ...]:
        rid = self.request_id
        keys = [self.keys.job(rid), self.keys.events(rid), self.keys.cancelled(rid)]
        argv = [rid, repr(self.request.created_at), self.request.model or "",
                RESERVE_TTL_S, self.stream]
        return ("EVAL", RESERVE_LUA, len(keys), *keys, *argv)

    def xadd(self) -> list[tuple[Any, ...]]:
        """The push onto the tenant's fair backlog of the shard's lane (``protocol.tenants.fair``):
        every key of it carries the stream's hash tag."""
        keys, argv = push_args(self.stream, self.request, self.weight,
                               self.mark + encode_request(self.request))
        return [("EVAL", PUSH_LUA, len(keys), *keys, *argv), *self._wait()]

    def record(self, entry_id: Any) -> list[tuple[Any, ...]]:
        """The job hash's full TTL (the entry is named later, by the worker that pulls it)."""
        args = ["", self.stream, self.ttls.job_s]
        return [("EVAL", RECORD_ENTRY_LUA, 1, self.job_key, *args), *self._wait()]

    def cancel(self) -> tuple[Any, ...]:
        """The cancel of a request that was not accepted (the reason says why)."""
        script, keys, argv = cancel_script(self.keys, self.request_id,
                                           "not accepted: no replica confirmed it", self.ttls)
        return ("EVAL", script, len(keys), *keys, *argv)

    def _wait(self) -> list[tuple[Any, ...]]:
        r = self.replication
        return [("WAIT", r.replicas, r.timeout_ms)] if r.replicas else []

    def check_reserved(self, reply: Any) -> None:
        if reply is None:
            raise DuplicateRequestError(f"request_id: {self.request_id!r} is already in use")

    def check_replicated(self, added: list[Any], recorded: list[Any]) -> None:
        """Both writes on enough replicas (the WAIT replies close both pipelines)."""
        if self.replication.replicas:
            self.replication.check(int(added[-1]), f"the entry of {self.request_id}")
            self.replication.check(int(recorded[-1]), f"the job hash of {self.request_id}")


def enqueue(rc: Any, plan: EnqueuePlan) -> str:
    """Run the plan with a sync ``RedisCluster``; returns the entry id. A request no
    replica confirmed is cancelled (not accepted, it must not run) before the error."""
    plan.check_reserved(rc.execute_command(*plan.reserve()))
    added = run_on_master(rc, plan.stream, plan.xadd())
    recorded = run_on_master(rc, plan.job_key, plan.record(added[0]))
    try:
        plan.check_replicated(added, recorded)
    except NotReplicatedError:
        with contextlib.suppress(redis.RedisError, OSError):
            rc.execute_command(*plan.cancel())
        raise
    return as_str(added[0])


async def aenqueue(rc: Any, plan: EnqueuePlan) -> str:
    """The asyncio twin of :func:`enqueue`."""
    plan.check_reserved(await rc.execute_command(*plan.reserve()))
    added = await arun_on_master(rc, plan.stream, plan.xadd())
    recorded = await arun_on_master(rc, plan.job_key, plan.record(added[0]))
    try:
        plan.check_replicated(added, recorded)
    except NotReplicatedError:
        with contextlib.suppress(redis.RedisError, OSError):
            await rc.execute_command(*plan.cancel())
        raise
    return as_str(added[0])
