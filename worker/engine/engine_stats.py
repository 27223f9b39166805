"""The engine's counters: ``EngineStats`` (heartbeats, Prometheus, ``ferry top``), how
one is read from an engine, and ``StepTimer``, the wall time of each step phase.

Gathered here rather than in ``engine.py`` because they read every part of the engine
(scheduler, block manager and its host tier, the runner's health) and change with each
feature that adds a counter, while the engine's loop does not. Imports nothing heavy: the
service's metrics read ``EngineStats`` without torch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from worker.engine.health import EngineHealth
    from worker.engine.kv.block_manager import BlockManager
    from worker.engine.sched.scheduler import Scheduler


@dataclass
class EngineStats:
    """A snapshot for heartbeats, metrics and ``ferry top``."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    tokens_generated: int
    steps: int
    prefix_cache_queries: int = 0  # tokens looked up when requests were admitted
    prefix_cache_hits: int = 0  # of which found in the prefix cache (not computed)
    kv_blocks_cached: int = 0  # blocks holding a reusable prefix (held or evictable)
    # The KV host tier (kv/host_tier.py): hits taken from it (tokens, also counted in
    # prefix_cache_hits), blocks it holds, its size in blocks (0: off).
    prefix_cache_host_hits: int = 0
    kv_host_blocks_cached: int = 0
    kv_host_blocks_total: int = 0
    # Degraded states (worker/engine/health.py: DEGRADED_REASONS), empty when healthy, and
    # whether pure-decode steps replay CUDA graphs.
    degraded: tuple[str, ...] = ()
    decode_graphs_active: bool = False
    # Speculative decoding: draft tokens verified, of which accepted, and the
    # row-steps that carried drafts (each yields accepted + 1 tokens), and the draft tokens
    # cut before verification because a request's grammar rejected them
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_rows: int = 0
    spec_store_rows: int = 0  # ... whose draft came from past outputs (fleet's too)
    spec_grammar_cut_tokens: int = 0
    spec_backoff_cut_tokens: int = 0  # ... and because the back-off found them not worth it

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a drafted row gets per step on average (1 to k + 1; 0: no drafts)."""
        return (self.spec_accepted_tokens + self.spec_draft_rows) / self.spec_draft_rows \
            if self.spec_draft_rows else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0


class StepTimer:
    """Cumulative wall time per engine phase, for profiles and the step-time metric."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.totals.clear()


class SpecCounters(Protocol):
    """The speculative counters ``EngineStats`` carries (``SpecDecoding`` keeps them)."""

    drafted_tokens: int
    accepted_tokens: int
    draft_rows: int
    store_rows: int
    grammar_cut_tokens: int
    backoff_cut_tokens: int


def engine_stats(scheduler: Scheduler, bm: BlockManager, health: EngineHealth,
                 spec: SpecCounters | None, tokens_generated: int, steps: int) -> EngineStats:
    """The engine's counters now, read off its parts (``Engine.stats``)."""
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
        num_preemptions=scheduler.num_preemptions,
        tokens_generated=tokens_generated, steps=steps,
        prefix_cache_queries=bm.stats.queries, prefix_cache_hits=bm.stats.hits,
        kv_blocks_cached=bm.num_cached_blocks, **_tier_stats(bm), **_spec_stats(spec),
        degraded=tuple(sorted(health.reasons)), decode_graphs_active=health.decode_graphs_active,
    )


def _tier_stats(bm: BlockManager) -> dict[str, int]:
    tier = bm.tier
    if tier is None:
        return {}
    return {"prefix_cache_host_hits": tier.stats.hit_tokens,
            "kv_host_blocks_cached": tier.num_cached, "kv_host_blocks_total": tier.num_blocks}


def _spec_stats(spec: SpecCounters | None) -> dict[str, int]:
    if spec is None:
        return {}
    return {"spec_drafted_tokens": spec.drafted_tokens,
            "spec_accepted_tokens": spec.accepted_tokens, "spec_draft_rows": spec.draft_rows,
            "spec_store_rows": spec.store_rows,
            "spec_grammar_cut_tokens": spec.grammar_cut_tokens,
            "spec_backoff_cut_tokens": spec.backoff_cut_tokens}
