"""The event half of the job table: the engine's text outputs become each request's events.

Kept apart from ``job_table.py`` (admission, cancels, deadlines, slots: the engine's side)
and torch-free, so that the same code builds the events in the worker's output process
(``FERRY_OUTPUT_PROCESS``, the default: ``output_proc/service.py``) and in the engine loop
(``FERRY_OUTPUT_PROCESS=0``, in-process). ``on_end`` is where each side learns a
request's terminal event was built (in-process: free its slot, record its outcome; the
output process: tell the engine process); ``abort`` stops a request's other candidates
when one fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol.models import ErrorKind, FinishReason
from worker.engine import TextOutput
from worker.service.active_job import ActiveJob
from worker.service.jobs import Outgoing, TokenText

OnEnd = Callable[[ActiveJob, Outgoing | None], None]  # item None: the event failed to build
Abort = Callable[[str], list[TextOutput]]


class JobEvents:
    def __init__(self, token_text: TokenText, on_end: OnEnd, abort: Abort,
                 metrics: Any = None) -> None:
        self.token_text = token_text
        self.on_end = on_end
        self.abort = abort
        self.metrics = metrics  # observe_inter_token (None: not recorded here)
        self.jobs: dict[str, ActiveJob] = {}
        self.adapter_of: dict[str, str] = {}  # request id -> LoRA adapter (metrics)
        self.lora_metrics: Any = None

    def events(self, outputs: list[TextOutput], now: float) -> tuple[list[Outgoing], int]:
        """One step's engine outputs -> (events to send, tokens produced)."""
        batch: list[Outgoing] = []
        tokens = 0
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            tokens += len(out.new_token_ids)
            if self.adapter_of and out.request_id in self.adapter_of and self.lora_metrics:
                self.lora_metrics.tokens.labels(adapter=self.adapter_of[out.request_id]) \
                    .inc(len(out.new_token_ids))
            if out.new_token_ids and job.last_token_mono is not None and self.metrics:
                self.metrics.observe_inter_token(now - job.last_token_mono)
            if out.new_token_ids:
                job.last_token_mono = now
            if out.finished:
                batch += self._candidate_end(job, out)
            else:
                item = job.step_event(out, self.token_text)
                if item is not None:
                    batch.append(item)
        return batch, tokens

    def _candidate_end(self, job: ActiveJob, out: TextOutput) -> list[Outgoing]:
        """A request (or one of its n candidates) ended in the engine: its events."""
        reason, kind = engine_finish(out)
        if not job.multi:
            return [self.end(job, reason, out, out.error, kind)]
        if reason not in ("stop", "length"):  # one candidate failed: so does the request
            job.absorb(out)
            for other in self.abort(job.request_id):
                job.absorb(other)
            return [self.end(job, reason, None, out.error, kind)]
        item = job.choice_event(out, self.token_text)
        items = [item] if item is not None else []
        if job.done:
            items.append(self.end(job, job.overall_reason(), None))
        return items

    def closing_output(self, job: ActiveJob, outs: list[TextOutput]) -> TextOutput | None:
        """The aborted candidates' outputs of a request stopped from outside (cancel,
        timeout): the output to close its event with (n = 1); several are absorbed."""
        if not job.multi:
            return outs[0] if outs else None
        for out in outs:
            job.absorb(out)
        return None

    def end(
        self, job: ActiveJob, reason: FinishReason, out: TextOutput | None,
        error: str | None = None, kind: ErrorKind | None = None,
    ) -> Outgoing:
        """Forget a job that the engine no longer holds; its terminal event."""
        self.jobs.pop(job.request_id, None)
        item: Outgoing | None = None
        try:
            item = job.final_event(reason, out, error, kind, self.token_text)
        finally:
            self.on_end(job, item)
        return item


def engine_finish(out: TextOutput) -> tuple[FinishReason, ErrorKind | None]:
    reason = out.finish_reason or "stop"
    if reason == "error":  # the engine says when the request is at fault (structured output)
        return "error", "invalid_request" if out.error_kind == "invalid_request" else "internal"
    if reason in ("stop", "length", "abort"):
        return reason, None  # type: ignore[return-value]
    return "error", "internal"
