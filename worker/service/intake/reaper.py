"""The intake's reaper: entries idle past the lease taken over (XAUTOCLAIM), and the
entries of workers known dead handed back first, so they are taken at once.

A worker that dies without draining (kill -9, OOM, a lost node) leaves its entries
pending under its consumer name. Once per heartbeat interval the reaper looks for such
consumers (idle on the lanes and without a live heartbeat: ``leases.dead_consumers``) and
hands their entries back, so that its own next pass claims them instead of waiting out
the lease: a dead container's requests move within about one heartbeat TTL. Whoever hands
entries back (this reaper, another worker's, or ``ferry up`` reaping a dead process) bumps
the fleet's ``handbacks`` counter, which every reaper reads with that scan: a pass is then
due at once, so handed-back entries wait about one heartbeat interval, not a reap
interval. The claim itself (XAUTOCLAIM past ``lease_s``) scans the lanes highest first,
resuming where the last partial scan stopped. On a Redis Cluster all of it runs shard by
shard through the ``ShardGate``: a lost shard's entries wait for the shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from worker.service.redis.connection import WorkerSettings, text
from worker.service.redis.leases import hand_back_consumer, idle_consumers, without_heartbeat
from worker.service.redis.shard_gate import ShardGate

log = structlog.get_logger("ferry.worker.intake")

Process = Callable[[str, list[Any], dict[str, int]], None]


class Reaper:
    """Run by the intake thread, on its connection; ``process`` starts what it claims."""

    def __init__(self, settings: WorkerSettings, redis: Any, gate: ShardGate,
                 process: Process) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = redis
        self.gate = gate
        self.process = process
        self.streams = self.keys.request_streams  # highest priority first (lane-major)
        self.reclaimed = 0
        self._cursors = {stream: "0-0" for stream in self.streams}
        self._next_reap = 0.0
        self._next_rescue = 0.0
        self._handbacks: Any = None  # the fleet's hand-back counter as last read

    def run(self, limit: int) -> int:
        """Hand back dead workers' entries (when due), then claim up to ``limit`` entries
        (when due); returns how many were claimed."""
        if time.monotonic() >= self._next_rescue:
            self.rescue_dead_workers()
        return self.reap(limit) if time.monotonic() >= self._next_reap else 0

    def rescue_dead_workers(self) -> None:
        """Hand back the entries of consumers whose worker is gone, shard by shard."""
        self._next_rescue = time.monotonic() + self.settings.heartbeat_interval_s
        run, me, r, keys = self.gate.run, self.settings.worker_id, self.redis, self.keys
        handbacks = run(self.gate.fleet_shard, r.get, keys.handbacks, default=None, redis=r)
        if handbacks != self._handbacks:  # another worker or ``ferry up`` handed some back
            self._handbacks, self._next_reap = handbacks, 0.0
        suspects: dict[str, list[int]] = {}  # consumer -> the shards it holds entries on
        for k in range(keys.shards):
            for name in run(k, idle_consumers, r, keys, me, self.settings.liveness_ms,
                            keys.shard_streams(k), default=set[str](), redis=r):
                suspects.setdefault(name, []).append(k)
        for consumer in run(self.gate.fleet_shard, without_heartbeat, r, keys,
                            sorted(suspects), default=list[str](), redis=r):
            handed = sum(run(k, hand_back_consumer, r, keys, consumer, 1000,
                             keys.shard_streams(k), default=0, redis=r)
                         for k in suspects[consumer])
            log.warning("dead_worker_entries_handed_back", consumer=consumer, entries=handed)
            self._next_reap = 0.0

    def reap(self, limit: int) -> int:
        """Claim up to ``limit`` entries idle past the lease, highest lane first (the lanes
        of a lost shard are skipped: what they hold waits for the shard)."""
        total = 0
        wrapped = True
        for stream in self.streams:
            if total >= limit:
                wrapped = False
                break
            total += self.gate.run(self.gate.shard_of_stream(stream), self._reap_stream,
                                   stream, limit - total, default=0, redis=self.redis)
            wrapped = wrapped and self._cursors[stream] == "0-0"
        # A partial scan continues on the next pass; a full one waits for the interval.
        self._next_reap = time.monotonic() + (self.settings.reap_interval_s if wrapped else 0)
        return total

    def _reap_stream(self, stream: str, count: int) -> int:
        next_id, claimed, *_ = self.redis.xautoclaim(
            stream, self.keys.group, self.settings.worker_id,
            min_idle_time=self.settings.lease_ms, start_id=self._cursors[stream], count=count,
        )
        self._cursors[stream] = text(next_id)
        if claimed:
            self.process(stream, claimed, self._deliveries(stream, claimed))
        return len(claimed)

    def _deliveries(self, stream: str, claimed: list[Any]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _fields in claimed:
            pipe.xpending_range(stream, self.keys.group, entry_id, entry_id, 1)
        deliveries = {}
        for (entry_id, _fields), rows in zip(claimed, pipe.execute(), strict=True):
            deliveries[text(entry_id)] = int(rows[0]["times_delivered"]) if rows else 1
        self.reclaimed += len(claimed)
        log.info("entries_reclaimed", count=len(claimed), stream=stream,
                 ids=list(deliveries)[:8])
        return deliveries
