"""One request's progress as the service sees it, from admission to its terminal event.

The engine knows tokens; the service also needs the wire view — event numbering that
continues across a crash (a resumed job starts at the replay log's length), the full text
for the job hash, and the terminal event's usage and timings. A request asking for ``n``
choices (or ``best_of`` candidates) has one ``ChoiceProgress`` per candidate: streamed
events carry the choice's ``index``, the event ending a choice its
``choice_finish_reason``, and the terminal event comes once every candidate has ended,
listing the choices (for ``best_of``, the ``n`` with the highest cumulative logprob, the
only ones ever sent). With ``n = 1`` a job is one candidate and its events carry no choice
fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from protocol.models import (
    ChoiceResult,
    ErrorKind,
    FinishReason,
    JobStatus,
    Timings,
    TokenEvent,
    Usage,
    state_for_finish,
)
from worker.engine import TextOutput
from worker.service.jobs import (
    Admission,
    Outgoing,
    TokenText,
    convert_logprobs,
    convert_prompt_logprobs,
)


@dataclass
class ChoiceProgress:
    """One candidate: everything it produced, what is not sent yet, how it ended."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    held_ids: list[int] = field(default_factory=list)  # not streamed yet (coalescing)
    held_text: list[str] = field(default_factory=list)
    held_lp: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token id
    cumulative_logprob: float | None = None

    def end(self, out: TextOutput) -> None:
        """The engine finished this candidate."""
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason if out.finish_reason == "stop" else None

    def add(self, out: TextOutput, lp: list[dict[str, Any]] | None, hold: bool) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.text:
            self.text_parts.append(out.text)
        self.logprobs.extend(lp or [])
        if hold:
            self.held_ids.extend(out.new_token_ids)
            self.held_text.append(out.text)
            self.held_lp.extend(lp or [])

    def take_held(self) -> tuple[list[int], str, list[dict[str, Any]]]:
        held = (self.held_ids, "".join(self.held_text), self.held_lp)
        self.held_ids, self.held_text, self.held_lp = [], [], []
        return held

    def result(self, index: int, with_content: bool) -> ChoiceResult:
        return ChoiceResult(
            index=index, finish_reason=self.finish_reason,  # type: ignore[arg-type]
            completion_tokens=len(self.token_ids),
            text="".join(self.text_parts) if with_content else None,
            token_ids=list(self.token_ids) if with_content else None,
            logprobs=(self.logprobs or None) if with_content else None,  # type: ignore[arg-type]
            cumulative_logprob=self.cumulative_logprob, stop_reason=self.stop_reason,
        )


