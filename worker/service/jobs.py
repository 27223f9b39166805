"""What the worker's threads hand each other, and one request's progress as the service
sees it (``ActiveJob``): the next ``seq``, everything streamed so far, timings.

The engine knows tokens; the service also needs the wire view — event numbering that
continues across a crash (a resumed job starts at the replay log's length), the full text
for the job hash, and the terminal event's usage and timings. Keeping that here keeps the
engine free of protocol concerns and the engine loop short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.models import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    JobStatus,
    Timings,
    TokenEvent,
    Usage,
    state_for_finish,
)
from worker.engine.outputs import StepOutput
from worker.service.leases import Entry

TokenText = Callable[[int], str]


@dataclass(slots=True)
class Admission:
    """A request the intake took from the stream and started (``start_job`` said run)."""

    entry: Entry  # (request stream of its lane, entry id)
    request: GenerateRequest
    prior_token_ids: list[int] = field(default_factory=list)  # from the replay log
    prior_text: str = ""
    next_seq: int = 0
    # Filled off the engine loop (``prompt_pool``): the prompt's token ids, or why not.
    prompt_token_ids: list[int] | None = None
    error: Exception | None = None


@dataclass(slots=True)
class Command:
    """Control thread -> engine loop: stop a request (``cancel``: with a terminal event;
    ``lost``: silently, another worker owns it now)."""

    kind: Literal["cancel", "lost"]
    request_id: str
    reason: str = ""


@dataclass(slots=True)
class Outgoing:
    """One event to write, fenced on ``entry``; ``event``/``status`` only on terminal ones
    (non-terminal events are encoded straight from the raw fields, which is cheaper)."""

    entry: Entry
    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None = None
    event: TokenEvent | None = None
    status: JobStatus | None = None
    emitted_at: float = 0.0  # wall clock when the engine loop produced it

    @property
    def final(self) -> bool:
        return self.event is not None


def convert_logprobs(
    raw: list[tuple[float, list[tuple[int, float]]]] | None, token_ids: list[int],
    token_text: TokenText,
) -> list[dict[str, Any]] | None:
    """Engine logprobs -> the wire's ``[{token_id, logprob, token, top: [...]}]``."""
    if not raw:
        return None
    return [
        {"token_id": tid, "logprob": lp, "token": token_text(tid),
         "top": [{"token_id": t, "logprob": p, "token": token_text(t)} for t, p in top]}
        for tid, (lp, top) in zip(token_ids, raw, strict=False)
    ]


class ActiveJob:
    """One request held by this worker, from admission to its terminal event."""

    def __init__(self, admission: Admission, worker_id: str) -> None:
        self.entry = admission.entry
        self.request = admission.request
        self.request_id = admission.request.request_id
        self.worker_id = worker_id
        self.next_seq = admission.next_seq
        self.token_ids = list(admission.prior_token_ids)
        self.text_parts = [admission.prior_text] if admission.prior_text else []
        self.started_at = time.time()
        self.first_token_at: float | None = None
        self.last_token_mono: float | None = None
        self.num_prompt_tokens = 0
        timeout = admission.request.timeout_s
        self.deadline = admission.request.created_at + timeout if timeout else None
        # stream=False: events may be coalesced; we send only the terminal one.
        self._held_ids: list[int] = []
        self._held_text: list[str] = []
        self._held_lp: list[dict[str, Any]] = []

    def _record(self, out: StepOutput, logprobs: list[dict[str, Any]] | None) -> None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.token_ids.extend(out.new_token_ids)
        if out.text:
            self.text_parts.append(out.text)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens

    def step_event(self, out: StepOutput, token_text: TokenText) -> Outgoing | None:
        """The event for a non-terminal step, or None while coalescing (stream=False)."""
        logprobs = convert_logprobs(out.logprobs, out.new_token_ids, token_text)
        self._record(out, logprobs)
        if not self.request.stream:
            self._held_ids.extend(out.new_token_ids)
            self._held_text.append(out.text)
            self._held_lp.extend(logprobs or [])
            return None
        seq = self.next_seq
        self.next_seq += 1
        return Outgoing(self.entry, self.request_id, seq, list(out.new_token_ids), out.text,
                        logprobs, emitted_at=time.time())

    def final_event(
        self, reason: FinishReason, out: StepOutput | None = None, error: str | None = None,
        error_kind: ErrorKind | None = None, token_text: TokenText | None = None,
    ) -> Outgoing:
        """The terminal event (usage, timings) and the job hash's result, in one item."""
        ids: list[int] = []
        delta = ""
        logprobs: list[dict[str, Any]] = []
        if out is not None:
            lp = convert_logprobs(out.logprobs, out.new_token_ids, token_text or str)
            self._record(out, lp)
            ids, delta, logprobs = list(out.new_token_ids), out.text, lp or []
        ids = self._held_ids + ids
        delta = "".join(self._held_text) + delta
        logprobs = self._held_lp + logprobs
        now = time.time()
        created = self.request.created_at
        completion = len(self.token_ids)
        usage = Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                      total_tokens=self.num_prompt_tokens + completion)
        timings = Timings(
            queued_s=max(0.0, self.started_at - created),
            ttft_s=None if self.first_token_at is None else max(0.0, self.first_token_at - created),
            total_s=max(0.0, now - created),
        )
        event = TokenEvent(
            request_id=self.request_id, seq=self.next_seq, token_ids=ids, text=delta,
            logprobs=logprobs or None,  # type: ignore[arg-type]  # validated into models
            finish_reason=reason, error=error, error_kind=error_kind,
            usage=usage, timings=timings, worker_id=self.worker_id,
        )
        status = JobStatus(
            request_id=self.request_id, state=state_for_finish(reason),
            text="".join(self.text_parts), token_ids=self.token_ids, finish_reason=reason,
            usage=usage, timings=timings, error=error, error_kind=error_kind,
            worker_id=self.worker_id, model=self.request.model, created_at=created,
            started_at=self.started_at, finished_at=now,
        )
        seq = self.next_seq
        self.next_seq += 1
        return Outgoing(self.entry, self.request_id, seq, ids, delta, None, event, status, now)
