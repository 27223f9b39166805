"""What the worker's threads hand each other: admissions, commands, outgoing events.

``Admission`` carries a started request from the intake (with what its replay log says was
already streamed, per choice) through the prompt pool to the engine loop; ``Command`` stops
a request; ``Outgoing`` is one event for the outbox. One request's progress as the service
sees it is ``active_job.ActiveJob``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.models import GenerateRequest, JobStatus, TokenEvent
from protocol.tenants.fair import DIRECT_COST
from worker.service.affinity.chains import Prefix
from worker.service.redis.leases import Entry
from worker.service.ttft_trace import Trace

TokenText = Callable[[int], str]


@dataclass(slots=True)
class Admission:
    """A request the intake took from the stream and started (``start_job`` said run)."""

    entry: Entry  # (request stream of its lane, entry id)
    request: GenerateRequest
    # From the replay log, per choice index: tokens and text already streamed, and the
    # choices that already ended (n > 1), so a resumed request continues each one.
    prior: dict[int, list[int]] = field(default_factory=dict)
    prior_text: dict[int, str] = field(default_factory=dict)
    finished_choices: dict[int, str] = field(default_factory=dict)
    stop_reasons: dict[int, str | int] = field(default_factory=dict)  # of finished choices
    next_seq: int = 0
    charged: int = DIRECT_COST  # tokens the fair pull charged its tenant (protocol.tenants.fair)
    # Filled off the engine loop (``prompt_pool``): the prompt's token ids, or why not;
    # with ``echo`` and a prompt given as ids, its text.
    prompt_token_ids: list[int] | None = None
    error: Exception | None = None
    prompt_text: str | None = None
    trace: Trace = field(default_factory=Trace)  # where its time to first token goes
    prefix: Prefix | None = None  # its affinity chunks (affinity on), booked at admission

    @property
    def prior_token_ids(self) -> list[int]:
        """The longest unfinished choice's tokens so far (checked against ``max_tokens``)."""
        running = [ids for i, ids in self.prior.items() if i not in self.finished_choices]
        return max(running, key=len, default=[])


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
    index: int = 0  # the choice these tokens belong to (n > 1)
    choice_finish_reason: str | None = None  # set on the event that ends a choice (n > 1)
    stop_reason: str | int | None = None  # ...and the stop string / token id that did it
    # The first event's prompt fields (prompt_tokens, prompt_logprobs, prompt_text).
    prompt: dict[str, Any] | None = None
    # Terminal only: also record ``entry`` as the job's entry in the hash (a dead-lettered
    # entry claiming an id no job hash names yet, so a second entry with it is foreign).
    claim: bool = False

    @property
    def final(self) -> bool:
        return self.event is not None


def convert_prompt_logprobs(
    raw: list[tuple[int, float | None, list[tuple[int, float]]]], token_text: TokenText,
) -> list[dict[str, Any]]:
    """Engine prompt logprobs -> the wire's ``[{token_id, logprob, token, top: [...]}]``."""
    return [
        {"token_id": tid, "logprob": lp, "token": token_text(tid),
         "top": [{"token_id": t, "logprob": p, "token": token_text(t)} for t, p in top]}
        for tid, lp, top in raw
    ]


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


def replayed(entry: Entry, request: GenerateRequest, events: list[TokenEvent]) -> Admission:
    """An admission that continues what the replay log says was streamed: per choice, its
    tokens and text, and which choices already ended (n > 1)."""
    admission = Admission(entry, request, next_seq=len(events))
    for event in events:
        admission.prior.setdefault(event.index, []).extend(event.token_ids)
        if event.text:
            admission.prior_text[event.index] = \
                admission.prior_text.get(event.index, "") + event.text
        if event.choice_finish_reason is not None:
            admission.finished_choices[event.index] = event.choice_finish_reason
        if event.stop_reason is not None:
            admission.stop_reasons[event.index] = event.stop_reason
    if request.params.num_candidates == 1:
        admission.prior.setdefault(0, [])
    return admission
