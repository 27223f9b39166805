"""The service's numbers, for the heartbeat (``ferry top``, readiness) and Prometheus.

The engine loop writes (``engine_stats``, the engine's snapshot, stored after every
iteration; ``finished`` per request: plain attribute stores and metric updates, no I/O);
the control thread reads a consistent-enough snapshot once per heartbeat. Reading a
reference another thread replaced is atomic in CPython, so no lock is needed on the
engine loop's side. The snapshot is stored, not fetched through a method here: taking it
is the engine's (``Engine.stats``), on the loop's thread, and the book only keeps it.

The book takes what it reads as arguments (the first engine snapshot, the metrics, and a
``ServiceCounters`` per heartbeat) rather than the service object, so it depends on
nothing above it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from protocol.tenants.ids import DEFAULT_TENANT
from worker.engine import EngineStats
from worker.service.active_job import ActiveJob
from worker.service.intake.fair_ledger import FairLedger
from worker.service.jobs import Outgoing
from worker.service.metrics.prometheus import WorkerMetrics

_RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class ServiceCounters:
    """The service-side numbers of one heartbeat, read by the control thread."""

    slots_held: int  # requests this worker owns (on their way, waiting or running)
    max_num_seqs: int
    entries_held: int  # stream entries under lease
    queue_depth: int
    queue_lag: int
    reclaimed: int  # cumulative
    dead_lettered: int  # cumulative
    outbox_depth: int
    draining: bool
    metrics_port: int = 0  # the port /metrics is served on (0: off)


class StatsBook:
    def __init__(self, engine_stats: EngineStats, metrics: WorkerMetrics,
                 ledger: FairLedger | None = None) -> None:
        self.metrics = metrics
        self.ledger = ledger or FairLedger()
        self.engine_stats = engine_stats  # the engine loop stores each iteration's
        self._samples: deque[tuple[float, int]] = deque()
        self._reported = {"reclaimed": 0, "dead_lettered": 0}

    def finished(self, job: ActiveJob, item: Outgoing) -> None:
        """Engine loop: a request ended; record its outcome and latencies."""
        fields = finished_fields(job, item)
        if fields is not None:
            self.record(*fields)

    def record(self, stream: str, tenant: str, reason: str, ttft_s: float | None,
               total_s: float, queued_s: float, prompt: int, completion: int,
               charged: int) -> None:
        """A request's outcome (``finished_fields``; the output process sends them)."""
        self.metrics.request_finished(reason, ttft_s, total_s, queued_s, completion, prompt)
        self.metrics.tenant_finished(tenant, prompt, completion, queued_s)
        self.ledger.note(stream, tenant, prompt + completion, charged)

    def _tokens_per_s(self, tokens: int) -> float:
        now = time.monotonic()
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return round((tokens - n0) / (now - t0), 2) if now > t0 else 0.0

    def heartbeat_stats(self, c: ServiceCounters) -> dict[str, float | int | str]:
        """Control thread: the heartbeat's ``stats``; also pushes gauges to Prometheus."""
        s, metrics = self.engine_stats, self.metrics
        metrics.set_engine(s)
        metrics.set_queue(c.queue_depth, c.queue_lag)
        for name, total in (("reclaimed", c.reclaimed), ("dead_lettered", c.dead_lettered)):
            delta = total - self._reported[name]
            if delta > 0:
                getattr(metrics, name)(delta)
                self._reported[name] = total
        used = s.kv_blocks_total - s.kv_blocks_free
        usage = round(used / s.kv_blocks_total, 4) if s.kv_blocks_total else 0.0
        queued = max(0, c.slots_held - s.num_running - s.num_waiting)
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "queued": queued,
            "held": c.entries_held,
            "max_num_seqs": c.max_num_seqs,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_blocks_free": s.kv_blocks_free,
            "kv_usage": usage,
            "tokens_per_s": self._tokens_per_s(s.tokens_generated),
            "tokens_generated": s.tokens_generated,
            "steps": s.steps,
            "preemptions": s.num_preemptions,
            "prefix_hit_rate": round(s.prefix_cache_hit_rate, 4),
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "kv_blocks_cached": s.kv_blocks_cached,
            "prefix_cache_host_hits": s.prefix_cache_host_hits,
            "kv_host_blocks_cached": s.kv_host_blocks_cached,
            "kv_host_blocks_total": s.kv_host_blocks_total,
            "queue_lag": c.queue_lag,
            "reclaimed": c.reclaimed,
            "dead_lettered": c.dead_lettered,
            "outbox_depth": c.outbox_depth,
            "draining": int(c.draining),
            "metrics_port": c.metrics_port,
            "decode_graphs": int(s.decode_graphs_active),
            # speculative decoding: tokens a drafted row gets per step (0: no drafts yet)
            "spec_accept_len": round(s.spec_mean_acceptance_length, 2),
            "spec_draft_rows": s.spec_draft_rows,  # ... of which drafted from past outputs:
            "spec_store_rows": s.spec_store_rows,
            # comma-separated health.DEGRADED_REASONS; "" when healthy (ferry top marks it)
            "degraded": ",".join(s.degraded),
            # vLLM's names for this worker (the gateway's fleet view): waiting = taken from
            # the stream and not yet running (its engine's queue and the entries on their way)
            "vllm": metrics.vllm_heartbeat(s.num_running, s.num_waiting + queued, usage),
        }


def finished_fields(job: ActiveJob, item: Outgoing) -> list[Any] | None:
    """``StatsBook.record``'s arguments for a terminal event (None: not one)."""
    event = item.event
    if event is None or event.finish_reason is None:
        return None
    timings, usage = event.timings, event.usage
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    return [job.entry[0], job.request.tenant or DEFAULT_TENANT, event.finish_reason,
            timings.ttft_s if timings else None, (timings.total_s or 0.0) if timings else 0.0,
            (timings.queued_s or 0.0) if timings else 0.0, prompt, completion, job.charged]
