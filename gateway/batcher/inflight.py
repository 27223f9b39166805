"""A batch's lines in flight: enqueued as requests, followed by polling, recorded once.

The in-flight set in Redis says which lines were fed and have no result yet; this module
turns each into its requests (from the cache, or parsed again after a takeover), polls
their job states in one round trip, and builds the result of each line whose requests all
ended from their replay logs. Winding down (cancel, expiry) it cancels what still runs and
reports the lines cancelled that way with the batch's reason instead of a 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from gateway.batcher.lines import LinePlan, check_line, ended_result, finished_result
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import TenantDirectory
from protocol.aclient import AsyncFerryClient
from protocol.batch.progress import BatchProgress, LineResult
from protocol.batch.records import BatchRecord
from protocol.batch.store import BatchStore
from protocol.models import TERMINAL_STATES, GenerateRequest, TokenEvent
from protocol.store import DuplicateRequestError


class FleetBudget:
    """How many more batch lines the fleet should take now: ``batch_fleet_share`` of the
    live workers' ``max_num_seqs`` (their heartbeats), less the lines of every active batch
    already in flight (read at most once per poll interval; grants since then count too),
    split evenly over the active batches so that none waits for another to finish. A batch
    holds ``lock`` from its grant until its lines are marked in flight, so a re-read
    between the two cannot forget the grant.

    Why: a worker's step costs more the more sequences it runs (on a CPU, nearly in
    proportion), so what keeps interactive latency is how many batch lines share the
    workers, over all batches; ``ops/bench/service/batch.py`` measures it (docs/batch.md). Several
    batchers may overshoot by what each grants within one interval. No live worker: no
    fleet bound (nothing runs anyway; the per-batch bound still holds).
    """

    def __init__(self, store: BatchStore, served: ServedModels,
                 settings: GatewaySettings) -> None:
        self.store = store
        self.served = served
        self.settings = settings
        self.lock = asyncio.Lock()
        self._read_at = float("-inf")
        self._limit: int | None = None
        self._used = 0
        self._batches = 1

    async def grant(self, wanted: int, own: int) -> int:
        """Lines a batch with ``own`` in flight may add now (at most ``wanted``)."""
        if time.monotonic() - self._read_at >= self.settings.batch_poll_interval_s:
            slots = sum(int(w.stats.get("max_num_seqs", 0)) for w in await self.served.workers())
            self._limit = max(1, int(slots * self.settings.batch_fleet_share)) if slots else None
            counts = await self.store.inflight_counts()
            self._used, self._batches = sum(counts.values()), max(1, len(counts))
            self._read_at = time.monotonic()
        if self._limit is None:
            return wanted
        fair = -(-self._limit // self._batches)  # ceil: a few lines each, however many
        granted = max(0, min(wanted, fair - own, self._limit - self._used))
        self._used += granted
        return granted


@dataclass(frozen=True)
class BatcherContext:
    """What every batch run of one batcher shares."""

    client: AsyncFerryClient
    store: BatchStore
    served: ServedModels
    settings: GatewaySettings
    batcher_id: str
    budget: FleetBudget
    tenants: TenantDirectory = field(default_factory=TenantDirectory)

    def weight(self, request: GenerateRequest) -> float:
        """The fair-share weight of the tenant a line runs as (its batch's owner)."""
        return self.tenants.tenant(request.tenant).weight


class InFlight:
    def __init__(self, ctx: BatcherContext, progress: BatchProgress) -> None:
        self.ctx = ctx
        self.progress = progress
        self.batch_id = progress.batch_id
        self.plans: dict[int, LinePlan] = {}
        self.cancelled: set[str] = set()

    async def add(self, plans: list[LinePlan]) -> None:
        """Enqueue lines the cursor just moved over (``BatchProgress.feed``)."""
        for plan in plans:
            self.plans[plan.index] = plan
            await self.enqueue(plan)

    async def enqueue(self, plan: LinePlan) -> None:
        for request in plan.requests:
            with contextlib.suppress(DuplicateRequestError):  # enqueued before a crash
                await self.ctx.client.enqueue(request, weight=self.ctx.weight(request))

    async def collect(self, rec: BatchRecord, code: str | None) -> None:
        """Record the lines whose requests all ended. Winding down (``code``): cancel the
        rest; running: enqueue lines marked in flight whose job never got created (the
        batcher died between the two)."""
        results: list[LineResult] = []
        plans: list[LinePlan] = []
        for index in await self.progress.inflight():
            plan = self.plans.get(index) or await self.replan(rec, index)
            if isinstance(plan, LinePlan):
                plans.append(plan)
            else:
                results.append(plan)
        ids = [rid for plan in plans for rid in plan.request_ids]
        states = dict(zip(ids, await self.ctx.client.states(ids), strict=True))
        for plan in plans:
            found = [states[rid] for rid in plan.request_ids]
            if all(s in TERMINAL_STATES for s in found):
                results.append(await self.finished(plan, code))
            elif code is not None and None in found:
                results.append(ended_result(self.batch_id, plan.index, plan.custom_id, code))
            elif None in found:
                await self.enqueue(plan)
            elif code is not None:
                await self.cancel(plan)
        await self.progress.record(results)
        for result in results:
            self.plans.pop(result.index, None)

    async def replan(self, rec: BatchRecord, index: int) -> LinePlan | LineResult:
        """The plan of a line in flight that this batcher did not feed (a takeover)."""
        raws = await self.ctx.store.read_lines(rec.input_file_id, index, index)
        outcome = await check_line(raws[0], index, rec, self.ctx.settings,
                                   self.ctx.served) if raws else None
        if outcome is None:
            return ended_result(self.batch_id, index, None, "file_not_found")
        if isinstance(outcome, LinePlan):
            self.plans[index] = outcome
        return outcome

    async def cancel(self, plan: LinePlan) -> None:
        for rid in plan.request_ids:
            if rid not in self.cancelled:
                self.cancelled.add(rid)
                await self.ctx.client.cancel(rid, reason="batch ended")

    async def finished(self, plan: LinePlan, code: str | None) -> LineResult:
        events = [await self.events_of(rid) for rid in plan.request_ids]
        if code is not None and any(e[-1].finish_reason == "cancelled" for e in events):
            return ended_result(self.batch_id, plan.index, plan.custom_id, code)
        return finished_result(self.batch_id, plan, events)

    async def events_of(self, request_id: str) -> list[TokenEvent]:
        """The job's events from its replay log; once that has expired (a batcher away for
        an hour), one terminal event rebuilt from the job hash (without logprobs)."""
        events = await self.ctx.client.replay(request_id)
        if events and events[0].seq == 0 and events[-1].is_final:
            return events
        status = await self.ctx.client.result(request_id)
        if status is None or status.finish_reason is None:
            return [TokenEvent(request_id=request_id, seq=0, finish_reason="error",
                               error_kind="internal", error="the job's result has expired")]
        return [TokenEvent(request_id=request_id, seq=0, token_ids=status.token_ids,
                           text=status.text, finish_reason=status.finish_reason,
                           error=status.error, error_kind=status.error_kind,
                           usage=status.usage, choices=status.choices)]
