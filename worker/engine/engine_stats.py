"""``EngineStats``: a snapshot of the engine's counters, for heartbeats, Prometheus and
``ferry top`` (``Engine.stats`` takes one off the engine's parts).

Apart from ``engine.py`` because the service reads it without torch: this module imports
nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass


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