class ActiveJob:
    """One request held by this worker, from admission to its terminal event."""

    def __init__(self, admission: Admission, worker_id: str) -> None:
        self.entry = admission.entry
        self.request = admission.request
        self.request_id = admission.request.request_id
        self.charged = admission.charged  # what the fair pull charged (worker/service/fair_ledger)
        self.worker_id = worker_id
        self.next_seq = admission.next_seq
        params = admission.request.params
        self.n = params.n
        self.ranked = params.ranks_candidates  # best_of > n: nothing is sent until the end
        self.choices = [ChoiceProgress(i) for i in range(params.num_candidates)]
        for i, ids in admission.prior.items():
            self.choices[i].token_ids = list(ids)
        for i, text in admission.prior_text.items():
            self.choices[i].text_parts = [text] if text else []
        for i, reason in admission.finished_choices.items():
            self.choices[i].finish_reason = reason
            self.choices[i].stop_reason = admission.stop_reasons.get(i)
        self.started_at = time.time()
        self.trace = admission.trace
        self.first_token_at: float | None = None
        self.last_token_mono: float | None = None
        self.num_prompt_tokens = 0
        timeout = admission.request.timeout_s
        self.deadline = admission.request.created_at + timeout if timeout else None
        # stream=False (or best_of): events are coalesced; only the terminal one is sent.
        self._hold = not self.request.stream or self.ranked
        # What the first event this worker sends carries about the prompt (prompt_tokens,
        # prompt_logprobs, prompt_text); a resumed job's first event was already sent.
        self.prompt_fields: dict[str, Any] | None = {} if admission.next_seq == 0 else None
        # On a refusal: OpenAI's error code and the field at fault, for the terminal event.
        self.error_code: str | None = None
        self.error_param: str | None = None
        # Per candidate that ended here: its prompt tokens served from the prefix cache
        self.cached_tokens: dict[int, int] = {}

    @property
    def multi(self) -> bool:
        return len(self.choices) > 1

    @property
    def done(self) -> bool:
        """Every candidate has ended (the terminal event may be sent)."""
        return all(c.finish_reason is not None for c in self.choices)

    # -- the engine's outputs ----------------------------------------------------------
    def _record(self, out: TextOutput, token_text: TokenText) -> list[dict[str, Any]] | None:
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        if out.prompt_logprobs is not None and self.prompt_fields is not None:
            self.prompt_fields["prompt_logprobs"] = convert_prompt_logprobs(
                out.prompt_logprobs, token_text)
        lp = convert_logprobs(out.logprobs, out.new_token_ids, token_text)
        if out.finished:
            self.cached_tokens[out.index] = out.num_cached_tokens
        self.choices[out.index].add(out, lp, self._hold)
        return lp

    def step_event(self, out: TextOutput, token_text: TokenText) -> Outgoing | None:
        """The event for a non-terminal step, or None while coalescing (stream=False)."""
        lp = self._record(out, token_text)
        if self._hold:
            return None
        return self._event(out.index, list(out.new_token_ids), out.text, lp)

    def choice_event(self, out: TextOutput, token_text: TokenText) -> Outgoing | None:
        """One of several candidates ended (``out.finished``); its closing event when
        streamed. The terminal event follows once ``done``."""
        self._record(out, token_text)
        choice = self.choices[out.index]
        choice.end(out)
        choice.finish_reason = out.finish_reason or "stop"
        choice.cumulative_logprob = out.cumulative_logprob
        if self._hold:
            return None
        item = self._event(out.index, list(out.new_token_ids), out.text,
                           convert_logprobs(out.logprobs, out.new_token_ids, token_text))
        item.choice_finish_reason, item.stop_reason = choice.finish_reason, choice.stop_reason
        return item

    def absorb(self, out: TextOutput) -> None:
        """Record an output without sending it (a candidate aborted with its request)."""
        self._record(out, str)
        if out.finished:
            self.choices[out.index].end(out)

    def _event(self, index: int, ids: list[int], text: str,
               lp: list[dict[str, Any]] | None) -> Outgoing:
        seq = self.next_seq
        self.next_seq += 1
        prompt = None if self.prompt_fields is None else self._take_prompt()
        return Outgoing(self.entry, self.request_id, seq, ids, text, lp,
                        emitted_at=time.time(), index=index, prompt=prompt)

    def _take_prompt(self) -> dict[str, Any] | None:
        """The prompt fields, on the first event only."""
        fields, self.prompt_fields = self.prompt_fields, None
        if fields is not None and self.num_prompt_tokens:
            fields["prompt_tokens"] = self.num_prompt_tokens
        return fields or None

    # -- the end -----------------------------------------------------------------------
    def final_event(
        self, reason: FinishReason, out: TextOutput | None = None, error: str | None = None,
        error_kind: ErrorKind | None = None, token_text: TokenText | None = None,
    ) -> Outgoing:
        """The terminal event (usage, timings) and the job hash's result, in one item."""
        ids: list[int] = []
        delta = ""
        logprobs: list[dict[str, Any]] = []
        if out is not None:
            self._record(out, token_text or str)
            self.choices[out.index].end(out)
        if not self.multi:
            ids, delta, logprobs = self.choices[0].take_held()
            if not self._hold and out is not None:  # streamed: only this step's delta
                ids, delta = list(out.new_token_ids), out.text
                logprobs = convert_logprobs(out.logprobs, out.new_token_ids,
                                            token_text or str) or []
        return self._terminal(reason, ids, delta, logprobs, error, error_kind)

    def _chosen(self) -> list[tuple[int, ChoiceProgress]]:
        """(public index, candidate): every choice, or the best ``n`` of ``best_of``."""
        if not self.ranked:
            return list(enumerate(self.choices))
        order = sorted(self.choices, key=lambda c: -(c.cumulative_logprob or float("-inf")))
        return list(enumerate(order[: self.n]))

    def _terminal(
        self, reason: FinishReason, ids: list[int], delta: str, logprobs: list[dict[str, Any]],
        error: str | None, error_kind: ErrorKind | None,
    ) -> Outgoing:
        now, created = time.time(), self.request.created_at
        completion = sum(len(c.token_ids) for c in self.choices)
        # n > 1: the prompt counts once, and so do the tokens every candidate was served
        usage = Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                      total_tokens=self.num_prompt_tokens + completion,
                      cached_tokens=min(self.cached_tokens.values(), default=0))
        timings = Timings(
            queued_s=max(0.0, self.started_at - created),
            ttft_s=None if self.first_token_at is None else max(0.0, self.first_token_at - created),
            total_s=max(0.0, now - created),
        )
        chosen = self._chosen()
        choices = [c.result(i, self._hold) for i, c in chosen] if self.multi else None
        first = chosen[0][1]
        stop_reason = first.stop_reason if reason == "stop" else None
        event = TokenEvent(
            request_id=self.request_id, seq=self.next_seq, token_ids=ids, text=delta,
            logprobs=logprobs or None,  # type: ignore[arg-type]  # validated into models
            finish_reason=reason, error=error, error_kind=error_kind,
            stop_reason=None if self.multi else stop_reason,
            usage=usage, timings=timings, worker_id=self.worker_id, choices=choices,
            error_code=self.error_code, error_param=self.error_param,
            **(self._take_prompt() or {}),
        )
        status = JobStatus(
            request_id=self.request_id, state=state_for_finish(reason),
            text="".join(first.text_parts), token_ids=first.token_ids, finish_reason=reason,
            stop_reason=stop_reason,
            usage=usage, timings=timings, error=error, error_kind=error_kind,
            error_code=self.error_code, error_param=self.error_param,
            worker_id=self.worker_id, model=self.request.model, created_at=created,
            started_at=self.started_at, finished_at=now,
            choices=[c.result(i, True) for i, c in chosen] if self.multi else None,
        )
        seq = self.next_seq
        self.next_seq += 1
        return Outgoing(self.entry, self.request_id, seq, ids, delta, None, event, status, now)

    def overall_reason(self) -> FinishReason:
        """The terminal ``finish_reason`` of a request whose choices all ended normally:
        ``length`` if any returned choice ran out of tokens, else ``stop``."""
        reasons = {c.finish_reason for _, c in self._chosen()}
        return "length" if "length" in reasons else "stop"
