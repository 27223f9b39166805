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

from protocol.cluster.nodes import node_client, node_pipeline, raise_moved
from protocol.codec import ProtocolError, decode_cancel
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import queue_commands, queue_lags, remove_heartbeat, write_heartbeat
from worker.service.affinity.board_writer import BoardWriter
from worker.service.jobs import Command
from worker.service.redis.connection import (
    TRANSIENT_ERRORS,
    Backoff,
    WorkerSettings,
    execute_scripts,
    recover,
    text,
)
from worker.service.redis.leases import RENEW, SCRIPTS, Entry, HeldEntries, by_stream, lost_ids
from worker.service.redis.shard_gate import ShardGate

log = structlog.get_logger("ferry.worker.control")

StatsFn = Callable[[], dict[str, float | int | str]]


class Control(threading.Thread):
    def __init__(
        self, settings: WorkerSettings, held: HeldEntries, mailbox: queue.Queue[Any],
        stats: StatsFn, gate: ShardGate | None = None, board: BoardWriter | None = None,
    ) -> None:
        super().__init__(name="ferry-control", daemon=True)
        self.settings = settings
        self.keys = settings.keys
        self.held = held
        self.mailbox = mailbox
        self.stats = stats
        self.gate = gate or ShardGate(settings)
        # on a cluster one shard may stop answering: a read of it must not outlast the
        # heartbeat's TTL, or this worker looks dead while it serves the other shards
        self.redis = settings.connect(socket_timeout=min(5.0, settings.ttls.heartbeat_s / 2)
                                      if settings.redis_cluster else 5.0)
        self.started_at = time.time()
        self.stopped = threading.Event()
        self.queue_lag = 0
        self.queue_depth = 0
        self.beats = 0
        self.board = board  # the prefix-affinity board, written with each beat (or None)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and remove the heartbeat (the worker is no longer live)."""
        self.stopped.set()
        self.join(timeout)
        try:
            pipe = self.redis.pipeline()
            remove_heartbeat(pipe, self.keys, self.settings.worker_id)
            pipe.execute()
            if self.board is not None:
                self.gate.run(self.gate.fleet_shard, self.board.remove, self.redis,
                              default=None, redis=self.redis)
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
        """Extend the lease on every held entry; report lost ones and cancel marks. Shard by
        shard on a cluster: the entries of a lost shard wait for it (their leases may run
        out meanwhile; their fenced writes then say so)."""
        held = self.held.snapshot()
        shards: dict[int, dict[Entry, str]] = {}
        for entry, request_id in held.items():
            shards.setdefault(self.gate.shard_of_stream(entry[0]), {})[entry] = request_id
        for shard, entries in shards.items():
            self.gate.run(shard, self._renew, entries, default=None, redis=self.redis)

    def _renew(self, held: dict[Entry, str]) -> None:
        """One shard's entries: RENEW on its master (its lanes share one slot), then the
        cancel marks (in the requests' own slots)."""
        keys, entries = self.keys, list(held)
        streams = by_stream(entries)

        def build(pipe: Any) -> None:
            for stream, ids in streams.items():
                RENEW.queue(pipe, [stream], [keys.group, self.settings.worker_id, *ids])

        replies = execute_scripts(node_client(self.redis, entries[0][0]), build, SCRIPTS)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            pipe.get(keys.cancelled(held[entry]))
        reasons = pipe.execute()
        for stream, reply in zip(streams, replies, strict=True):
            for entry_id in lost_ids(reply):
                request_id = self.held.discard((stream, entry_id))
                if request_id is not None:
                    log.warning("lease_lost", request_id=request_id, entry_id=entry_id,
                                stream=stream)
                    self.mailbox.put(Command("lost", request_id))
        for entry, reason in zip(entries, reasons, strict=True):
            if reason is not None and entry in self.held:
                self.mailbox.put(Command("cancel", held[entry], text(reason)))

    def beat(self) -> None:
        """The queue numbers (shard by shard, the lost ones left out), then the heartbeat,
        unless the shard holding the fleet's keys is lost (nothing to write it to: the
        health file is touched all the same while other shards are served)."""
        depth = lag = 0
        for k in range(self.keys.shards):
            d, n = self.gate.run(k, _queue, self.redis, self.keys, self.keys.shard_streams(k),
                                 default=(0, 0), redis=self.redis)
            depth, lag = depth + d, lag + n
        self.queue_depth, self.queue_lag = depth, lag
        now = time.time()
        beat = WorkerHeartbeat(
            worker_id=self.settings.worker_id, model=self.settings.model_name,
            started_at=self.started_at, updated_at=now, stats=self.stats(),
        )
        if self.gate.run(self.gate.fleet_shard, self._write, beat, default=False,
                         redis=self.redis):
            self.beats += 1
            if self.board is not None:
                self._write_board(self.board)
        elif not any(self.gate.usable(k) for k in range(self.keys.shards)):
            return
        if self.settings.health_file:
            Path(self.settings.health_file).touch()

    def _write_board(self, board: BoardWriter) -> None:
        """The affinity board, after the heartbeat: a failure to write it is logged and
        never delays a beat (the next write is a full one)."""
        try:
            self.gate.run(self.gate.fleet_shard, board.write, self.redis, default=None,
                          redis=self.redis)
        except Exception as exc:
            log.warning("affinity_board_write_failed", error=str(exc))

    def _write(self, beat: WorkerHeartbeat) -> bool:
        pipe = self.redis.pipeline()
        write_heartbeat(pipe, self.keys, beat, self.settings.ttls)
        pipe.execute()
        return True


def _queue(r: Any, keys: Keys, streams: tuple[str, ...]) -> tuple[int, int]:
    """(entries in one shard's ``streams``, entries not yet delivered to any worker)."""
    pipe = node_pipeline(r, streams[0])
    queue_commands(pipe, keys, streams)
    replies = raise_moved(pipe.execute(raise_on_error=False))
    lanes = queue_lags(replies, keys, streams)
    return sum(d for d, _ in lanes.values()), sum(lag for _, lag in lanes.values())


def _close(pubsub: Any) -> Any:
    """Close a pub/sub (ignoring errors: it may be broken already); returns None."""
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()
    return None
