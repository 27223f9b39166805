"""The control thread: cancel listener, heartbeat, lease renewal.

One thread, one pub/sub connection on ``{prefix}:control`` plus a command connection.
Between pub/sub reads (at most 100 ms each) it writes the heartbeat every
``heartbeat_interval_s`` and renews the leases on every held entry every ``lease_s / 3``.
The renewal also reads each held request's cancel mark, which catches a cancel whose
pub/sub message was lost (e.g. while reconnecting after a Redis restart).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from protocol.codec import ProtocolError, decode_cancel
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import queue_commands, queue_lags, remove_heartbeat, write_heartbeat
from worker.service.jobs import Command
from worker.service.leases import RENEW, SCRIPTS, HeldEntries, by_stream, lost_ids
from worker.service.redis_io import (
    TRANSIENT_ERRORS,
    Backoff,
    WorkerSettings,
    execute_scripts,
    recover,
    text,
)

log = structlog.get_logger("ferry.worker.control")

StatsFn = Callable[[], dict[str, float | int | str]]


class Control(threading.Thread):
    def __init__(
        self, settings: WorkerSettings, held: HeldEntries, mailbox: queue.Queue[Any],
        stats: StatsFn,
    ) -> None:
        super().__init__(name="ferry-control", daemon=True)
        self.settings = settings
        self.keys = settings.keys
        self.held = held
        self.mailbox = mailbox
        self.stats = stats
        self.redis = settings.connect()
        self.started_at = time.time()
        self.stopped = threading.Event()
        self.queue_lag = 0
        self.queue_depth = 0
        self.beats = 0

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and remove the heartbeat (the worker is no longer live)."""
        self.stopped.set()
        self.join(timeout)
        try:
            pipe = self.redis.pipeline()
            remove_heartbeat(pipe, self.keys, self.settings.worker_id)
            pipe.execute()
        except TRANSIENT_ERRORS as exc:
            log.warning("heartbeat_remove_failed", error=str(exc))
        self.redis.close()

    def run(self) -> None:
        backoff = Backoff()
        pubsub: Any = None
        next_beat = next_renew = 0.0
        while not self.stopped.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.keys.control)
                msg = pubsub.get_message(timeout=0.1)
                if msg is not None and msg.get("type") == "message":
                    self._on_cancel(msg["data"])
                now = time.monotonic()
                if now >= next_renew:
                    self.renew()
                    next_renew = now + self.settings.renew_interval_s
                if now >= next_beat:
                    self.beat()
                    next_beat = now + self.settings.heartbeat_interval_s
                backoff.reset()
            except TRANSIENT_ERRORS as exc:
                if backoff.failures == 0:
                    log.warning("control_redis_unavailable", error=str(exc))
                pubsub = _close(pubsub)
                recover(self.redis)
                backoff.wait(self.stopped)
            except Exception:  # never let a bug stop heartbeats and renewals silently
                log.exception("control_failed")
                pubsub = _close(pubsub)
                backoff.wait(self.stopped)
        _close(pubsub)

    def _on_cancel(self, data: Any) -> None:
        try:
            cancel = decode_cancel(data)
        except ProtocolError as exc:
            log.warning("bad_control_message", error=str(exc))
            return
        if self.held.holds_request(cancel.request_id):
            self.mailbox.put(Command("cancel", cancel.request_id, cancel.reason))

    def renew(self) -> None:
        """Extend the lease on every held entry; report lost ones and cancel marks."""
        held = self.held.snapshot()
        if not held:
            return
        keys, entries = self.keys, list(held)
        streams = by_stream(entries)

        def build(pipe: Any) -> None:
            for stream, ids in streams.items():
                RENEW.queue(pipe, [stream], [keys.group, self.settings.worker_id, *ids])
            for entry in entries:
                pipe.get(keys.cancelled(held[entry]))

        replies = execute_scripts(self.redis, build, SCRIPTS)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        for stream, reply in zip(streams, replies, strict=False):
            for entry_id in lost_ids(reply):
                request_id = self.held.discard((stream, entry_id))
                if request_id is not None:
                    log.warning("lease_lost", request_id=request_id, entry_id=entry_id,
                                stream=stream)
                    self.mailbox.put(Command("lost", request_id))
        for entry, reason in zip(entries, replies[len(streams):], strict=True):
            if reason is not None and entry in self.held:
                self.mailbox.put(Command("cancel", held[entry], text(reason)))

    def beat(self) -> None:
        self.queue_depth, self.queue_lag = _queue(self.redis, self.keys)
        now = time.time()
        beat = WorkerHeartbeat(
            worker_id=self.settings.worker_id, model=self.settings.model_name,
            started_at=self.started_at, updated_at=now, stats=self.stats(),
        )
        pipe = self.redis.pipeline()
        write_heartbeat(pipe, self.keys, beat, self.settings.ttls)
        pipe.execute()
        self.beats += 1
        if self.settings.health_file:
            Path(self.settings.health_file).touch()


def _queue(r: Any, keys: Keys) -> tuple[int, int]:
    """(entries in every lane, entries not yet delivered to any worker), summed over lanes."""
    pipe = r.pipeline(transaction=False)
    queue_commands(pipe, keys)
    lanes = queue_lags(pipe.execute(raise_on_error=False), keys)
    return sum(d for d, _ in lanes.values()), sum(lag for _, lag in lanes.values())


def _close(pubsub: Any) -> Any:
    """Close a pub/sub (ignoring errors: it may be broken already); returns None."""
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()
    return None
