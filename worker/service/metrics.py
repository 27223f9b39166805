"""Prometheus metrics of one worker process (names start with ``ferry_worker_``).

Why a class with its own registry: tests (and ``ferry up``, which may run several workers in
one process tree) build many workers; a per-instance ``CollectorRegistry`` keeps them from
colliding on the global default registry. Torch-free so the metrics endpoint, ``ferry top``
and the tests import it without loading a GPU stack.

Counters that the engine also keeps cumulatively (output tokens, preemptions) can be fed
either event by event (``observe_step``, ``preempted``) or from an ``EngineStats`` snapshot
(``set_engine``); both paths advance one baseline, so calling both never double counts.
"""

from __future__ import annotations

import errno
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from worker.engine.health import DEGRADED_REASONS  # torch-free
from worker.engine.outputs import EngineStats  # a plain dataclass: no torch

PREFIX = "ferry_worker_"
METRICS_PORT_TRIES = 64
"""Ports tried from the configured one when it is taken (see ``WorkerMetrics.serve``)."""
OUTCOMES = ("stop", "length", "cancelled", "timeout", "error", "abort")
"""Finish reasons of the protocol; used as the ``outcome`` label values."""

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _Cumulative:
    """Turns a cumulative engine total into counter increments without double counting."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        if n <= 0:
            return
        with self.lock:
            self.counter.inc(n)
            self.seen += n

    def sync(self, total: int) -> None:
        with self.lock:
            if total < self.seen and total == 0:
                self.seen = 0  # a fresh engine restarted its count
            elif total > self.seen:
                self.counter.inc(total - self.seen)
                self.seen = total


class WorkerMetrics:
    """All worker metrics; cheap to call from the engine loop (no I/O, no allocation)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._build_gauges()
        self._build_counters()
        self._build_histograms()
        self._build_tenant_metrics()
        self._tokens = _Cumulative(self.output_tokens)
        self._preemptions = _Cumulative(self.preemptions)
        self._prefix_queries = _Cumulative(self.prefix_queries)
        self._prefix_hits = _Cumulative(self.prefix_hits)
        self._prefix_host_hits = _Cumulative(self.prefix_host_hits)

    def _build_gauges(self) -> None:
        reg, p = self.registry, PREFIX
        self.queue_depth = Gauge(
            p + "queue_depth", "Entries in the request stream (XLEN).", registry=reg
        )
        self.queue_lag = Gauge(
            p + "queue_lag",
            "Stream entries not yet delivered to the consumer group (XINFO GROUPS lag).",
            registry=reg,
        )
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

    def _build_counters(self) -> None:
        reg, p = self.registry, PREFIX
        self.requests = Counter(
            p + "requests",
            "Finished requests by outcome (finish reason).",
            ["outcome"],
            registry=reg,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros so rate() works from the start
        self.output_tokens = Counter(
            p + "output_tokens", "Generated tokens; tokens/s = rate().", registry=reg
        )
        self.preemptions = Counter(
            p + "preemptions", "Requests preempted (KV blocks ran out).", registry=reg
        )
        self.reclaimed_total = Counter(
            p + "reclaimed",
            "Stream deliveries reclaimed from dead consumers (XAUTOCLAIM).",
            registry=reg,
        )
        self.dead_letters = Counter(
            p + "dead_letters", "Stream entries moved to the dead-letter stream.", registry=reg
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
        self.kv_host_cached = Gauge(
            p + "kv_host_blocks_cached", "KV blocks held by the host tier.", registry=reg)

    def _build_tenant_metrics(self) -> None:
        reg, p = self.registry, PREFIX
        self.tenant_requests = Counter(
            p + "tenant_requests", "Requests that ended here, by tenant.", ["tenant"],
            registry=reg)
        self.tenant_tokens = Counter(
            p + "tenant_tokens", "Tokens served, by tenant and kind (prompt, completion).",
            ["tenant", "kind"], registry=reg)
        self.tenant_queued = Histogram(
            p + "tenant_queue_time_seconds", "From enqueue until the worker started the "
            "request, by tenant.", ["tenant"], buckets=_LATENCY_BUCKETS, registry=reg)

    def _build_histograms(self) -> None:
        reg, p = self.registry, PREFIX
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "From enqueue (created_at) to the first token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.inter_token = Histogram(
            p + "inter_token_latency_seconds",
            "Time between two tokens of one request.",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            p + "e2e_latency_seconds",
            "From enqueue (created_at) to the terminal event.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queued = Histogram(
            p + "queue_time_seconds",
            "From enqueue until the worker started the request.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.request_tokens = Histogram(
            p + "request_output_tokens",
            "Output tokens per finished request.",
            buckets=_TOKENS_BUCKETS,
            registry=reg,
        )
        self.step = Histogram(
            p + "step_seconds",
            "Duration of one engine step (schedule, forward, sample).",
            buckets=_STEP_BUCKETS,
            registry=reg,
        )

    def serve(self, port: int, host: str = "127.0.0.1", tries: int = METRICS_PORT_TRIES
              ) -> int:
        """Expose ``/metrics`` on ``host`` in a daemon thread, on the first free port from
        ``port``; returns the port (``0``: off). Loopback by default (prometheus_client's
        own default is every interface): deployments that scrape from elsewhere pass
        ``--metrics-host 0.0.0.0``. Workers scaled on one host network (compose with
        ``network_mode: host``) all ask for the same port: each takes the next free one
        instead of dying at start, and says which in its log and heartbeat."""
        if not port:
            return 0
        for candidate in range(port, min(port + tries, 65536)):
            try:
                start_http_server(candidate, addr=host, registry=self.registry)
                return candidate
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise OSError(errno.EADDRINUSE, f"metrics: ports {port}-{port + tries - 1} are taken")

    def render(self) -> bytes:
        """The text exposition (what ``/metrics`` returns); used by tests and ``ferry up``."""
        return generate_latest(self.registry)

    def observe_step(self, duration_s: float, num_tokens: int) -> None:
        """One engine step that took ``duration_s`` and sampled ``num_tokens`` output tokens."""
        self.step.observe(duration_s)
        self._tokens.add(num_tokens)

    def request_finished(
        self,
        outcome: str,
        ttft_s: float | None,
        e2e_s: float,
        queued_s: float,
        output_tokens: int,
    ) -> None:
        """A request reached its terminal event; ``outcome`` is its finish reason."""
        self.requests.labels(outcome).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.queued.observe(queued_s)
        self.request_tokens.observe(output_tokens)

    def tenant_finished(self, tenant: str, prompt_tokens: int, completion_tokens: int,
                        queued_s: float) -> None:
        """A request of ``tenant`` ended: its tokens and time in the queue, per tenant."""
        self.tenant_requests.labels(tenant).inc()
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, "completion").inc(completion_tokens)
        self.tenant_queued.labels(tenant).observe(queued_s)

    def observe_inter_token(self, seconds: float) -> None:
        """Gap between consecutive tokens of one request (TPOT for streaming clients)."""
        self.inter_token.observe(seconds)

    def set_engine(self, stats: EngineStats) -> None:
        """Refresh batch/KV gauges and catch counters up with the engine's cumulative totals."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        self.kv_used.set(used)
        self.kv_free.set(stats.kv_blocks_free)
        self.kv_usage.set(used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self._tokens.sync(stats.tokens_generated)
        self._preemptions.sync(stats.num_preemptions)
        self.kv_cached.set(getattr(stats, "kv_blocks_cached", 0))
        self._prefix_queries.sync(getattr(stats, "prefix_cache_queries", 0))
        self._prefix_hits.sync(getattr(stats, "prefix_cache_hits", 0))
        self._prefix_host_hits.sync(getattr(stats, "prefix_cache_host_hits", 0))
        self.kv_host_cached.set(getattr(stats, "kv_host_blocks_cached", 0))
        self.decode_graphs_active.set(int(getattr(stats, "decode_graphs_active", False)))
        degraded = set(getattr(stats, "degraded", ()))
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason).set(int(reason in degraded))

    def set_queue(self, depth: int, lag: int) -> None:
        """Stream length and the group's undelivered count, as last read from Redis."""
        self.queue_depth.set(depth)
        self.queue_lag.set(lag)

    def preempted(self, n: int) -> None:
        """``n`` requests were preempted in a step."""
        self._preemptions.add(n)

    def reclaimed(self, n: int = 1) -> None:
        """``n`` deliveries of dead consumers were claimed by this worker."""
        self.reclaimed_total.inc(n)

    def dead_lettered(self, n: int = 1) -> None:
        """``n`` malformed entries went to the dead-letter stream."""
        self.dead_letters.inc(n)
