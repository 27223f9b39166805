"""The engine's part of the worker metrics: batch, KV cache, prefix cache and degraded state.

Why apart from ``metrics.py``: these are the numbers the engine itself keeps, refreshed
from its ``EngineStats`` snapshot (``update``), while ``WorkerMetrics`` holds what the
service sees around it (queue, requests, latencies, tenants). Torch-free, like
``metrics.py``.

Counters that the engine also keeps cumulatively (output tokens, preemptions) can be fed
either event by event (``tokens.add``, ``preempted.add``) or from a snapshot (``update``);
both paths advance one baseline (``Cumulative``), so calling both never double counts.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

from worker.engine import (
    DEGRADED_REASONS,  # torch-free
    EngineStats,  # a plain dataclass: no torch
)


class Cumulative:
    """Turns a cumulative engine total into counter increments without double counting."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = 0  # the engine's total last caught up with
        self.total = 0  # every increment so far: the counter's value, monotonic
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        if n <= 0:
            return
        with self.lock:
            self.counter.inc(n)
            self.seen += n
            self.total += n

    def sync(self, total: int) -> None:
        with self.lock:
            if total < self.seen and total == 0:
                self.seen = 0  # a fresh engine restarted its count
            elif total > self.seen:
                self.counter.inc(total - self.seen)
                self.total += total - self.seen
                self.seen = total


class EngineMetrics:
    """The engine's gauges and counters on ``registry``, names starting with ``prefix``."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self._build_gauges(registry, prefix)
        self._build_counters(registry, prefix)
        self.tokens = Cumulative(self.output_tokens)
        self.preempted = Cumulative(self.preemptions)
        self._prefix_queries = Cumulative(self.prefix_queries)
        self._prefix_hits = Cumulative(self.prefix_hits)
        self._prefix_host_hits = Cumulative(self.prefix_host_hits)
        self._spec = [(Cumulative(self.spec_drafted), "spec_drafted_tokens"),
                      (Cumulative(self.spec_accepted), "spec_accepted_tokens"),
                      (Cumulative(self.spec_draft_rows), "spec_draft_rows"),
                      (Cumulative(self.spec_store_rows), "spec_store_rows"),
                      (Cumulative(self.spec_grammar_cut), "spec_grammar_cut_tokens")]

    def totals(self) -> dict[str, int]:
        """The cumulative counts vLLM's counters show (``observability.vllm_metrics``
        ``COUNTERS`` keys): these counters' values, monotonic across engine restarts."""
        return {"generation_tokens": self.tokens.total, "preemptions": self.preempted.total,
                "prefix_queries": self._prefix_queries.total,
                "prefix_hits": self._prefix_hits.total}

    def _build_gauges(self, reg: CollectorRegistry, p: str) -> None:
        self.running = Gauge(p + "running_requests", "Requests in the running batch.", registry=reg)
        self.waiting = Gauge(
            p + "waiting_requests",
            "Requests taken from the stream, waiting for a batch slot.",
            registry=reg,
        )
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use.", registry=reg)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV cache blocks free.", registry=reg)
        self.kv_usage = Gauge(
            p + "kv_cache_usage_ratio", "Used / total KV cache blocks (0..1).", registry=reg
        )
        self.kv_cached = Gauge(
            p + "kv_blocks_cached",
            "KV blocks holding a reusable prefix (held by requests or evictable).",
            registry=reg,
        )
        self.kv_host_cached = Gauge(
            p + "kv_host_blocks_cached", "KV blocks held by the host tier.", registry=reg)
        self.decode_graphs_active = Gauge(
            p + "decode_graphs_active",
            "1 when pure-decode steps replay CUDA graphs (0 on a CPU, with "
            "FERRY_ENFORCE_EAGER, or when capture failed: see ferry_worker_degraded).",
            registry=reg,
        )
        self.degraded = Gauge(
            p + "degraded",
            "1 per reason the worker serves slower than it should (graphs unavailable or "
            "mismatched, a kernel that failed, the torch attention fallback on a CPU).",
            ["reason"], registry=reg,
        )
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason)  # every reason exported, 0 when healthy

    def _build_counters(self, reg: CollectorRegistry, p: str) -> None:
        self.output_tokens = Counter(
            p + "output_tokens", "Generated tokens; tokens/s = rate().", registry=reg
        )
        self.preemptions = Counter(
            p + "preemptions", "Requests preempted (KV blocks ran out).", registry=reg
        )
        self.prefix_queries = Counter(
            p + "prefix_cache_queries",
            "Tokens of requests admitted from scratch (prefix-cache lookups).", registry=reg
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits",
            "Tokens served from the prefix cache instead of computed; hit rate = "
            "rate(hits) / rate(queries).", registry=reg
        )
        self.prefix_host_hits = Counter(
            p + "prefix_cache_host_hits",
            "Of the prefix-cache hits, tokens copied back from the KV host tier.", registry=reg
        )
        self.spec_drafted = Counter(
            p + "spec_drafted_tokens", "Speculative draft tokens verified.", registry=reg)
        self.spec_accepted = Counter(
            p + "spec_accepted_tokens", "Of the draft tokens, accepted; acceptance rate = "
            "rate(accepted) / rate(drafted).", registry=reg)
        self.spec_draft_rows = Counter(
            p + "spec_draft_rows", "Row-steps that carried drafts; tokens per drafted "
            "row-step = 1 + rate(accepted) / rate(draft_rows).", registry=reg)
        self.spec_store_rows = Counter(
            p + "spec_store_rows", "Of the drafted row-steps, drafted from the store of past "
            "outputs (the fleet's included) rather than the request's own text.", registry=reg)
        self.spec_grammar_cut = Counter(
            p + "spec_grammar_cut_tokens", "Draft tokens a request's grammar rejected before "
            "verification (never verified).", registry=reg)

    def update(self, stats: EngineStats) -> None:
        """Refresh batch/KV gauges and catch counters up with the engine's cumulative totals."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        self.kv_used.set(used)
        self.kv_free.set(stats.kv_blocks_free)
        self.kv_usage.set(used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.tokens.sync(stats.tokens_generated)
        self.preempted.sync(stats.num_preemptions)
        self.kv_cached.set(getattr(stats, "kv_blocks_cached", 0))
        self._prefix_queries.sync(getattr(stats, "prefix_cache_queries", 0))
        self._prefix_hits.sync(getattr(stats, "prefix_cache_hits", 0))
        self._prefix_host_hits.sync(getattr(stats, "prefix_cache_host_hits", 0))
        for counter, name in self._spec:
            counter.sync(getattr(stats, name, 0))
        self.kv_host_cached.set(getattr(stats, "kv_host_blocks_cached", 0))
        self.decode_graphs_active.set(int(getattr(stats, "decode_graphs_active", False)))
        degraded = set(getattr(stats, "degraded", ()))
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason).set(int(reason in degraded))
