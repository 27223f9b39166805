"""The producer's side of prefix affinity: which live worker a request is offered first.

Before a request is pushed onto its fair backlog, the producer (the gateway's client, or
any ``FerryClient``) hashes its leading chunks (``chunks.py``), reads in one pipeline every
live worker's heartbeat and how many of those chunks its board holds (``board.py``), and,
when one holds some and its queue is not too deep, puts a preference mark (``mark.py``) in
front of the request: that worker may take it at once, any other after ``steal_ms``. The
worker list is re-read at most once a second; marks given since a worker's last heartbeat
count toward its depth (``BURST_S``), so a burst does not pile onto one worker between
two beats.
Any failure of the look-up leaves the request unmarked: it is pulled as without affinity.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from protocol.affinity.board import Candidate, choose, leading
from protocol.affinity.chunks import prefix_chunks
from protocol.affinity.mark import mark
from protocol.codec import ProtocolError, decode_heartbeat
from protocol.keys import Keys
from protocol.models import GenerateRequest

_LIST_EVERY_S = 1.0
BURST_S = 0.25
"""Marks this recent (and newer than the worker's heartbeat) count toward its depth: a
burst marked between two beats spreads, while marks whose requests a fast worker has
long finished do not hold it back for the rest of the beat."""


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class AffinitySettings:
    """``FERRY_PREFIX_AFFINITY`` (1: on, 0: off), ``FERRY_AFFINITY_STEAL_MS`` (how long
    the holder has the request to itself), ``FERRY_AFFINITY_MAX_DEPTH`` (a worker with
    this many more requests taken but not running than the least busy live worker is not
    offered more) and ``FERRY_AFFINITY_LOAD_CHUNKS`` (what one request a worker holds
    weighs against one held chunk when choosing: ``board.choose``)."""

    enabled: bool = True
    steal_ms: int = 250
    max_depth: int = 8
    load_chunks: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.steal_ms <= 60_000:
            raise ValueError(f"FERRY_AFFINITY_STEAL_MS: {self.steal_ms} must be 0..60000")
        if self.max_depth < 1:
            raise ValueError(f"FERRY_AFFINITY_MAX_DEPTH: {self.max_depth} must be >= 1")
        if not 0 <= self.load_chunks <= 1024:
            raise ValueError(f"FERRY_AFFINITY_LOAD_CHUNKS: {self.load_chunks} must be 0..1024")

    @classmethod
    def from_env(cls) -> AffinitySettings:
        on = os.environ.get("FERRY_PREFIX_AFFINITY", "1").strip().lower()
        if on not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise ValueError(f"FERRY_PREFIX_AFFINITY: {on!r} must be 0 or 1")
        return cls(enabled=on in ("1", "true", "on", "yes"),
                   steal_ms=int(os.environ.get("FERRY_AFFINITY_STEAL_MS", "250")),
                   max_depth=int(os.environ.get("FERRY_AFFINITY_MAX_DEPTH", "8")),
                   load_chunks=float(os.environ.get("FERRY_AFFINITY_LOAD_CHUNKS", "1")))


class Router:
    """Marks requests for one producer (not thread-safe: one per client)."""

    def __init__(self, keys: Keys, settings: AffinitySettings | None = None) -> None:
        self.keys = keys
        self.settings = settings or AffinitySettings.from_env()
        self._workers: list[str] = []
        self._listed_at = -math.inf
        self._marks: dict[str, list[float]] = {}  # worker -> wall times of recent marks
        self.marked = 0
        self.unmarked = 0

    def _list_due(self, now: float) -> bool:
        return now - self._listed_at >= _LIST_EVERY_S

    def _listed(self, ids: Any, now: float) -> None:
        self._workers = sorted(_as_str(i) for i in ids or [])
        self._listed_at = now

    def _queue_reads(self, pipe: Any, hashes: list[str]) -> list[str]:
        for worker in self._workers:
            pipe.get(self.keys.worker(worker))
            pipe.zmscore(self.keys.affinity(worker), hashes)
        return list(self._workers)

    def _decide(self, workers: list[str], replies: list[Any]) -> bytes:
        candidates = []
        for i, worker in enumerate(workers):
            raw, scores = replies[2 * i], replies[2 * i + 1]
            if raw is None:  # no heartbeat: dead, or gone
                continue
            try:
                beat = decode_heartbeat(raw)
            except ProtocolError:
                continue
            now = time.time()
            recent = [t for t in self._marks.get(worker, [])
                      if t > beat.updated_at and t > now - BURST_S]
            self._marks[worker] = recent
            pending = len(recent)
            stats = beat.stats
            depth = int(stats.get("queued", 0)) + int(stats.get("waiting", 0)) + pending
            candidates.append(Candidate(worker, leading(scores), depth,
                                        bool(stats.get("draining", 0)),
                                        int(stats.get("running", 0))))
        best = choose(candidates, self.settings.max_depth, self.settings.load_chunks)
        if best is None:
            self.unmarked += 1
            return b""
        now = time.time()
        self._marks.setdefault(best.worker_id, []).append(now)
        self.marked += 1
        now_ms = int(now * 1000)
        return mark(best.worker_id, now_ms, now_ms + self.settings.steal_ms)

    def mark_for(self, redis: Any, request: GenerateRequest) -> bytes:
        """The mark for ``request`` (sync client), or b'' (off, no holder, any error)."""
        hashes = prefix_chunks(request) if self.settings.enabled else []
        if not hashes:
            return b""
        try:
            now = time.monotonic()
            if self._list_due(now):
                self._listed(redis.smembers(self.keys.workers), now)
            pipe = redis.pipeline(transaction=False)
            workers = self._queue_reads(pipe, hashes)
            return self._decide(workers, pipe.execute()) if workers else b""
        except Exception:  # affinity is an optimisation: never fail an enqueue for it
            self.unmarked += 1
            return b""

    async def amark_for(self, redis: Any, request: GenerateRequest) -> bytes:
        """``mark_for`` for an asyncio client."""
        hashes = prefix_chunks(request) if self.settings.enabled else []
        if not hashes:
            return b""
        try:
            now = time.monotonic()
            if self._list_due(now):
                self._listed(await redis.smembers(self.keys.workers), now)
            pipe = redis.pipeline(transaction=False)
            workers = self._queue_reads(pipe, hashes)
            return self._decide(workers, await pipe.execute()) if workers else b""
        except Exception:
            self.unmarked += 1
            return b""
