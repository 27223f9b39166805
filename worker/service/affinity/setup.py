"""The worker's prefix-affinity parts, built from the engine and ``FERRY_PREFIX_AFFINITY``
(off: no board is written, and producers never mark a request for this worker)."""

from __future__ import annotations

from typing import Any

from protocol.affinity.router import AffinitySettings
from worker.service.affinity.board_writer import BoardWriter
from worker.service.affinity.book import AffinityBook
from worker.service.metrics.affinity import AffinityMetrics
from worker.service.metrics.prometheus import WorkerMetrics
from worker.service.redis.connection import WorkerSettings


def affinity_board(engine: Any, settings: WorkerSettings, metrics: WorkerMetrics
                   ) -> BoardWriter | None:
    """The board writer (its book and metrics with it), or None when affinity is off. The
    book's capacity is the prefix cache's, device and host tier, in tokens."""
    if not AffinitySettings.from_env().enabled:
        return None
    stats = engine.stats()
    blocks = stats.kv_blocks_total + stats.kv_host_blocks_total
    capacity = blocks * engine.config.cache.block_size
    return BoardWriter(settings, AffinityBook(capacity), AffinityMetrics(metrics.registry))
