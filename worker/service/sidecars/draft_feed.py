"""The fleet's draft store: finished outputs shared between the workers of a model, per tenant.

Suffix decoding drafts from outputs seen before; a worker alone only sees its own. Each
worker appends the text it stores locally (a prompt's tail and the output) to the model's
stream ``Keys.drafts``, tagged with the request's tenant, and tails that stream from the
oldest entry it still holds, filing each entry under its tenant only (``DraftStore``: no
tenant drafts from another's texts), so a retried or repeated request is drafted on
whichever worker takes it, including workers started later. An entry without a valid
tenant is skipped. The tail runs on a thread of its own and only queues what it reads:
the engine thread drains the queue into its ``DraftStore`` between steps (``drain``), so
the automata are only ever touched by one thread. Appends go the other way: ``publish``
(engine thread) only queues, a writer thread sends, so the engine loop never waits on
Redis; a failed append loses that entry (a cache), logged once until an append succeeds
again. Entries a worker wrote itself are skipped (already stored when written).

Retention (``ttl_s``, ``FERRY_SPEC_STORE_TTL_S``): every append also trims the stream to
the entries younger than the TTL (``XTRIM MINID``, exact) and sets the key to expire a TTL
after it; the writer trims once a minute (``trim_every_s``) even with nothing to append,
so no entry outlives the TTL by more than that; the tail skips an entry older than the
TTL (its time is its stream id's) and files the others with that time, so the local store
drops each when it would have expired here. Memory is bounded on both sides: the stream by
``MAXLEN ~`` and the TTL, the local store by its capacity and the TTL, the two queues by
``max_pending`` (a full incoming queue drops its oldest text: the newest are worth the
most).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import numpy as np
import structlog
from redis.exceptions import ResponseError

from protocol.tenants.ids import check_tenant
from worker.engine import DraftStore
from worker.service.redis.connection import TRANSIENT_ERRORS, WorkerSettings, recover
from worker.service.redis.read_loop import read_until_stopped

log = structlog.get_logger("ferry.worker.drafts")

POLL_MS = 1000  # XREAD block: how long a stop may wait for the tail to notice it
READ_COUNT = 256
TRIM_EVERY_S = 60.0  # the writer trims the stream at least this often
SEND_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, ResponseError)
"""What an append or a trim may meet and carry on after: Redis away, or a refusal (an ACL
without the stream's commands, the key of another type): the entry is lost, logged."""

Text = tuple[str, list[int], float]  # (tenant, tokens, when written: wall clock seconds)


def pack_tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"draft entry of {len(data)} bytes is not int32 tokens")
    return np.frombuffer(data, dtype="<i4").tolist()  # type: ignore[no-any-return]


