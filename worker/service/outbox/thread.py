"""The outbox thread: every step's events to Redis in one pipelined round trip.

The engine loop hands over a list of ``Outgoing`` per step and never waits for Redis
(unless the buffer is full: then it waits, which is the backpressure that bounds memory
while Redis is away). This thread sends everything pending as one call of the
fenced-push script (``worker/service/redis/leases.py: FENCED_PUSH``), which for each
event atomically checks the lease, PUBLISHes the event, appends it to the replay log
and, for a terminal event, writes the result to the job hash and XACKs the entry. On a
connection error the same batch is sent again after a backoff, in order; the fence turns
already-applied pushes into ``dup``, so nothing reaches a client twice. On a Redis
Cluster the batch goes out as one pipeline per master instead
(``worker/service/outbox/cluster_push.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import structlog

from protocol.codec import encode_event, status_to_hash
from protocol.models import PROTOCOL_VERSION
from worker.service.jobs import Command, Outgoing
from worker.service.outbox.cluster_push import ClusterPusher
from worker.service.redis.connection import (
    TRANSIENT_ERRORS,
    Backoff,
    WorkerSettings,
    execute_scripts,
    recover,
    text,
)
from worker.service.redis.leases import FENCED_PUSH, SCRIPTS, HeldEntries
from worker.service.redis.shard_gate import ShardGate

log = structlog.get_logger("ferry.worker.outbox")

MAX_BATCH = 1024  # events per script call: bounds how long Redis is busy with one
Observer = Callable[[list[Outgoing], float], None]


def encode_outgoing(out: Outgoing) -> bytes:
    """msgpack TokenEvent. Terminal events go through the pydantic model; per-step ones
    are packed from raw fields (the same bytes, without validating what we just made)."""
    if out.event is not None:
        return encode_event(out.event)
    payload: dict[str, Any] = {
        "version": PROTOCOL_VERSION, "request_id": out.request_id, "seq": out.seq,
        "token_ids": out.token_ids, "text": out.text,
    }
    if out.logprobs is not None:
        payload["logprobs"] = out.logprobs
    if out.index:
        payload["index"] = out.index
    if out.choice_finish_reason is not None:
        payload["choice_finish_reason"] = out.choice_finish_reason
    if out.stop_reason is not None:
        payload["stop_reason"] = out.stop_reason
    if out.prompt is not None:
        payload.update(out.prompt)
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


def queue_push(pipe: Any, settings: WorkerSettings, batch: list[Outgoing]) -> None:
    """Queue one fenced push of ``batch`` in order (events; result + XACK if terminal)."""
    keys, ttls = settings.keys, settings.ttls
    script_keys: list[str] = []
    args: list[Any] = [keys.group, settings.worker_id, ttls.events_s, ttls.job_s, len(batch)]
    for out in batch:
        rid = out.request_id
        stream, entry_id = out.entry
        script_keys += [stream, keys.events(rid), keys.job(rid)]
        fields = status_to_hash(out.status) if out.status is not None else {}
        if out.claim:
            fields.update(entry_id=entry_id, stream=stream)
        args += [entry_id, out.seq, encode_outgoing(out), keys.tokens(rid), len(fields)]
        for name, value in fields.items():
            args += [name, value]
    FENCED_PUSH.queue(pipe, script_keys, args)


class Outbox(threading.Thread):
    """Owns the pending events; ``put`` from any thread, ``flush``/``close`` on shutdown."""

    def __init__(
        self, settings: WorkerSettings, held: HeldEntries, mailbox: queue.Queue[Any],
        observer: Observer | None = None, gate: ShardGate | None = None,
    ) -> None:
        super().__init__(name="ferry-outbox", daemon=True)
        self.settings = settings
        self.held = held
        self.mailbox = mailbox
        self.observer = observer
        self.redis = settings.connect()
        self.pusher = ClusterPusher(settings, self.redis, encode_outgoing, held.holds_request,
                                    gate) if settings.redis_cluster else None
        self._cond = threading.Condition()
        self._pending: deque[Outgoing] = deque()
        self._inflight = 0
        self._closing = False
        self._abandon = threading.Event()
        self.sent = 0

    @property
    def depth(self) -> int:
        return len(self._pending) + self._inflight + self._parked

    @property
    def _parked(self) -> int:
        """Events a cluster pusher holds for a master that is away (failing over)."""
        return len(self.pusher.parked) if self.pusher is not None else 0

    def put(self, items: list[Outgoing], give_up: Callable[[], bool] | None = None) -> None:
        """Queue events in order; waits while the buffer is full (Redis away too long).

        ``give_up()`` true (a drain past its deadline) drops the items instead: safe,
        because nobody has seen them and whoever resumes the request regenerates them
        from the replay log, which is the source of truth.
        """
        if not items:
            return
        with self._cond:
            while len(self._pending) >= self.settings.max_outbox_events:
                if self._abandon.is_set() or (give_up is not None and give_up()):
                    return
                self._cond.wait(0.1)
            self._pending.extend(items)
            self._cond.notify_all()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing and not self._parked:
                    self._cond.wait()
                if self._abandon.is_set() or not (self._pending or self._parked):
                    return
                if not self._pending:  # only parked events: retry them at a gentle pace
                    self._cond.wait(0.02)
                n = min(len(self._pending), MAX_BATCH)
                batch = [self._pending.popleft() for _ in range(n)]
                self._inflight = n
                self._cond.notify_all()
            try:
                self._send(batch)
            finally:
                with self._cond:
                    self._inflight = 0
                    self._cond.notify_all()

    def _send(self, batch: list[Outgoing]) -> None:
        if self.pusher is not None:  # parks what a failing-over master cannot take yet
            settled = self.pusher.push(batch, self._abandon, park=True)
            self._sent([out for out, _ in settled])
            refused: set[str] = set()
            for out, outcome in settled:
                self._settle(out, outcome, refused)
            return
        backoff = Backoff()
        while True:
            try:
                replies = execute_scripts(
                    self.redis, lambda pipe: queue_push(pipe, self.settings, batch), SCRIPTS
                )
                break
            except TRANSIENT_ERRORS as exc:
                if backoff.failures == 0:
                    log.warning("outbox_redis_unavailable", error=str(exc), pending=self.depth)
                recover(self.redis)
                backoff.wait(self._abandon)
                if self._abandon.is_set():
                    return
        if backoff.failures:
            log.info("outbox_reconnected", retries=backoff.failures)
        self._sent(batch)
        outcomes = replies[0]
        if isinstance(outcomes, Exception):  # e.g. the group was deleted: nothing is owned
            log.error("publish_failed", error=str(outcomes), events=len(batch))
            outcomes = [outcomes] * len(batch)
        reported: set[str] = set()
        for out, outcome in zip(batch, outcomes, strict=True):
            self._settle(out, outcome, reported)

    def _sent(self, batch: list[Outgoing]) -> None:
        self.sent += len(batch)
        if self.observer is not None:
            self.observer(batch, time.time())

    def _settle(self, out: Outgoing, reply: Any, reported: set[str]) -> None:
        outcome = "error" if isinstance(reply, Exception) else text(reply)
        if outcome in ("ok", "dup"):
            if out.final:
                self.held.discard(out.entry)
            return
        # 'lost' (another worker owns the entry; or, terminal, already acknowledged),
        # 'gap' (the log is not where we thought), 'foreign' (the job belongs to another
        # entry) or a script error: stop this request.
        self.held.discard(out.entry)
        if out.request_id in reported or (out.final and outcome == "lost"):
            return
        reported.add(out.request_id)
        log.warning("publish_refused", request_id=out.request_id, seq=out.seq,
                    outcome=outcome, error=str(reply) if outcome == "error" else None)
        if not out.final:
            self.mailbox.put(Command("lost", out.request_id))

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is sent; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._inflight or self._parked:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Send what is pending (up to ``timeout``), then stop; True if all was sent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.join(timeout)
        clean = not self.is_alive() and not self._pending and not self._parked
        if self.is_alive():
            self._abandon.set()
            self.join(5)
        self.redis.close()
        return clean
