"""Writes this worker's affinity board with each heartbeat (the control thread).

Each beat sends the book's changes (``book.py``) and renews the key's TTL to the
heartbeat's, so the board lives exactly as long as the worker looks alive. Every
``FULL_EVERY`` beats, and after any failed write (Redis away: the key may have expired
meanwhile), the whole book is written again over a deleted key, so the board converges to
the book whatever was lost. A clean stop deletes it (``remove``).
"""

from __future__ import annotations

from typing import Any

from protocol.affinity.board import queue_advertise
from worker.service.affinity.book import AffinityBook
from worker.service.metrics.affinity import AffinityMetrics
from worker.service.redis.connection import WorkerSettings

FULL_EVERY = 30


class BoardWriter:
    def __init__(self, settings: WorkerSettings, book: AffinityBook,
                 metrics: AffinityMetrics) -> None:
        self.key = settings.keys.affinity(settings.worker_id)
        self.ttl_ms = max(1, round(settings.ttls.heartbeat_s * 1000))
        self.book = book
        self.metrics = metrics
        self._beats = 0  # 0: the next write is a full one

    def write(self, redis: Any) -> None:
        """One beat's update (raises what Redis raises; the next write is then full)."""
        full = self._beats % FULL_EVERY == 0
        changes = self.book.take(full)
        pipe = redis.pipeline(transaction=False)
        if full:
            pipe.delete(self.key)
        queue_advertise(pipe, self.key, changes.added, changes.removed, self.ttl_ms)
        try:
            pipe.execute()
        except Exception:
            self._beats = 0
            raise
        self._beats += 1

    def heartbeat(self) -> dict[str, int]:
        return self.metrics.heartbeat(len(self.book))

    def remove(self, redis: Any) -> None:
        redis.delete(self.key)