def entry_time(entry_id: bytes | str) -> float:
    """When a stream entry was written: its id's milliseconds, in seconds."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.partition("-")[0]) / 1000.0


class DraftFeed:
    """``start()``; ``publish(tokens, tenant)`` from the engine thread; ``drain(store)``
    between steps; ``stop()`` (sends what is queued first, for at most its timeout)."""

    def __init__(self, settings: WorkerSettings, worker_id: str, ttl_s: float,
                 max_entries: int = 4096, max_pending: int = 1024,
                 trim_every_s: float = TRIM_EVERY_S) -> None:
        if not 0 < ttl_s < float("inf"):
            raise ValueError(f"ttl_s: the fleet's drafts need a finite TTL > 0, got {ttl_s}")
        self.settings = settings
        self.key = settings.keys.drafts(settings.model_name)
        self.worker_id = worker_id.encode()
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.trim_every_s = trim_every_s
        # counts, for the heartbeat, tests and logs
        self.published = self.received = self.dropped = self.lost = 0
        self.expired = self.skipped = 0  # entries read past their TTL / without a tenant
        self._pending: queue.Queue[Text] = queue.Queue(max_pending)
        self._outgoing: queue.Queue[Text] = queue.Queue(max_pending)
        self._stop = threading.Event()
        self._failing = False  # an append failed and none succeeded since (log once)
        self._trimmed_at = -float("inf")  # monotonic time of the last trim
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

    def publish(self, tokens: list[int], tenant: str) -> None:
        """Share one stored text of ``tenant`` (engine thread: queues it, never blocks)."""
        if not tokens or self._stop.is_set():
            return
        try:
            self._outgoing.put_nowait((tenant, tokens, time.time()))
        except queue.Full:  # Redis is slower than the outputs: this one is not shared
            self.lost += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued text was sent (or lost); True if so in time."""
        deadline = time.monotonic() + timeout
        while self._outgoing.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._outgoing.unfinished_tasks

    def _write(self) -> None:
        """The writer thread: append each queued text (trimming the stream to the TTL as it
        goes), trim when it is time; after a stop, what is queued."""
        r = self.settings.connect()
        try:
            while not (self._stop.is_set() and self._outgoing.empty()):
                if time.monotonic() - self._trimmed_at >= self.trim_every_s:
                    self._trimmed_at = time.monotonic()  # tried: not again for a while
                    self._send(r, None)
                try:
                    text = self._outgoing.get(timeout=0.1)
                except queue.Empty:
                    continue
                try:
                    self._send(r, text)
                finally:
                    self._outgoing.task_done()
        finally:
            r.close()

    def _send(self, r: Any, text: Text | None) -> None:
        """One round trip: append ``text`` (if any; MAXLEN ~, the key's expiry a TTL from
        now) and trim every entry older than the TTL."""
        oldest_ms = max(0, int((time.time() - self.ttl_s) * 1000))
        pipe = r.pipeline(transaction=False)
        if text is not None:
            tenant, tokens, _ = text
            pipe.xadd(self.key, {"t": pack_tokens(tokens), "tenant": tenant,
                                 "w": self.worker_id},
                      maxlen=self.max_entries, approximate=True)
            pipe.pexpire(self.key, int(self.ttl_s * 1000))
        pipe.xtrim(self.key, minid=f"{oldest_ms}-0", approximate=False)
        try:
            pipe.execute()
        except SEND_ERRORS as exc:
            self.lost += text is not None
            if not self._failing:
                log.warning("draft_publish_failed", error=str(exc)[:200],
                            note="drafts are a cache: entries are lost until Redis takes "
                                 "them again")
                self._failing = True
            recover(r)
            return
        self._trimmed_at = time.monotonic()
        self.published += text is not None
        if self._failing:
            log.info("draft_publish_recovered", lost=self.lost)
            self._failing = False

    def drain(self, store: DraftStore, limit: int = 64) -> int:
        """Move up to ``limit`` queued texts into ``store``, each under its tenant and
        with the time it was written (one past the TTL is not stored); returns how many."""
        moved = 0
        while moved < limit:
            try:
                tenant, tokens, created = self._pending.get_nowait()
            except queue.Empty:
                break
            store.add(tokens, tenant, created)
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
                self._take(entry_id, fields)

    def _take(self, entry_id: Any, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"w") == self.worker_id:
            return
        created = entry_time(entry_id)
        if created <= time.time() - self.ttl_s:  # not trimmed yet: never offered
            self.expired += 1
            return
        try:
            tenant = check_tenant(fields.get(b"tenant", b"").decode("ascii"))
            tokens = unpack_tokens(fields.get(b"t", b""))
        except ValueError as exc:  # no tenant (an older writer's): nobody's to draft from
            self.skipped += 1
            if self.skipped == 1 or self.skipped % 1000 == 0:  # a backlog logs once
                log.warning("bad_draft_entry", entry=str(entry_id), error=str(exc)[:200],
                            skipped=self.skipped)
            return
        self.received += 1
        while True:
            try:
                self._pending.put_nowait((tenant, tokens, created))
                return
            except queue.Full:  # the engine is behind (a backlog at start): the newest
                with contextlib.suppress(queue.Empty):  # outputs are worth the most
                    self._pending.get_nowait()
                    self.dropped += 1
