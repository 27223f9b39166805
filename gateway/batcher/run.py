"""One batch, driven by the batcher holding its lease: validate, feed, collect, end.

Each tick reads the batch record and does what its status calls for. All progress lives
in Redis — the cursor ``fed``, the in-flight set, the results (``protocol/batch/progress.py``)
— so a batcher that takes a batch over after a crash goes on where the record says; what
is kept in memory is only a cache of parsed lines. Lines are fed on the low lane, at most
``batch_max_in_flight`` at a time, as ordinary requests whose id is the line's own, and
followed by ``gateway/batcher/inflight.py`` until each has its one result.

A run that raises anything but a Redis outage or a lost lease counts the failure in the
record (``failures``: every batcher and restart sees the same count) and tries again;
after ``MAX_FAILURES`` the batch is given up (``give_up``), so a batch that breaks the
batcher cannot come back on every scan and keep its slot forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import structlog
from redis.exceptions import RedisError

from gateway.batcher.inflight import BatcherContext, InFlight
from gateway.batcher.lines import ENDED_LINES, LinePlan, check_line, custom_id_of, ended_result
from protocol.batch.progress import BatchProgress, LeaseLost, LineResult
from protocol.batch.records import BatchRecord, FileKind, FileRecord, new_file_id

log = structlog.get_logger("ferry.batcher")

CHUNK = 512  # lines read (and validated) per round trip
WIND_DOWN_CODE = {"expired": "batch_expired", "failed": "file_not_found"}
MAX_FAILURES = 3  # unexpected failures of a batch's run before it is given up
OPEN = ("validating", "in_progress", "finalizing", "cancelling")  # statuses before the end


class BatchRun:
    def __init__(self, ctx: BatcherContext, batch_id: str) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.batch_id = batch_id
        lease_ms = max(1, round(ctx.settings.batch_lease_s * 1000))
        self.progress = BatchProgress(ctx.client.redis, ctx.settings.keys, batch_id,
                                      ctx.batcher_id, lease_ms)
        self.inflight = InFlight(ctx, self.progress)
        self._renewed_at = time.monotonic()

    async def keep_lease(self) -> None:
        """Renew the lease a few times per lease period; ``LeaseLost`` if it is gone."""
        if time.monotonic() - self._renewed_at >= self.settings.batch_lease_s / 4:
            await self.progress.renew()
            self._renewed_at = time.monotonic()

    async def run(self) -> None:
        """Until the batch has ended or the lease is lost; Redis outages are waited out."""
        pause = self.settings.batch_poll_interval_s
        try:
            while True:
                try:
                    await self.keep_lease()
                    record = await self.ctx.store.get_batch(self.batch_id)
                    if record is None or record.ended:
                        await self.ctx.store.deactivate(self.batch_id)
                        return
                    await self.step(record)
                    pause = self.settings.batch_poll_interval_s
                except (RedisError, OSError) as exc:
                    log.warning("batch_redis_error", batch_id=self.batch_id, error=str(exc))
                    pause = min(2.0, pause * 2)  # Redis away: back off, then carry on
                except LeaseLost:
                    raise
                except Exception as exc:
                    if await self.failed(exc):
                        return
                    pause = min(2.0, pause * 2)
                await asyncio.sleep(pause)
        except LeaseLost:
            log.warning("batch_lease_lost", batch_id=self.batch_id)
        finally:
            with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
                await asyncio.shield(self.progress.release())

    async def failed(self, exc: Exception) -> bool:
        """Count an unexpected failure; past ``MAX_FAILURES``, give the batch up. True
        once it has ended."""
        failures = await self.progress.count_failure()
        log.error("batch_run_failed", batch_id=self.batch_id, failures=failures,
                  exc_info=exc)
        if failures < MAX_FAILURES:
            return False
        await self.give_up(exc, failures)
        return True

    async def give_up(self, exc: Exception, failures: int) -> None:
        """End a batch whose run keeps failing: ``cancelled`` if a cancel was asked, else
        ``failed``, with an ``errors`` entry that says why. On the way, as far as it still
        works: record what finished, cancel what runs, give every line without a result
        the ending's error; ``total`` becomes the lines reported. A record that cannot be
        read any more is just ended ``failed``."""
        try:
            rec = await self.ctx.store.get_batch(self.batch_id)
        except (RedisError, OSError):
            raise
        except Exception:
            rec = None
        if rec is None:
            ttl = self.settings.batch_ttl_s
            await self.progress.finalize(OPEN, "failed", int(time.time()), ttl, ttl)
            await self.ctx.store.deactivate(self.batch_id)
            return
        final = "cancelled" if rec.status == "cancelling" else "failed"
        code = "batch_cancelled" if final == "cancelled" else "batch_failed"
        for attempt in (self.inflight.collect, self.report_all):
            try:
                await attempt(rec, code)
            except (RedisError, OSError, LeaseLost):
                raise
            except Exception as again:
                log.warning("batch_give_up_step_failed", batch_id=self.batch_id,
                            error=f"{type(again).__name__}: {again}")
        await self.progress.update(errors=[{
            "code": "batch_run_failed", "param": None, "line": None,
            "message": f"the batcher failed on this batch {failures} times "
                       f"({type(exc).__name__}: {str(exc)[:200]}), so it was stopped"}])
        await self.progress.settle_total()
        rec = await self.ctx.store.get_batch(self.batch_id) or rec
        await self.finalize(rec, rec.status, final)

    async def report_all(self, rec: BatchRecord, code: str) -> None:
        """Error results (``code``) for every line of the input file without one."""
        source = await self.ctx.store.get_file(rec.input_file_id)
        lines = max(rec.lines, source.lines if source is not None else 0)
        await self.progress.update(lines=lines)
        await self.report(rec, code, 0, lines, None)

    async def step(self, rec: BatchRecord) -> None:
        if rec.status == "validating" or (rec.status == "cancelling" and rec.lines == 0):
            await self.validate(rec)  # again after a crash: it records each line once
        elif rec.status == "in_progress":
            await self.running(rec)
        elif rec.status == "cancelling":
            await self.wind_down(rec, "batch_cancelled", "cancelling", "cancelled")
        elif rec.status == "finalizing" and rec.ending in WIND_DOWN_CODE:
            await self.wind_down(rec, WIND_DOWN_CODE[rec.ending], "finalizing", rec.ending)
        elif rec.status == "finalizing":
            await self.finalize(rec, "finalizing", "completed")

    # --- lines -------------------------------------------------------------------------
    async def read(self, rec: BatchRecord, start: int, count: int) -> list[bytes]:
        return await self.ctx.store.read_lines(rec.input_file_id, start, start + count - 1)

    # --- validating ----------------------------------------------------------------------
    async def validate(self, rec: BatchRecord) -> None:
        """Check every line (bad ones get their error result now) and count the requests;
        then run, or fail when no line can run."""
        source = await self.ctx.store.get_file(rec.input_file_id)
        lines = source.lines if source is not None and source.kind == "input" else 0
        seen: dict[str, int] = {}
        bad: list[LineResult] = []
        total, model = 0, None
        for start in range(0, lines, CHUNK):
            await self.keep_lease()
            results = []
            for offset, raw in enumerate(await self.read(rec, start, CHUNK)):
                outcome = await check_line(raw, start + offset, rec, self.settings,
                                           self.ctx.served, seen)
                total += outcome is not None
                if isinstance(outcome, LineResult):
                    results.append(outcome)
                elif outcome is not None and model is None:
                    model = outcome.model
            await self.progress.record(results)
            bad += results[: 10 - len(bad)]
            await asyncio.sleep(0)  # validating 50,000 lines must not starve other batches
        if total == 0 or model is None:
            why = ([_batch_error(r) for r in bad] if total else
                   [{"code": "empty_file" if source else "file_not_found",
                     "message": f"input_file_id: {rec.input_file_id!r} has no requests"
                     if source else f"input_file_id: {rec.input_file_id!r} no longer exists",
                     "param": "input_file_id"}])
            await self.progress.update(total=total, lines=max(lines, 1), errors=why)
            await self.finalize(rec, "validating", "failed")
            return
        await self.progress.update(total=total, lines=lines, model=model)
        await self.progress.transition(["validating"], "in_progress", int(time.time()))

    # --- in progress ---------------------------------------------------------------------
    async def running(self, rec: BatchRecord) -> None:
        now = int(time.time())
        if rec.settled:
            await self.progress.transition(["in_progress"], "finalizing", now, ending="completed")
        elif now >= rec.expires_at:
            await self.progress.transition(["in_progress"], "finalizing", now, ending="expired")
        else:
            await self.inflight.collect(rec, None)
            await self.feed(rec)

    async def feed(self, rec: BatchRecord) -> None:
        """Enqueue the next lines: up to ``batch_max_in_flight`` of this batch in flight,
        and no more than the fleet's budget for all batches (``FleetBudget``)."""
        async with self.ctx.budget.lock:
            take = await self._take(rec)
        await self.inflight.add(take)

    async def _take(self, rec: BatchRecord) -> list[LinePlan]:
        """The lines to enqueue now, marked in flight (their errors recorded on the way)."""
        own = len(await self.progress.inflight())
        room = min(self.settings.batch_max_in_flight - own, max(0, rec.lines - rec.fed))
        room = await self.ctx.budget.grant(room, own) if room > 0 else 0
        if room <= 0:
            return []
        raws = await self.read(rec, rec.fed, min(CHUNK, 2 * room + 16))
        if not raws:  # the input file is gone: what never ran is reported, the batch fails
            await self.progress.update(errors=[{"code": "file_not_found", "message":
                                                ENDED_LINES["file_not_found"]}])
            await self.progress.transition(["in_progress"], "finalizing", int(time.time()),
                                           ending="failed")
            return []
        recorded = await self.progress.recorded(range(rec.fed, rec.fed + len(raws)))
        take: list[LinePlan] = []
        errors: list[LineResult] = []
        fed = rec.fed
        for raw in raws:
            if len(take) >= room:
                break
            index, fed = fed, fed + 1
            if index not in recorded:
                outcome = await check_line(raw, index, rec, self.settings, self.ctx.served)
                if isinstance(outcome, LinePlan):
                    take.append(outcome)
                elif outcome is not None:
                    errors.append(outcome)
        await self.progress.record(errors)
        if await self.progress.feed(rec.fed, fed, [p.index for p in take]) != "ok":
            return []  # the batch stopped running, or the cursor moved: re-read next tick
        return take

    # --- ending --------------------------------------------------------------------------
    async def wind_down(self, rec: BatchRecord, code: str, status: str, final: str) -> None:
        """Stop feeding, cancel what runs, report every line that never ran, then end."""
        await self.inflight.collect(rec, code)
        if await self.progress.inflight():
            return  # cancelled lines are still ending
        rec = await self.ctx.store.get_batch(self.batch_id) or rec
        if not rec.settled:
            left = rec.total - rec.completed - rec.failed
            await self.report(rec, code, rec.fed, rec.lines, left)  # after the cursor
            return
        await self.finalize(rec, status, final)

    async def report(self, rec: BatchRecord, code: str, first: int, stop: int,
                     left: int | None) -> None:
        """Error results (``code``) for the non-blank lines ``first`` .. ``stop - 1`` that
        have none: at most ``left`` (None: all)."""
        left = stop if left is None else left
        for start in range(first, stop, CHUNK):
            if left <= 0:
                return
            await self.keep_lease()
            count = min(CHUNK, stop - start)
            raws = await self.read(rec, start, count) or [b"{}"] * count  # the file is gone
            recorded = await self.progress.recorded(range(start, start + len(raws)))
            results = []
            for index, raw in enumerate(raws, start):
                if left > 0 and index not in recorded and raw.strip():
                    results.append(ended_result(self.batch_id, index, custom_id_of(raw), code))
                    left -= 1
            await self.progress.record(results)

    async def finalize(self, rec: BatchRecord, status: str, final: str) -> None:
        """Name the output and error files, write their records, then end the batch."""
        await self.progress.reserve_files(new_file_id(), new_file_id())
        rec = await self.ctx.store.get_batch(self.batch_id) or rec
        now = int(time.time())
        ttl = rec.output_ttl_s or self.settings.batch_ttl_s
        files: list[tuple[str | None, FileKind, int]] = [
            (rec.output_file_id, "output", rec.output_bytes),
            (rec.error_file_id, "error", rec.error_bytes)]
        for file_id, kind, size in files:
            if file_id is not None:
                await self.ctx.store.save_file(FileRecord(
                    id=file_id, owner=rec.owner, purpose="batch_output", kind=kind,
                    filename=f"{rec.id}_{kind}.jsonl", bytes=size, created_at=now,
                    expires_at=now + ttl, lines=rec.lines, batch_id=rec.id), ttl)
        if await self.progress.finalize([status], final, now, self.settings.batch_ttl_s,
                                        ttl) == "ok":
            await self.ctx.store.deactivate(self.batch_id)
            log.info("batch_ended", batch_id=rec.id, status=final, total=rec.total,
                     completed=rec.completed, failed=rec.failed)


def _batch_error(result: LineResult) -> dict[str, Any]:
    """An entry of a failed batch's ``errors``: the line's code, message and number."""
    line = json.loads(result.line)
    error = line["error"] or line["response"]["body"]["error"]
    return {"code": error.get("code"), "message": error.get("message"),
            "param": error.get("param"), "line": result.index + 1}
