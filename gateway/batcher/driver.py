"""The batcher: finds batches that need driving, leases them, and runs each (``BatchRun``).

``ferry batcher`` runs this as its own small process (torch-free, the gateway's image):
docs/batch.md says why neither the gateway nor the workers host it. Any number of batchers
may run; each takes the batches of the active set that nobody leases (``SET NX PX``), up
to ``batch_max_active`` at once, and renews its leases while it drives them. One that dies
(SIGKILL included) stops renewing; its batches go to whichever batcher sees their lease
gone, which continues from the progress in Redis. SIGTERM releases the leases at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from pathlib import Path

import structlog
from redis.exceptions import RedisError

from gateway.batcher.inflight import BatcherContext, FleetBudget
from gateway.batcher.run import BatchRun
from gateway.redis_client import ferry_client
from gateway.served_models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import tenant_directory
from protocol.batch_store import BatchStore

log = structlog.get_logger("ferry.batcher")


def new_batcher_id() -> str:
    return f"batcher-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Batcher:
    def __init__(self, ctx: BatcherContext, health_file: Path | None = None) -> None:
        self.ctx = ctx
        self.health_file = health_file
        self.runs: dict[str, asyncio.Task[None]] = {}

    @property
    def scan_interval_s(self) -> float:
        return 4 * self.ctx.settings.batch_poll_interval_s

    async def run(self, stop: asyncio.Event) -> None:
        """Claim and drive batches until ``stop``; then end every run (leases released)."""
        log.info("batcher_started", batcher_id=self.ctx.batcher_id)
        while not stop.is_set():
            try:
                await self.claim()
                if self.health_file is not None:
                    self.health_file.touch()
            except (RedisError, OSError) as exc:
                log.warning("batcher_redis_error", error=str(exc))
            self._reap()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.scan_interval_s)
        for task in self.runs.values():
            task.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        log.info("batcher_stopped", batcher_id=self.ctx.batcher_id)

    async def claim(self) -> None:
        """Lease the active batches nobody drives, while this batcher has room."""
        for batch_id in await self.ctx.store.active_batches():
            if len(self.runs) >= self.ctx.settings.batch_max_active:
                return
            if batch_id in self.runs:
                continue
            run = BatchRun(self.ctx, batch_id)
            if await run.progress.acquire():
                log.info("batch_leased", batch_id=batch_id, batcher_id=self.ctx.batcher_id)
                self.runs[batch_id] = asyncio.create_task(run.run(), name=batch_id)

    def _reap(self) -> None:
        for batch_id, task in list(self.runs.items()):
            if not task.done():
                continue
            del self.runs[batch_id]
            if not task.cancelled() and task.exception() is not None:
                log.error("batch_run_failed", batch_id=batch_id, exc_info=task.exception())


async def run_batcher(settings: GatewaySettings, batcher_id: str | None = None,
                      health_file: Path | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """One batcher until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
    client = ferry_client(settings)
    store = BatchStore(client.redis, settings.keys)
    served = ServedModels(client, settings.served_model_name)
    ctx = BatcherContext(client, store, served, settings, batcher_id or new_batcher_id(),
                         FleetBudget(store, served, settings), tenant_directory(settings))
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await Batcher(ctx, health_file).run(stop)
    finally:
        await client.aclose()
