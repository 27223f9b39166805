"""The batcher: finds batches that need driving, leases them, and runs each (``BatchRun``).

``ferry batcher`` runs this as its own small process (torch-free, the gateway's image):
docs/batch.md says why neither the gateway nor the workers host it. Any number of batchers
may run; each takes the batches of the active set that nobody leases (``SET NX PX``), up
to ``batch_max_active`` at once, and renews its leases while it drives them. One that dies
(SIGKILL included) stops renewing; its batches go to whichever batcher sees their lease
gone, which continues from the progress in Redis. SIGTERM releases the leases at once.

Slots are shared by owner (tenant), not by age: a free slot goes to the owner holding the
fewest here (``Batcher.claim``), and when every slot is taken while an owner that holds
none here has a batch waiting, the owner holding the most gives up its youngest batch
(``Batcher.make_room``): one tenant's batches cannot keep another's from ever starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from collections import Counter
from pathlib import Path

import structlog
from redis.exceptions import RedisError

from gateway.batcher.inflight import BatcherContext, FleetBudget
from gateway.batcher.run import BatchRun
from gateway.redis_client import ferry_client
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import tenant_directory
from protocol.batch.store import BatchStore

log = structlog.get_logger("ferry.batcher")

STOP_WAIT_S = 10.0
"""How long a stopping batcher waits for its runs to end (each releases its lease)."""


def new_batcher_id() -> str:
    return f"batcher-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Batcher:
    def __init__(self, ctx: BatcherContext, health_file: Path | None = None) -> None:
        self.ctx = ctx
        self.health_file = health_file
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.owners: dict[str, str] = {}  # batch id -> owner, for the batches in ``runs``
        self.yielded: set[asyncio.Task[None]] = set()  # cancelled by make_room, ending

    @property
    def scan_interval_s(self) -> float:
        return 4 * self.ctx.settings.batch_poll_interval_s

    async def run(self, stop: asyncio.Event) -> None:
        """Claim and drive batches until ``stop``; then end every run (leases released)."""
        log.info("batcher_started", batcher_id=self.ctx.batcher_id)
        while not stop.is_set():
            self._reap()
            try:
                await self.claim()
                if self.health_file is not None:
                    self.health_file.touch()
            except (RedisError, OSError) as exc:
                log.warning("batcher_redis_error", error=str(exc))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.scan_interval_s)
        ending = {*self.runs.values(), *self.yielded}
        for task in ending:
            task.cancel()
        if ending:  # bounded: a run stuck in its cleanup must not keep the batcher alive
            _done, stuck = await asyncio.wait(ending, timeout=STOP_WAIT_S)
            if stuck:
                log.warning("batch_runs_not_ended", runs=sorted(t.get_name() for t in stuck))
        log.info("batcher_stopped", batcher_id=self.ctx.batcher_id)

    async def claim(self) -> None:
        """Lease the active batches nobody drives while this batcher has room (or can make
        some): round-robin by owner, the owner holding the fewest slots here first, each
        owner's oldest batch first (ids sort by age)."""
        waiting = [b for b in await self.ctx.store.active_batches() if b not in self.runs]
        queues: dict[str, list[str]] = {}
        for batch_id, (owner, leased) in zip(
                waiting, await self.ctx.store.owners_and_leases(waiting), strict=True):
            if not leased:  # a record gone (owner None): its run takes it off the set
                queues.setdefault(owner or "", []).append(batch_id)
        held = Counter(self.owners.values())
        while queues:
            if len(self.runs) >= self.ctx.settings.batch_max_active and \
                    not await self.make_room(queues, held):
                return
            owner = min(queues, key=lambda o: (held[o], queues[o][0]))
            batch_id = queues[owner].pop(0)
            if not queues[owner]:
                del queues[owner]
            run = BatchRun(self.ctx, batch_id)
            if await run.progress.acquire():
                log.info("batch_leased", batch_id=batch_id, batcher_id=self.ctx.batcher_id)
                self.runs[batch_id] = asyncio.create_task(run.run(), name=batch_id)
                self.owners[batch_id] = owner
                held[owner] += 1

    async def make_room(self, queues: dict[str, list[str]], held: Counter[str]) -> bool:
        """Every slot is taken: if an owner with a batch waiting holds none here and
        another holds several, stop driving the youngest batch of the one holding the
        most (its lease released, it goes on wherever a slot is free next: its progress
        is in Redis). True if a slot was freed."""
        if not any(held[owner] == 0 for owner in queues):
            return False
        biggest, most = held.most_common(1)[0]
        if most < 2:
            return False
        youngest = max(b for b, owner in self.owners.items() if owner == biggest)
        task = self.runs.pop(youngest)
        del self.owners[youngest]
        task.cancel()  # not awaited here: the claim goes on while it releases its lease
        self.yielded.add(task)
        task.add_done_callback(self.yielded.discard)
        held[biggest] -= 1
        log.info("batch_yielded", batch_id=youngest, owner=biggest,
                 batcher_id=self.ctx.batcher_id)
        return True

    def _reap(self) -> None:
        for batch_id, task in list(self.runs.items()):
            if not task.done():
                continue
            del self.runs[batch_id]
            self.owners.pop(batch_id, None)
            if not task.cancelled() and task.exception() is not None:
                log.error("batch_run_failed", batch_id=batch_id, exc_info=task.exception())


async def run_batcher(settings: GatewaySettings, batcher_id: str | None = None,
                      health_file: Path | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """One batcher until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
    client = ferry_client(settings)
    store = BatchStore(client.redis, settings.keys)
    served = ServedModels(client, settings.served_model_name)
    served.tenants = tenant_directory(settings)
    ctx = BatcherContext(client, store, served, settings, batcher_id or new_batcher_id(),
                         FleetBudget(store, served, settings), served.tenants)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await Batcher(ctx, health_file).run(stop)
    finally:
        await client.aclose()
