"""The engine's counters as one ``EngineStats`` (heartbeats, Prometheus, ``ferry top``).

Gathered here rather than in ``engine.py`` because they read every part of the engine
(scheduler, block manager and its host tier, the runner's health) and change with each
feature that adds a counter, while the engine's loop does not.
"""

from __future__ import annotations

from typing import Any

from worker.engine.output.outputs import EngineStats


def engine_stats(engine: Any) -> EngineStats:
    """``engine``: an ``Engine`` (typed loosely: engine.py imports this module)."""
    bm, scheduler, health = engine.block_manager, engine.scheduler, engine.runner.health
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
        num_preemptions=scheduler.num_preemptions,
        tokens_generated=engine.tokens_generated, steps=engine.steps,
        prefix_cache_queries=bm.stats.queries, prefix_cache_hits=bm.stats.hits,
        kv_blocks_cached=bm.num_cached_blocks, **_tier_stats(engine), **_spec_stats(engine),
        degraded=health.degraded, decode_graphs_active=health.decode_graphs_active,
    )


def _tier_stats(engine: Any) -> dict[str, int]:
    tier = engine.block_manager.tier
    if tier is None:
        return {}
    return {"prefix_cache_host_hits": tier.stats.hit_tokens,
            "kv_host_blocks_cached": tier.num_cached, "kv_host_blocks_total": tier.num_blocks}


def _spec_stats(engine: Any) -> dict[str, int]:
    spec = engine.spec
    if spec is None:
        return {}
    return {"spec_drafted_tokens": spec.drafted_tokens,
            "spec_accepted_tokens": spec.accepted_tokens, "spec_draft_rows": spec.draft_rows,
            "spec_store_rows": spec.store_rows,
            "spec_grammar_cut_tokens": spec.grammar_cut_tokens,
            "spec_backoff_cut_tokens": spec.backoff_cut_tokens}
