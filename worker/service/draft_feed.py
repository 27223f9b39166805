"""The fleet's draft store: finished outputs shared between the workers of a model.

Suffix decoding drafts from outputs seen before; a worker alone only sees its own. Each
worker appends the text it stores locally (a prompt's tail and the output) to the model's
capped stream ``Keys.drafts`` and tails that stream from the oldest entry it still holds,
so a retried or repeated request is drafted on whichever worker takes it, including
workers started later. The tail runs on a thread of its own and only queues what it
reads: the engine thread drains the queue into its ``DraftStore`` between steps
(``drain``), so the automata are only ever touched by one thread. Appends go the other
way: ``publish`` (engine thread) only queues, a writer thread sends, so the engine loop
never waits on Redis; a failed append loses that entry (a cache), logged once until an
append succeeds again. Entries a worker wrote itself are skipped (already stored when
written). Memory is bounded on both sides: the stream by ``MAXLEN ~`` on every append,
the local store by its capacity, the two queues by ``max_pending`` (a full
incoming queue drops its oldest text: the newest are worth the most).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import numpy as np
import structlog

from worker.engine.speculative.draft_store import DraftStore
from worker.service.read_loop import read_until_stopped
from worker.service.redis_io import TRANSIENT_ERRORS, WorkerSettings, recover

log = structlog.get_logger("ferry.worker.drafts")

POLL_MS = 1000  # XREAD block: how long a stop may wait for the tail to notice it
READ_COUNT = 256


def pack_tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"draft entry of {len(data)} bytes is not int32 tokens")
    return np.frombuffer(data, dtype="<i4").tolist()  # type: ignore[no-any-return]


class DraftFeed:
    """``start()``; ``publish(tokens)`` from the engine thread; ``drain(store)`` between
    steps; ``stop()`` (sends what is queued first, for at most its timeout)."""

    def __init__(self, settings: WorkerSettings, worker_id: str, max_entries: int = 4096,
                 max_pending: int = 1024) -> None:
        self.settings = settings
        self.key = settings.keys.drafts(settings.model_name)
        self.worker_id = worker_id.encode()
        self.max_entries = max_entries
        # counts, for the heartbeat, tests and logs
        self.published = self.received = self.dropped = self.lost = 0
        self._pending: queue.Queue[list[int]] = queue.Queue(max_pending)
        self._outgoing: queue.Queue[list[int]] = queue.Queue(max_pending)
        self._stop = threading.Event()
        self._failing = False  # an append failed and none succeeded since (log once)
        self._last_id: Any = "0-0"  # the tail reads from the oldest entry still held
        self._thread = threading.Thread(target=self._tail, name="ferry-drafts", daemon=True)
        self._writer = threading.Thread(target=self._write, name="ferry-drafts-out",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._writer.start()

    def stop(self, timeout: float = POLL_MS / 1000 + 2.0) -> None:
        self._stop.set()
        for thread in (self._writer, self._thread):
            if thread.is_alive():
                thread.join(timeout)

    def publish(self, tokens: list[int]) -> None:
        """Share one stored text (engine thread: queues it, never blocks)."""
        if not tokens or self._stop.is_set():
            return
        try:
            self._outgoing.put_nowait(tokens)
        except queue.Full:  # Redis is slower than the outputs: this one is not shared
            self.lost += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued text was sent (or lost); True if so in time."""
        deadline = time.monotonic() + timeout
        while self._outgoing.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._outgoing.unfinished_tasks

    def _write(self) -> None:
        """The writer thread: append each queued text; after a stop, what is queued."""
        r = self.settings.connect()
        try:
            while not (self._stop.is_set() and self._outgoing.empty()):
                try:
                    tokens = self._outgoing.get(timeout=0.1)
                except queue.Empty:
                    continue
                try:
                    self._append(r, tokens)
                finally:
                    self._outgoing.task_done()
        finally:
            r.close()

    def _append(self, r: Any, tokens: list[int]) -> None:
        try:
            r.xadd(self.key, {"t": pack_tokens(tokens), "w": self.worker_id},
                   maxlen=self.max_entries, approximate=True)
        except TRANSIENT_ERRORS as exc:
            self.lost += 1
            if not self._failing:
                log.warning("draft_publish_failed", error=str(exc),
                            note="drafts are a cache: entries are lost until Redis is back")
                self._failing = True
            recover(r)
            return
        self.published += 1
        if self._failing:
            log.info("draft_publish_recovered", lost=self.lost)
            self._failing = False

    def drain(self, store: DraftStore, limit: int = 64) -> int:
        """Move up to ``limit`` queued texts into ``store``; returns how many."""
        moved = 0
        while moved < limit:
            try:
                tokens = self._pending.get_nowait()
            except queue.Empty:
                break
            store.add(tokens)
            moved += 1
        return moved

    def _tail(self) -> None:
        read_until_stopped(self.settings, self._stop, self._read, self._on_reply, log,
                           "draft_feed_unavailable")

    def _read(self, r: Any) -> Any:
        return r.xread({self.key: self._last_id}, count=READ_COUNT, block=POLL_MS)

    def _on_reply(self, r: Any, reply: Any) -> None:
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._take(fields)

    def _take(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"w") == self.worker_id:
            return
        try:
            tokens = unpack_tokens(fields.get(b"t", b""))
        except ValueError as exc:
            log.warning("bad_draft_entry", error=str(exc))
            return
        self.received += 1
        while True:
            try:
                self._pending.put_nowait(tokens)
                return
            except queue.Full:  # the engine is behind (a backlog at start): the newest
                with contextlib.suppress(queue.Empty):  # outputs are worth the most
                    self._pending.get_nowait()
                    self.dropped += 1
