"""The worker's prefix-affinity parts, built from the engine and ``FERRY_PREFIX_AFFINITY``
(off, or the engine's prefix cache off: no board is written, and producers never mark a
request for this worker)."""

from __future__ import annotations

from typing import Any

from protocol.affinity.router import AffinitySettings
from worker.service.affinity.board_writer import BoardWriter
from worker.service.affinity.book import AffinityBook
from worker.service.metrics.affinity import AffinityMetrics
from worker.service.metrics.prometheus import WorkerMetrics
from worker.service.redis.connection import WorkerSettings

BACKSTOP = 2
"""The book's weight bound, in multiples of the prefix cache's tokens: the engine's
evictions drop chunks exactly, so the bound only catches what they cannot report (a chunk
booked whose prompt was never prefilled), and must not drop chunks the cache still holds
when the book's token estimate runs high."""


def affinity_board(engine: Any, settings: WorkerSettings, metrics: WorkerMetrics
                   ) -> BoardWriter | None:
    """The board writer (its book and metrics with it), or None when affinity is off; on,
    the engine starts listing the blocks its prefix cache lets go (the engine loop drains
    them into the book). The book's bound is ``BACKSTOP`` times the prefix cache's size,
    device and host tier, in tokens. A worker without a prefix cache holds no prefix, so
    it advertises none."""
    if not AffinitySettings.from_env().enabled or not engine.config.cache.enable_prefix_caching:
        return None
    stats = engine.stats()
    blocks = stats.kv_blocks_total + stats.kv_host_blocks_total
    capacity = BACKSTOP * blocks * engine.config.cache.block_size
    engine.track_evictions()
    return BoardWriter(settings, AffinityBook(capacity), AffinityMetrics(metrics.registry))
