"""The requests this worker holds, as the engine loop sees them: admission, cancels,
deadlines, and turning the engine's outputs into events.

It is the engine loop's own state (only that thread touches it): ``jobs`` maps request ids
to their ``ActiveJob``, deadlines and early cancels wait here, and every way a request
ends — finished in the engine, cancelled, timed out, refused, lease lost — goes through
``end``, which frees its slot and records its outcome. Kept apart from the service's
thread wiring and lifecycle so each stays small.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from protocol.models import ErrorKind, FinishReason
from protocol.tenants.cache_scope import cache_partition
from worker.engine import Engine, PromptError, TextOutput, TextOutputs, UnknownAdapter
from worker.service.active_job import ActiveJob
from worker.service.affinity.book import AffinityBook
from worker.service.affinity.chains import Prefix, block_owners
from worker.service.intake.slots import Slots
from worker.service.job_events import JobEvents
from worker.service.jobs import Admission, Command, Outgoing
from worker.service.metrics.lora import LoraMetrics
from worker.service.metrics.prometheus import WorkerMetrics
from worker.service.metrics.stats import StatsBook
from worker.service.outbox.thread import Outbox
from worker.service.redis.leases import HeldEntries
from worker.service.sidecars.lora_sync import LoraSync
from worker.service.ttft_trace import StepTrace

_EARLY_CANCEL_TTL_S = 60.0


class JobTable:
    def __init__(
        self, engine: Engine, outbox: Outbox, slots: Slots, held: HeldEntries,
        book: StatsBook, metrics: WorkerMetrics, worker_id: str,
        token_text: Callable[[int], str], log: Any,
    ) -> None:
        self.engine = engine
        self.text = TextOutputs(engine)  # the engine's token ids as text outputs
        self.outbox = outbox
        self.slots = slots
        self.held = held
        self.book = book
        self.metrics = metrics
        self.worker_id = worker_id
        self.token_text = token_text
        self.log = log
        self.ev = JobEvents(token_text, self._on_end, self.text.abort, metrics)
        self.jobs: dict[str, ActiveJob] = self.ev.jobs
        # request id -> its deadline (time.time()); the loop calls ``expire`` only while
        # one is set
        self.deadlines: dict[str, float] = {}
        self._early_cancels: dict[str, tuple[str, float]] = {}
        # multi-LoRA (service.py sets both when LoRA is on): model name -> adapter, and
        # the adapter of each running job (per-adapter metrics)
        self.adapters: LoraSync | None = None
        self._adapter_of: dict[str, str] = self.ev.adapter_of
        self.trace = StepTrace(worker_id)  # FERRY_LOG_LEVEL=debug: each TTFT's parts
        self.affinity: AffinityBook | None = None  # prefix affinity's book (service.py)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def lora_metrics(self) -> LoraMetrics | None:
        return self.ev.lora_metrics  # type: ignore[no-any-return]

    @lora_metrics.setter
    def lora_metrics(self, value: LoraMetrics | None) -> None:
        self.ev.lora_metrics = value

    def step(self) -> Any:
        """One engine step (timed by the caller); ``events`` turns it into events."""
        started = time.time() if self.trace.on else 0.0
        outputs = self.text.step()
        if started:  # in-process, the first scheduled step is not seen
            self.trace.step(None, [o.request_id for o in outputs if o.new_token_ids],
                            started, time.time())
        return outputs

    def events(self, outputs: list[TextOutput], now: float) -> tuple[list[Outgoing], int]:
        """One step's outputs -> (events to send, tokens produced)."""
        return self.ev.events(outputs, now)

    def _on_end(self, job: ActiveJob, item: Outgoing | None) -> None:
        """A job's terminal event was built: forget it, record it, free its slot."""
        self.deadlines.pop(job.request_id, None)
        self._adapter_of.pop(job.request_id, None)
        self.trace.forget(job.request_id)
        try:
            if item is not None:
                self.book.finished(job, item)  # its cost is in the fair ledger...
        finally:
            self.slots.release()  # ...before the intake, woken by the room, pulls again

    def poll(self) -> None:
        """Between steps: what an output process sent back (in-process: nothing)."""

    @property
    def outbox_depth(self) -> int:
        """Events an output process's outbox holds (in-process: none; the service's own
        outbox is counted apart)."""
        return 0

    def close(self, timeout_s: float) -> None:
        """Shutdown, after ``abort_all``: an output process writes what it has."""

    def _admitted(self, job: ActiveJob) -> None:
        """The job is in the engine (the output process hears of it here)."""

    def _close(self, job: ActiveJob, reason: FinishReason, error: str) -> None:
        """Stop a running job from outside (cancel, timeout) with its terminal event."""
        out = self.ev.closing_output(job, self.text.abort(job.request_id))
        self.outbox.put([self._end(job, reason, out, error)])

    def _drop(self, request_id: str) -> None:
        """Drop a request from the engine without events (lease lost, shutdown)."""
        self.text.abort(request_id)

    def admit(self, admission: Admission) -> None:
        job = ActiveJob(admission, self.worker_id)
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
        params = request.params
        if job.prompt_fields is None:  # resumed: the prompt's fields were sent already
            params = params.model_copy(update={"prompt_logprobs": None})
        elif admission.prompt_text is not None:
            job.prompt_fields["prompt_text"] = admission.prompt_text
        try:
            lora = self.adapters.adapter_for(request.model, request.tenant) \
                if self.adapters else None
            first = self.engine.add_tokens(
                rid, admission.prompt_token_ids, params, priority=request.priority,
                prior_by_choice=admission.prior,
                skip_choices=frozenset(admission.finished_choices), lora=lora,
                cache_scope=cache_partition(request.tenant, request.cache_scope,
                                            request.cache_salt),
            )
        except UnknownAdapter as exc:  # not the tenant's, or it cannot run here
            job.error_code, job.error_param = exc.code, "model"
            self._finish_now(job, "error", str(exc), "invalid_request")
            return
        except Exception as exc:  # a bug must fail the request, not the worker
            self.log.exception("add_request_failed", request_id=rid)
            self._finish_now(job, "error", f"{type(exc).__name__}: {exc}", "internal")
            return
        if self.affinity is not None and admission.prefix is not None:
            self._book(admission.prefix, first, job.num_prompt_tokens)
        self.jobs[rid] = job
        self.trace.admitted(job)
        self._admitted(job)
        if job.deadline is not None:
            self.deadlines[rid] = job.deadline
        if lora is not None:
            self._adapter_of[rid] = lora.name
            if self.lora_metrics is not None:
                self.lora_metrics.admitted(lora.name)

    def _book(self, prefix: Prefix, request: Any, num_tokens: int) -> None:
        """Affinity: book the admitted request's chunks with the hashes of the prompt blocks
        each one needs (``affinity/chains.py``), so the cache's evictions reach the
        board."""
        assert self.affinity is not None
        owners = block_owners(prefix, num_tokens, self.engine.config.cache.block_size)
        hashes = self.engine.block_hashes(request, len(owners))
        self.affinity.served(prefix, zip(hashes, owners, strict=True))

    def _refuse(self, job: ActiveJob, error: Exception | None) -> None:
        """A prompt the pool could not build: invalid input is the client's fault."""
        if isinstance(error, PromptError):
            job.num_prompt_tokens = error.num_prompt_tokens
            job.error_code, job.error_param = error.code, error.param
            self._finish_now(job, "error", str(error), "invalid_request")
        else:
            message = f"{type(error).__name__}: {error}" if error else "prompt not built"
            self._finish_now(job, "error", message, "internal")

    def command(self, cmd: Command) -> None:
        job = self.jobs.get(cmd.request_id)
        if cmd.kind == "lost":
            if job is not None:
                self.jobs.pop(cmd.request_id)
                self.deadlines.pop(cmd.request_id, None)
                self.trace.forget(cmd.request_id)
                self._drop(cmd.request_id)
                self.slots.release()
                self.log.warning("request_dropped_lease_lost", request_id=cmd.request_id)
            return
        if job is None:
            self._remember_cancel(cmd)
            return
        self._close(job, "cancelled", cmd.reason or "cancelled")
        self.log.info("request_cancelled", request_id=cmd.request_id)

    def _remember_cancel(self, cmd: Command) -> None:
        """A cancel for a request not admitted yet (still on its way from the intake)."""
        now = time.monotonic()
        self._early_cancels = {
            rid: v for rid, v in self._early_cancels.items() if now - v[1] < _EARLY_CANCEL_TTL_S
        }
        self._early_cancels[cmd.request_id] = (cmd.reason or "cancelled", now)

    def expire(self) -> None:
        """Close the requests past their deadline."""
        now = time.time()
        for rid, deadline in list(self.deadlines.items()):
            if now >= deadline:
                self._close(self.jobs[rid], "timeout", _timeout_message(self.jobs[rid]))

    def _end(
        self, job: ActiveJob, reason: FinishReason, out: TextOutput | None,
        error: str | None = None, kind: ErrorKind | None = None,
    ) -> Outgoing:
        """Forget a job that the engine no longer holds; its terminal event."""
        return self.ev.end(job, reason, out, error, kind)

    def _finish_now(
        self, job: ActiveJob, reason: FinishReason, error: str, kind: ErrorKind | None = None
    ) -> None:
        """End a job that never reached the engine."""
        self.outbox.put([self._end(job, reason, None, error, kind)])

    def abort_all(self) -> int:
        """Shutdown: drop every request from the engine (their entries are handed back)."""
        count = len(self.jobs)
        for rid in list(self.jobs):
            self._drop(rid)
        self.jobs.clear()
        self.deadlines.clear()
        return count


def _timeout_message(job: ActiveJob) -> str:
    return f"timeout_s: the request did not finish within {job.request.timeout_s} s"

