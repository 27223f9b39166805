"""The worker service: the engine loop, wired to the intake, outbox and control threads.

The loop owns the engine (which is single-threaded) and never touches Redis: between two
steps it drains its mailbox (new requests from the intake, cancels and lost leases from
the control thread and the outbox), enforces deadlines, steps, and hands the step's events
to the outbox. So a slow or unreachable Redis never stalls a forward pass, and the GPU
batch takes new requests at every iteration. See ``docs/service.md``.
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import structlog

from protocol.models import ErrorKind, FinishReason
from protocol.store import ensure_group
from worker.engine.engine import Engine
from worker.engine.outputs import StepOutput
from worker.engine.prompts import PromptError
from worker.service.active_job import ActiveJob
from worker.service.control import Control
from worker.service.deadletter import DeadLetters
from worker.service.intake import Intake
from worker.service.jobs import Admission, Command, Outgoing
from worker.service.leases import HeldEntries, hand_back
from worker.service.metrics import WorkerMetrics
from worker.service.outbox import Observer, Outbox
from worker.service.prompt_pool import PromptPool, build_with
from worker.service.redis_io import TRANSIENT_ERRORS, Backoff, WorkerSettings, connect
from worker.service.slots import Slots
from worker.service.stats import ServiceCounters, StatsBook

log = structlog.get_logger("ferry.worker")
_EARLY_CANCEL_TTL_S = 60.0


class WorkerService:
    """``WorkerService(engine, settings).run()`` serves until ``request_stop()``."""

    def __init__(
        self, engine: Engine, settings: WorkerSettings, metrics: WorkerMetrics | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.log = log.bind(worker_id=settings.worker_id)
        self.mailbox: queue.Queue[Admission | Command] = queue.Queue()
        self.held = HeldEntries()
        self.slots = Slots(engine.config.scheduler.max_num_seqs, settings.prefetch)
        self.dead = DeadLetters(settings)
        self.outbox = Outbox(settings, self.held, self.mailbox, observer)
        self.prompts = PromptPool(build_with(engine.prompts), self.mailbox)
        self.intake = Intake(settings, self.held, self.slots, self.mailbox, self.outbox,
                             engine.has_unfinished_requests, self.dead, self.prompts)
        self.book = StatsBook(engine.stats, self.metrics)
        self.control = Control(settings, self.held, self.mailbox, self._heartbeat_stats)
        self.jobs: dict[str, ActiveJob] = {}
        self._deadlines: dict[str, float] = {}
        self._early_cancels: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _heartbeat_stats(self) -> dict[str, float | int | str]:
        """Control thread: the heartbeat's ``stats``, from the engine and the threads."""
        return self.book.heartbeat_stats(ServiceCounters(
            slots_held=self.slots.held, max_num_seqs=self.slots.total,
            entries_held=len(self.held), queue_depth=self.control.queue_depth,
            queue_lag=self.control.queue_lag, reclaimed=self.intake.reclaimed,
            dead_lettered=self.dead.count, outbox_depth=self.outbox.depth,
            draining=self.draining,
        ))

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, force: bool = False) -> None:
        """Stop intake and drain (SIGTERM); ``force`` ends the drain now (second signal)."""
        now = time.monotonic()
        if force or self._stop.is_set():
            self._drain_until = now
        else:
            self._drain_until = now + self.settings.drain_timeout_s
        self._stop.set()

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        if not self._connect():
            return 0
        self.metrics.serve(self.settings.metrics_port)  # fails early if the port is taken
        self.outbox.start()
        self.control.start()
        self.intake.start()
        self.log.info("worker_started", model=self.settings.model_name,
                      max_num_seqs=self.slots.total, lease_s=self.settings.lease_s)
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _connect(self) -> bool:
        """Create the consumer group, waiting for Redis with backoff; False if stopped."""
        r, backoff = connect(self.settings.redis_url), Backoff(cap=5.0)
        try:
            while not self._stop.is_set():
                try:
                    ensure_group(r, self.settings.keys)
                    return True
                except TRANSIENT_ERRORS as exc:
                    self.log.warning("redis_unavailable_at_startup", error=str(exc))
                    backoff.wait(self._stop)
            return False
        finally:
            r.close()

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            self._drain_mailbox(0.0 if busy else 0.05)
            if self._deadlines:
                self._expire()
            if self._stop.is_set() and self._drained():
                return
            if self.engine.has_unfinished_requests():
                self._step()
            self.book.refresh()

    def _past_drain(self) -> bool:
        return self._drain_until is not None and time.monotonic() >= self._drain_until

    def _drained(self) -> bool:
        if self.intake.is_alive():
            self.intake.stop()
        if self._past_drain():
            return True
        return (not self.intake.is_alive() and not self.prompts.busy and self.mailbox.empty()
                and not self.jobs)

    def _drain_mailbox(self, wait: float) -> None:
        try:
            item = self.mailbox.get(timeout=wait) if wait > 0 else self.mailbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Admission):
                self._admit(item)
            else:
                self._command(item)
            try:
                item = self.mailbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        self.slots.set_running(len(self.engine.scheduler.running))
        batch: list[Outgoing] = []
        tokens = 0
        now = time.monotonic()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            tokens += len(out.new_token_ids)
            if out.new_token_ids and job.last_token_mono is not None:
                self.metrics.observe_inter_token(now - job.last_token_mono)
            if out.new_token_ids:
                job.last_token_mono = now
            if out.finished:
                batch += self._candidate_end(job, out)
            else:
                item = job.step_event(out, self.token_text)
                if item is not None:
                    batch.append(item)
        self.outbox.put(batch, self._past_drain)
        self.metrics.observe_step(elapsed, tokens)

    def _candidate_end(self, job: ActiveJob, out: StepOutput) -> list[Outgoing]:
        """A request (or one of its n candidates) ended in the engine: its events."""
        reason, kind = _engine_finish(out)
        if not job.multi:
            return [self._end(job, reason, out, out.error, kind)]
        if reason not in ("stop", "length"):  # one candidate failed: so does the request
            job.absorb(out)
            for other in self.engine.abort(job.request_id):
                job.absorb(other)
            return [self._end(job, reason, None, out.error, kind)]
        item = job.choice_event(out, self.token_text)
        items = [item] if item is not None else []
        if job.done:
            items.append(self._end(job, job.overall_reason(), None))
        return items

    def _stop_in_engine(self, job: ActiveJob) -> StepOutput | None:
        """Abort a request's candidates; the output to close its event with (n = 1)."""
        outs = self.engine.abort(job.request_id)
        if not job.multi:
            return outs[0] if outs else None
        for out in outs:
            job.absorb(out)
        return None

    # -- requests in and out -----------------------------------------------------------
    def _admit(self, admission: Admission) -> None:
        job = ActiveJob(admission, self.settings.worker_id)
        rid = job.request_id
        if admission.entry not in self.held or rid in self.jobs:
            self.slots.release()  # lease lost while queued here, or a duplicate delivery
            self.held.discard(admission.entry)
            return
        early = self._early_cancels.pop(rid, None)
        if early is not None:
            self._finish_now(job, "cancelled", early[0])
            return
        if job.deadline is not None and time.time() >= job.deadline:
            self._finish_now(job, "timeout", _timeout_message(job))
            return
        if admission.error is not None or admission.prompt_token_ids is None:
            self._refuse(job, admission.error)
            return
        if job.multi and job.done:  # resumed after every choice ended, before the last event
            self.outbox.put([self._end(job, job.overall_reason(), None)])
            return
        request = admission.request
        job.num_prompt_tokens = len(admission.prompt_token_ids)
        try:
            self.engine.add_tokens(
                rid, admission.prompt_token_ids, request.params, priority=request.priority,
                prior_by_choice=admission.prior,
                skip_choices=frozenset(admission.finished_choices),
            )
        except Exception as exc:  # a bug must fail the request, not the worker
            self.log.exception("add_request_failed", request_id=rid)
            self._finish_now(job, "error", f"{type(exc).__name__}: {exc}", "internal")
            return
        self.jobs[rid] = job
        if job.deadline is not None:
            self._deadlines[rid] = job.deadline

    def _refuse(self, job: ActiveJob, error: Exception | None) -> None:
        """A prompt the pool could not build: invalid input is the client's fault."""
        if isinstance(error, PromptError):
            job.num_prompt_tokens = error.num_prompt_tokens
            self._finish_now(job, "error", str(error), "invalid_request")
        else:
            message = f"{type(error).__name__}: {error}" if error else "prompt not built"
            self._finish_now(job, "error", message, "internal")

    def _command(self, cmd: Command) -> None:
        job = self.jobs.get(cmd.request_id)
        if cmd.kind == "lost":
            if job is not None:
                self.jobs.pop(cmd.request_id)
                self._deadlines.pop(cmd.request_id, None)
                self.engine.abort(cmd.request_id)
                self.slots.release()
                self.log.warning("request_dropped_lease_lost", request_id=cmd.request_id)
            return
        if job is None:
            self._remember_cancel(cmd)
            return
        out = self._stop_in_engine(job)
        self.outbox.put([self._end(job, "cancelled", out, cmd.reason or "cancelled")])
        self.log.info("request_cancelled", request_id=cmd.request_id)

    def _remember_cancel(self, cmd: Command) -> None:
        """A cancel for a request not admitted yet (still on its way from the intake)."""
        now = time.monotonic()
        self._early_cancels = {
            rid: v for rid, v in self._early_cancels.items() if now - v[1] < _EARLY_CANCEL_TTL_S
        }
        self._early_cancels[cmd.request_id] = (cmd.reason or "cancelled", now)

    def _expire(self) -> None:
        now = time.time()
        for rid, deadline in list(self._deadlines.items()):
            if now >= deadline:
                job = self.jobs[rid]
                out = self._stop_in_engine(job)
                self.outbox.put([self._end(job, "timeout", out, _timeout_message(job))])

    def _end(
        self, job: ActiveJob, reason: FinishReason, out: StepOutput | None,
        error: str | None = None, kind: ErrorKind | None = None,
    ) -> Outgoing:
        """Forget a job that the engine no longer holds; its terminal event."""
        self.jobs.pop(job.request_id, None)
        self._deadlines.pop(job.request_id, None)
        self.slots.release()
        item = job.final_event(reason, out, error, kind, self.token_text)
        self.book.finished(job, item)
        return item

    def _finish_now(
        self, job: ActiveJob, reason: FinishReason, error: str, kind: ErrorKind | None = None
    ) -> None:
        """End a job that never reached the engine."""
        self.outbox.put([self._end(job, reason, None, error, kind)])

    def _token_text(self, token_id: int) -> str:
        return str(self.engine.tokenizer.decode([token_id]))

    # -- shutdown ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Stop intake, drop what did not finish, flush events, hand entries back."""
        self.intake.stop()
        self.intake.join(self.settings.idle_block_ms / 1000 + 6)
        self.prompts.close()
        unfinished = list(self.jobs)
        for rid in unfinished:
            self.engine.abort(rid)
        self.jobs.clear()
        flushed = self.outbox.close(timeout=10.0)
        handed = hand_back(self.settings, list(self.held.snapshot()))
        self.control.stop()
        self.log.info("worker_stopped", unfinished=len(unfinished), handed_back=handed,
                      events_flushed=flushed)


def _engine_finish(out: StepOutput) -> tuple[FinishReason, ErrorKind | None]:
    reason = out.finish_reason or "stop"
    if reason == "error":  # the engine says when the request is at fault (structured output)
        return "error", "invalid_request" if out.error_kind == "invalid_request" else "internal"
    if reason in ("stop", "length", "abort"):
        return reason, None  # type: ignore[return-value]
    return "error", "internal"


def _timeout_message(job: ActiveJob) -> str:
    return f"timeout_s: the request did not finish within {job.request.timeout_s} s"

