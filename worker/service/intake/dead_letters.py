"""Dead-lettering: entries no worker can run leave the stream with a reason, never a crash.

Two kinds reach here: entries that do not decode (bad msgpack, unknown version, schema
errors) and entries delivered more than ``max_deliveries`` times (every worker that took
them died: a poison request). Both are copied to ``{prefix}:requests:dead`` with the
reason and acknowledged. When a request id can be recovered, its client also gets a
terminal error event and the job hash says ``failed``, so nobody waits forever.

A cancelled request is not one of them: an entry cancelled before any worker took it is
acknowledged and dropped by the intake (``START_JOB_LUA`` says ``skip``). The stream is
bounded by count, age and payload size (``protocol.dead_letters.DeadLetterBounds``, the
worker's ``dead_letters`` setting), so a flood of bad entries cannot fill Redis.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError

from protocol.codec import REQUEST_FIELD, request_fields
from protocol.dead_letters import dead_letter
from protocol.models import (
    ID_PATTERN,
    TERMINAL_STATES,
    ErrorKind,
    GenerateRequest,
    JobStatus,
    TokenEvent,
    Usage,
)
from worker.service.jobs import Outgoing
from worker.service.outbox.cluster_push import ClusterPusher
from worker.service.outbox.thread import encode_outgoing, queue_push
from worker.service.redis.connection import WorkerSettings, execute_scripts
from worker.service.redis.leases import SCRIPTS, Entry

log = structlog.get_logger("ferry.worker.deadletter")
_ID_RE = re.compile(ID_PATTERN)


def recover_request_id(fields: dict[Any, Any]) -> str | None:
    """The entry's ``request_id`` if the payload is at least a msgpack map holding one."""
    raw = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
    try:
        obj = msgpack.unpackb(raw, raw=False) if isinstance(raw, bytes) else None
    except Exception:  # garbage of any kind: no id to report to
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and _ID_RE.match(rid) else None


class DeadLetters:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.count = 0

    def undecodable(
        self, r: redis.Redis, entry: Entry, fields: dict[Any, Any], reason: str
    ) -> None:
        rid = recover_request_id(fields)
        self._send(r, entry, fields, f"undecodable: {reason}", rid,
                   f"invalid request: {reason}", "invalid_request")

    def too_many_deliveries(
        self, r: redis.Redis, entry: Entry, fields: dict[Any, Any], request: GenerateRequest,
        times: int,
    ) -> None:
        limit = self.settings.max_deliveries
        reason = f"delivered {times} times (max_deliveries={limit}); workers kept failing on it"
        self._send(r, entry, fields, reason, request.request_id,
                   f"the request was abandoned after {times - 1} failed attempts", "internal")

    def unrunnable(
        self, r: redis.Redis, entry: Entry, request: GenerateRequest, reason: str
    ) -> None:
        """A decodable request the worker still cannot run (e.g. its replay log is corrupt)."""
        self._send(r, entry, request_fields(request), reason, request.request_id, reason,
                   "internal")

    def duplicate(
        self, r: redis.Redis, entry: Entry, fields: dict[Any, Any], request_id: str,
        in_flight: bool = True,
    ) -> None:
        """A second entry for a request id that belongs to another entry (running here, or
        any job whose hash names its own entry): dead-letter it without an event, so the
        job it collides with is never touched."""
        where = "in flight on this worker" if in_flight else "owned by another entry"
        self._send(r, entry, fields, f"duplicate request_id {request_id!r} {where}",
                   None, "", "invalid_request")

    def _send(
        self, r: redis.Redis, entry: Entry, fields: dict[Any, Any], reason: str,
        rid: str | None, error: str, kind: ErrorKind,
    ) -> None:
        self.count += 1
        stream, entry_id = entry
        log.warning("entry_dead_lettered", entry_id=entry_id, stream=stream, request_id=rid,
                    reason=reason)
        keys = self.settings.keys
        named = rid or recover_request_id(fields)  # kept in the record, even without an event
        out = None
        if rid is not None and not self._ended(r, rid):
            out = self._terminal(rid, entry, int(r.llen(keys.events(rid))), error, kind)
        if keys.cluster:  # the event and the record live in different slots
            outcome = dead_letter_on_cluster(r, self.settings, encode_outgoing, out, entry,
                                             fields, reason)
            if outcome not in (None, "ok", "dup"):
                log.info("dead_letter_event_skipped", entry_id=entry_id, request_id=rid,
                         why=f"the job refused the event ({outcome})")
            return

        def build(pipe: Any) -> None:
            if out is not None:  # event + failed job hash + XACK, fenced like any other
                queue_push(pipe, self.settings, [out])
            dead_letter(pipe, keys, entry_id, fields, reason, stream, request_id=named,
                        bounds=self.settings.dead_letters)
            pipe.xdel(stream, entry_id)

        replies = execute_scripts(r, build, SCRIPTS, preload=out is not None)
        if out is not None and replies and replies[0] == [b"foreign"]:
            log.info("dead_letter_event_skipped", entry_id=entry_id, request_id=rid,
                     why="the request id belongs to another entry's job")
            replies = replies[1:]
        for reply in replies:
            if isinstance(reply, Exception) or (isinstance(reply, list) and reply != [b"ok"]):
                log.error("dead_letter_event_failed", entry_id=entry_id, reply=str(reply))

    def _ended(self, r: redis.Redis, rid: str) -> bool:
        """The job already has its terminal event: nothing more may be written for it."""
        state = r.hget(self.settings.keys.job(rid), "state")
        return state is not None and state.decode() in TERMINAL_STATES  # type: ignore[union-attr]

    def _terminal(
        self, rid: str, entry: Entry, seq: int, error: str, kind: ErrorKind
    ) -> Outgoing:
        """The one terminal event of a request whose entry is dead: fenced like any other
        write, and claiming the id for this entry (``claim``), so that a second entry with
        the same id finds the job owned by another entry and writes nothing."""
        now, worker = time.time(), self.settings.worker_id
        event = TokenEvent(request_id=rid, seq=seq, finish_reason="error", error=error,
                           error_kind=kind, usage=Usage(), worker_id=worker)
        status = JobStatus(request_id=rid, state="failed", finish_reason="error", error=error,
                           error_kind=kind, usage=Usage(), worker_id=worker, finished_at=now)
        return Outgoing(entry, rid, seq, [], "", None, event, status, now, claim=True)


def dead_letter_on_cluster(
    r: Any, settings: WorkerSettings, encode: Callable[[Outgoing], bytes],
    terminal: Outgoing | None, entry: Entry, fields: dict[Any, Any], reason: str,
) -> Any:
    """A dead letter on a cluster, in order: the client's terminal event (taking the job
    over, unless it is another entry's), then the dead-letter record and the XACK + XDEL
    in the shard's slot. Returns the event's outcome (None without one); a master that
    stays away raises, and the entry, not yet acknowledged, is tried again later."""
    outcome = None
    if terminal is not None:
        pusher = ClusterPusher(settings, r, encode, lambda _rid: False)
        settled = pusher.push([terminal], threading.Event(), claim=True, ack=False,
                              give_up_after_s=5.0)
        if not settled:
            raise RedisConnectionError(f"dead letter of {entry}: its job's master is away")
        outcome = settled[0][1]
    stream, entry_id = entry
    pipe = r.pipeline(transaction=False)
    dead_letter(pipe, settings.keys, entry_id, fields, reason, stream,
                request_id=recover_request_id(fields), bounds=settings.dead_letters)
    pipe.xdel(stream, entry_id)
    pipe.execute()
    return outcome
