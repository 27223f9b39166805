"""Worker process wiring: logging, torch threads, engine, service, signals, exit code.

``ferry worker`` (``ferry/commands/worker.py``) parses flags and ``FERRY_*`` variables
into a ``WorkerSettings`` and an ``EngineConfig`` and calls ``run_worker``. Signals:
the first SIGTERM or SIGINT stops intake and drains (finish in-flight work for up to
``drain_timeout_s``, hand the rest back, exit 0); a second one ends the drain at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import structlog

from worker.engine import EngineConfig
from worker.service.redis.connection import WorkerSettings

if TYPE_CHECKING:
    from worker.service.outbox.thread import Observer

log = structlog.get_logger("ferry.worker")


class _Signals:
    """First signal: drain. Second: stop now. Works before the service exists, too."""

    def __init__(self) -> None:
        self.count = 0
        self.service: Any = None
        self.received = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        self.received.set()
        log.info("signal_received", signal=signal.Signals(signum).name, count=self.count)
        if self.service is not None:
            self.service.request_stop(force=self.count > 1)


def run_worker(
    config: EngineConfig, settings: WorkerSettings, *, torch_threads: int | None = None,
    log_level: str = "info", observer: Observer | None = None,
) -> int:
    """Load the model, serve until signalled, drain; returns the exit code. ``observer``
    sees every batch of events the engine process sends (benchmarks use it to time them;
    with ``output_process`` those are only the refusals: the output process sends the rest)."""
    from observability.logging import configure_logging

    configure_logging(level=log_level)
    structlog.contextvars.bind_contextvars(worker_id=settings.worker_id)
    signals = _Signals()
    signals.install()

    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    from worker.engine import Engine
    from worker.service.metrics.prometheus import WorkerMetrics
    from worker.service.service import WorkerService

    log.info("loading_model", model=config.model.model, device=config.model.device,
             max_num_seqs=config.scheduler.max_num_seqs, torch_threads=torch.get_num_threads())
    engine = Engine(config)
    if signals.received.is_set():
        log.info("stopped_before_serving")
        return 0
    service = WorkerService(engine, settings, WorkerMetrics(), observer=observer)
    signals.service = service
    if signals.received.is_set():  # signalled between the two checks
        service.request_stop()
    stats = engine.stats()
    loaded = getattr(engine.runner, "loaded", None)
    log.info("model_loaded", kv_blocks=stats.kv_blocks_total,
             device=str(getattr(engine.runner, "device", config.model.device)),
             packed_gemv_rows=getattr(loaded, "packed_gemv_rows", None) or None)
    try:
        return service.run()
    finally:
        engine.close()  # tensor parallelism: the follower ranks end with the worker

