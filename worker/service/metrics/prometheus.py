"""Prometheus metrics of one worker process (names start with ``ferry_worker_``).

Why a class with its own registry: tests (and ``ferry up``, which may run several workers in
one process tree) build many workers; a per-instance ``CollectorRegistry`` keeps them from
colliding on the global default registry. Torch-free so the metrics endpoint, ``ferry top``
and the tests import it without loading a GPU stack.

The engine's own numbers (batch, KV cache, prefix cache, degraded state) are built and
refreshed by ``engine_metrics.EngineMetrics`` (``self.engine``). Counters that the engine
also keeps cumulatively (output tokens, preemptions) can be fed either event by event
(``observe_step``, ``preempted``) or from an ``EngineStats`` snapshot (``set_engine``); both
paths advance one baseline, so calling both never double counts.

Beside its own names the worker exports vLLM's (``vllm:*``, ``observability.vllm_metrics``)
from one ``EngineTally`` labelled with its served model and worker id (``bind``); the
heartbeat carries the same tally (``vllm_heartbeat``) for the gateway's fleet view.
"""

from __future__ import annotations

import bisect
import errno

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from observability import vllm_metrics as vllm
from worker.engine import EngineStats  # a plain dataclass: no torch
from worker.service.metrics.engine import EngineMetrics

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
_GAP_BOUNDS = tuple(sorted({*_ITL_BUCKETS, *vllm.ITL_BUCKETS}))
"""Inter-token gaps are binned by both histograms' bounds (``GapBins``): each bin then falls
in exactly one bucket of either (``_GAP_TO_FERRY``, ``_GAP_TO_VLLM``)."""
_GAP_TO_FERRY = [bisect.bisect_left(_ITL_BUCKETS, b) for b in (*_GAP_BOUNDS, float("inf"))]
_GAP_TO_VLLM = [bisect.bisect_left(vllm.ITL_BUCKETS, b) for b in (*_GAP_BOUNDS, float("inf"))]


class WorkerMetrics:
    """All worker metrics; cheap to call from the engine loop (no I/O, no allocation)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._build_gauges()
        self.engine = EngineMetrics(self.registry, PREFIX)
        self._build_counters()
        self._build_histograms()
        self._build_tenant_metrics()
        self.vllm = vllm.EngineTally()
        self.labels = ("ferry", "0")  # (model_name, engine): see bind
        self.registry.register(vllm.TallyCollector(self._vllm_engines))

    def bind(self, model_name: str, engine: str) -> None:
        """The labels of the ``vllm:*`` series: the served model and the worker's id."""
        self.labels = (model_name, engine)

    def _vllm_engines(self) -> list[vllm.Engine]:
        self.vllm.counters.update(self.engine.totals())
        return [(*self.labels, self.vllm)]

    def vllm_heartbeat(self, running: int, waiting: int, kv_usage: float) -> str:
        """Set vLLM's gauges (``waiting``: taken from the stream and not yet running) and
        return the tally as the heartbeat's ``vllm`` stat."""
        tally = self.vllm
        tally.running, tally.waiting, tally.kv_usage = running, waiting, kv_usage
        tally.counters.update(self.engine.totals())
        return tally.encode()

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
        self.reclaimed_total = Counter(
            p + "reclaimed",
            "Stream deliveries reclaimed from dead consumers (XAUTOCLAIM).",
            registry=reg,
        )
        self.dead_letters = Counter(
            p + "dead_letters", "Stream entries moved to the dead-letter stream.", registry=reg
        )

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
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds",
                              "From enqueue (created_at) to the first token.", _TTFT_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds",
                                     "Time between two tokens of one request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_latency_seconds",
                             "From enqueue (created_at) to the terminal event.",
                             _LATENCY_BUCKETS)
        self.queued = histogram("queue_time_seconds",
                                "From enqueue until the worker started the request.",
                                _LATENCY_BUCKETS)
        self.request_tokens = histogram("request_output_tokens",
                                        "Output tokens per finished request.", _TOKENS_BUCKETS)
        self.step = histogram("step_seconds",
                              "Duration of one engine step (schedule, forward, sample).",
                              _STEP_BUCKETS)

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
        self.engine.tokens.add(num_tokens)

    def request_finished(
        self,
        outcome: str,
        ttft_s: float | None,
        e2e_s: float,
        queued_s: float,
        output_tokens: int,
        prompt_tokens: int = 0,
    ) -> None:
        """A request reached its terminal event; ``outcome`` is its finish reason."""
        self.vllm.finished(outcome, ttft_s, e2e_s, queued_s, prompt_tokens, output_tokens)
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
        self.vllm.bins["itl"].observe(seconds)

    def add_inter_token(self, counts: list[int], total: float) -> None:
        """Gaps an output process binned itself (``GapBins``), as ``observe`` would have:
        per bin of ``_GAP_BOUNDS`` (the first bound at or above the gap; not cumulative),
        and their sum; into both this worker's histogram and vLLM's."""
        hist, bins = self.inter_token, self.vllm.bins["itl"]
        for i, n in enumerate(counts):
            if n:
                hist._buckets[_GAP_TO_FERRY[i]].inc(n)  # type: ignore[attr-defined]
                bins.counts[_GAP_TO_VLLM[i]] += n
        hist._sum.inc(total)  # type: ignore[attr-defined]
        bins.total += total

    def set_engine(self, stats: EngineStats) -> None:
        """Refresh batch/KV gauges and catch counters up with the engine's cumulative totals."""
        self.engine.update(stats)

    def set_queue(self, depth: int, lag: int) -> None:
        """Stream length and the group's undelivered count, as last read from Redis."""
        self.queue_depth.set(depth)
        self.queue_lag.set(lag)

    def preempted(self, n: int) -> None:
        """``n`` requests were preempted in a step."""
        self.engine.preempted.add(n)

    def reclaimed(self, n: int = 1) -> None:
        """``n`` deliveries of dead consumers were claimed by this worker."""
        self.reclaimed_total.inc(n)

    def dead_lettered(self, n: int = 1) -> None:
        """``n`` malformed entries went to the dead-letter stream."""
        self.dead_letters.inc(n)


class GapBins:
    """Inter-token gaps binned where they are measured (the output process), sent to the
    worker's histogram once per pass (``WorkerMetrics.add_inter_token``)."""

    def __init__(self) -> None:
        self.bounds = [*_GAP_BOUNDS, float("inf")]
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe_inter_token(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def take(self) -> tuple[list[int], float] | None:
        """The gaps since the last call (None: none)."""
        if not any(self.counts):
            return None
        taken = (self.counts, self.total)
        self.counts, self.total = [0] * len(self.bounds), 0.0
        return taken
