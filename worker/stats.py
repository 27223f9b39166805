"""The service's numbers, for the heartbeat (``ferry top``, readiness) and Prometheus.

The engine loop writes (``refresh`` after every iteration, ``finished`` per request: plain
attribute stores and metric updates, no I/O); the control thread reads a consistent-enough
snapshot once per heartbeat. Reading a reference another thread replaced is atomic in
CPython, so no lock is needed on the engine loop's side.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from worker.jobs import ActiveJob, Outgoing

if TYPE_CHECKING:
    from worker.service import WorkerService

_RATE_WINDOW_S = 5.0


class StatsBook:
    def __init__(self, service: WorkerService) -> None:
        self.service = service
        self.engine_stats = service.engine.stats()
        self._samples: deque[tuple[float, int]] = deque()
        self._reported = {"reclaimed": 0, "dead_lettered": 0}

    def refresh(self) -> None:
        """Engine loop: take a fresh engine snapshot (cheap: counters and lengths)."""
        self.engine_stats = self.service.engine.stats()

    def finished(self, job: ActiveJob, item: Outgoing) -> None:
        """Engine loop: a request ended; record its outcome and latencies."""
        event = item.event
        if event is None or event.finish_reason is None:
            return
        timings, usage = event.timings, event.usage
        self.service.metrics.request_finished(
            event.finish_reason,
            timings.ttft_s if timings else None,
            (timings.total_s or 0.0) if timings else 0.0,
            (timings.queued_s or 0.0) if timings else 0.0,
            usage.completion_tokens if usage else 0,
        )

    def _tokens_per_s(self, tokens: int) -> float:
        now = time.monotonic()
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return round((tokens - n0) / (now - t0), 2) if now > t0 else 0.0

    def heartbeat_stats(self) -> dict[str, float | int | str]:
        """Control thread: the heartbeat's ``stats``; also pushes gauges to Prometheus."""
        svc, s = self.service, self.engine_stats
        control, intake, metrics = svc.control, svc.intake, svc.metrics
        metrics.set_engine(s)
        metrics.set_queue(control.queue_depth, control.queue_lag)
        for name, total in (("reclaimed", intake.reclaimed), ("dead_lettered", svc.dead.count)):
            delta = total - self._reported[name]
            if delta > 0:
                getattr(metrics, name)(delta)
                self._reported[name] = total
        used = s.kv_blocks_total - s.kv_blocks_free
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "queued": max(0, svc.slots.held - s.num_running - s.num_waiting),
            "held": len(svc.held),
            "max_num_seqs": svc.slots.total,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_blocks_free": s.kv_blocks_free,
            "kv_usage": round(used / s.kv_blocks_total, 4) if s.kv_blocks_total else 0.0,
            "tokens_per_s": self._tokens_per_s(s.tokens_generated),
            "tokens_generated": s.tokens_generated,
            "steps": s.steps,
            "preemptions": s.num_preemptions,
            "queue_lag": control.queue_lag,
            "reclaimed": intake.reclaimed,
            "dead_lettered": svc.dead.count,
            "outbox_depth": svc.outbox.depth,
            "draining": int(svc.draining),
        }
