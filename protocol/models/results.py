"""What a worker writes back: a request's token events (with usage, timings, logprobs and
every choice), the job hash's status, and the worker's own heartbeat.
"""

from __future__ import annotations

from pydantic import Field

from protocol.models.wire import (
    ID_PATTERN,
    PROTOCOL_VERSION,
    TERMINAL_STATES,
    WIRE_ID_PATTERN,
    ErrorKind,
    FinishReason,
    JobState,
    StopReason,
    Wire,
)


class Usage(Wire):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    total_tokens: int = Field(default=0, ge=0)
    # Prompt tokens served from the prefix cache, within the request's own partition
    # (OpenAI's prompt_tokens_details.cached_tokens); None: not reported (version < 7)
    cached_tokens: int | None = Field(default=None, ge=0)


class Timings(Wire):
    """Seconds, measured by the worker: queued (created -> scheduled), to first token, total."""

    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class TopLogprob(Wire):
    token_id: int
    logprob: float
    token: str | None = None


class PromptLogprob(Wire):
    """One prompt token: its logprob given the tokens before it (None for the first)."""

    token_id: int
    logprob: float | None = None
    token: str | None = None
    top: list[TopLogprob] = Field(default_factory=list)


class TokenLogprob(Wire):
    """Logprob of one sampled token; ``token`` is its text, filled by the worker's tokenizer."""

    token_id: int
    logprob: float
    token: str | None = None
    top: list[TopLogprob] = Field(default_factory=list)


class ChoiceResult(Wire):
    """One of a request's ``n`` choices, on the terminal event and in the job hash when
    ``n > 1``. ``text``/``token_ids``/``logprobs`` are present where they were not streamed
    (``stream=False``, ``best_of``) and in the job hash."""

    index: int = Field(ge=0)
    finish_reason: FinishReason | None = None
    completion_tokens: int = Field(default=0, ge=0)
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    stop_reason: StopReason | None = None


class TokenEvent(Wire):
    """One step of output. ``seq`` counts 0, 1, 2, ... per request with no gap.

    The event with a ``finish_reason`` is the last one; it carries usage and timings. With
    ``n > 1``, each event's tokens belong to choice ``index``, the event ending a choice
    carries ``choice_finish_reason``, and the terminal one lists every choice (``choices``).
    """

    version: int = PROTOCOL_VERSION
    request_id: str = Field(pattern=WIRE_ID_PATTERN)
    seq: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    worker_id: str | None = None
    index: int = Field(default=0, ge=0)
    choice_finish_reason: FinishReason | None = None
    choices: list[ChoiceResult] | None = None
    # With finish_reason (or choice_finish_reason) "stop": the stop string or stop token id
    # that ended the request (the choice), vLLM's ``stop_reason``.
    stop_reason: StopReason | None = None
    # On a request's first event: what is known once its prompt is built and prefilled.
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_logprobs: list[PromptLogprob] | None = None  # params.prompt_logprobs
    prompt_text: str | None = None  # echo
    # On an error: OpenAI's error ``code`` (``context_length_exceeded``) and the field at
    # fault (``messages``), so the gateway answers exactly what OpenAI would.
    error_code: str | None = Field(default=None, max_length=64)
    error_param: str | None = Field(default=None, max_length=256)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


class JobStatus(Wire):
    """What the job hash holds: the state and, once finished, the whole result."""

    request_id: str = Field(pattern=WIRE_ID_PATTERN)
    state: JobState
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: StopReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    error_code: str | None = None
    error_param: str | None = None
    worker_id: str | None = None
    model: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    choices: list[ChoiceResult] | None = None  # n > 1: every choice's whole result

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES


class WorkerHeartbeat(Wire):
    """The value of a worker's heartbeat key; the key's TTL is what makes a worker 'live'."""

    version: int = PROTOCOL_VERSION
    worker_id: str = Field(pattern=ID_PATTERN)
    model: str
    started_at: float
    updated_at: float
    stats: dict[str, float | int | str] = Field(default_factory=dict)
