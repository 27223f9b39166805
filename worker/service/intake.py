"""The intake thread: stream entries -> started jobs on the engine loop's mailbox.

It takes only as many entries as the worker can start soon (``Slots``: free places in the
batch, and at most ``prefetch`` entries waiting to start), so a burst spreads over every
idle worker instead of queueing behind the first one's prefills; it BLOCKs long only
while the batch is empty. Each pass first runs the reaper: XAUTOCLAIM of entries idle past
the lease (their worker died or stalled), which are resumed from their replay log. Entries
that cannot be decoded, or were delivered too often, go to the dead-letter stream; the
worker keeps going.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from redis.exceptions import ResponseError

from protocol.codec import ProtocolError, decode_entry
from protocol.models import GenerateRequest
from protocol.store import START_JOB_LUA, ensure_group
from protocol.streaming import decode_log
from worker.service.deadletter import DeadLetters
from worker.service.jobs import ActiveJob, Admission
from worker.service.leases import HeldEntries
from worker.service.outbox import Outbox
from worker.service.redis_io import TRANSIENT_ERRORS, Backoff, WorkerSettings, connect, text

log = structlog.get_logger("ferry.worker.intake")


class Slots:
    """Places the intake may fill: the intake takes, the engine loop gives back.

    ``held`` counts every request this worker owns (on its way, waiting, running);
    ``held - running`` of them have not started. The intake may take an entry while the
    batch has room (``held < total``) and fewer than ``prefetch`` wait to start.
    """

    def __init__(self, total: int, prefetch: int) -> None:
        self.total = total
        self.prefetch = prefetch
        self._held = 0
        self._running = 0
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        return self._held

    def free(self) -> int:
        return min(self.total - self._held, self.prefetch - (self._held - self._running))

    def wait_free(self, timeout: float) -> int:
        with self._cond:
            if self.free() <= 0:
                self._cond.wait(timeout)
            return self.free()

    def set_running(self, running: int) -> None:
        """The engine loop, after each step: how many requests are in the running batch."""
        if running == self._running:
            return
        with self._cond:
            self._running = running
            self._cond.notify_all()

    def take(self, n: int = 1) -> None:
        with self._cond:
            self._held += n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._held = max(0, self._held - n)
            self._cond.notify_all()


class Intake(threading.Thread):
    def __init__(
        self, settings: WorkerSettings, held: HeldEntries, slots: Slots,
        mailbox: queue.Queue[Any], outbox: Outbox, busy: Callable[[], bool],
        dead: DeadLetters,
    ) -> None:
        super().__init__(name="ferry-intake", daemon=True)
        self.settings = settings
        self.keys = settings.keys
        self.held = held
        self.slots = slots
        self.mailbox = mailbox
        self.outbox = outbox
        self.busy = busy
        self.dead = dead
        # BLOCK must end well before the socket timeout, or a quiet stream looks dead.
        self.redis = connect(settings.redis_url, socket_timeout=settings.idle_block_ms / 1000 + 5)
        self.stopped = threading.Event()
        self.reclaimed = 0
        self._cursor = "0-0"
        self._next_reap = 0.0

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        backoff = Backoff()
        while not self.stopped.is_set():
            try:
                self._tick()
                backoff.reset()
            except TRANSIENT_ERRORS as exc:
                if backoff.failures == 0:
                    log.warning("intake_redis_unavailable", error=str(exc))
                backoff.wait(self.stopped)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    log.warning("consumer_group_missing_recreating")
                    ensure_group(self.redis, self.keys)
                else:
                    log.error("intake_redis_error", error=str(exc))
                    backoff.wait(self.stopped)
            except Exception:  # a bug here must not silently stop all intake
                log.exception("intake_failed")
                backoff.wait(self.stopped)
        self.redis.close()

    def _tick(self) -> None:
        free = self.slots.wait_free(timeout=0.2)
        if free <= 0 or self.stopped.is_set():
            return
        if time.monotonic() >= self._next_reap:
            free -= self._reap(free)
        if free <= 0:
            return
        block = self.settings.busy_block_ms if self.busy() else self.settings.idle_block_ms
        reply: Any = self.redis.xreadgroup(
            self.keys.group, self.settings.worker_id, {self.keys.requests: ">"},
            count=free, block=block,
        )
        for item in reply or []:
            self._process(item[1], {})

    def _reap(self, limit: int) -> int:
        """Claim up to ``limit`` entries idle past the lease; returns how many."""
        next_id, claimed, *_ = self.redis.xautoclaim(
            self.keys.requests, self.keys.group, self.settings.worker_id,
            min_idle_time=self.settings.lease_ms, start_id=self._cursor, count=limit,
        )
        self._cursor = text(next_id)
        # A partial scan continues on the next pass; a full one waits for the interval.
        wrapped = self._cursor == "0-0"
        self._next_reap = time.monotonic() + (self.settings.reap_interval_s if wrapped else 0)
        if not claimed:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _fields in claimed:
            pipe.xpending_range(self.keys.requests, self.keys.group, entry_id, entry_id, 1)
        deliveries = {}
        for (entry_id, _fields), rows in zip(claimed, pipe.execute(), strict=True):
            deliveries[text(entry_id)] = int(rows[0]["times_delivered"]) if rows else 1
        self.reclaimed += len(claimed)
        log.info("entries_reclaimed", count=len(claimed), ids=list(deliveries)[:8])
        self._process(claimed, deliveries)
        return len(claimed)

    def _process(self, entries: list[Any], deliveries: dict[str, int]) -> None:
        """Decode, dead-letter the bad, then start the good ones in one round trip."""
        good: list[tuple[str, GenerateRequest]] = []
        for raw_id, fields in entries:
            entry_id = text(raw_id)
            if fields is None:  # deleted from the stream while pending: nothing to run
                self.redis.xack(self.keys.requests, self.keys.group, entry_id)
                continue
            try:
                request = decode_entry(fields)
            except ProtocolError as exc:
                self.dead.undecodable(self.redis, entry_id, fields, str(exc))
                continue
            if entry_id in self.held:  # our own entry, reclaimed after renewals failed
                continue
            times = deliveries.get(entry_id, 1)
            if times > self.settings.max_deliveries:
                self.dead.too_many_deliveries(self.redis, entry_id, fields, request, times)
                continue
            if self.held.holds_request(request.request_id):  # a producer bypassed ENQUEUE_LUA
                self.dead.duplicate(self.redis, entry_id, fields, request.request_id)
                continue
            self.held.add(entry_id, request.request_id)
            good.append((entry_id, request))
        if good:
            self._start(good)

    def _start(self, good: list[tuple[str, GenerateRequest]]) -> None:
        """start_job + replay log + cancel mark for every entry, in one round trip.

        If Redis fails midway, the entries not dispatched are released (no longer renewed),
        so a reaper — maybe ours — reclaims them once the lease runs out.
        """
        keys, now = self.keys, repr(time.time())
        done = 0
        try:
            pipe = self.redis.pipeline(transaction=False)
            for _entry_id, request in good:
                rid = request.request_id
                pipe.eval(START_JOB_LUA, 2, keys.job(rid), keys.cancelled(rid), rid,
                          self.settings.worker_id, now, self.settings.ttls.job_s)
                pipe.lrange(keys.events(rid), 0, -1)
                pipe.get(keys.cancelled(rid))
            replies = pipe.execute()
            for i, (entry_id, request) in enumerate(good):
                decision, log_items, reason = replies[3 * i: 3 * i + 3]
                self._dispatch(entry_id, request, text(decision), log_items, reason)
                done += 1
        finally:
            for entry_id, _request in good[done:]:
                self.held.discard(entry_id)

    def _dispatch(
        self, entry_id: str, request: GenerateRequest, decision: str, log_items: list[Any],
        reason: Any,
    ) -> None:
        try:
            events = decode_log(log_items)
        except ProtocolError as exc:
            self.held.discard(entry_id)
            self.dead.unrunnable(self.redis, entry_id, request, f"replay log unreadable: {exc}")
            return
        admission = Admission(
            entry_id, request, [t for e in events for t in e.token_ids],
            "".join(e.text for e in events), len(events),
        )
        if decision == "skip" or (events and events[-1].is_final):
            self.held.discard(entry_id)
            pipe = self.redis.pipeline(transaction=False)
            pipe.xack(self.keys.requests, self.keys.group, entry_id)
            pipe.xdel(self.keys.requests, entry_id)
            pipe.execute()
        elif decision == "cancel":
            job = ActiveJob(admission, self.settings.worker_id)
            why = text(reason) if reason is not None else "cancelled"
            self.outbox.put([job.final_event("cancelled", error=why)])
        else:
            if events:
                log.info("request_resumed", request_id=request.request_id,
                         next_seq=len(events), prior_tokens=len(admission.prior_token_ids))
            self.slots.take()
            self.mailbox.put(admission)
