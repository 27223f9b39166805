"""The messages that cross Redis, as pydantic models.

Everything a producer (gateway, any Python service) and a consumer (worker) exchange is
declared here once, so both sides validate against the same rules. Models forbid unknown
fields: a typo such as ``max_token`` from a hand-written producer in another language is
refused with the field named instead of being silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.chat_template import check_template_kwargs
from protocol.sampling import SamplingParams
from protocol.structured.tools import ToolCall
from protocol.tenants.cache_scope import MAX_CACHE_SALT_CHARS, check_cache_salt
from protocol.tenants.ids import TENANT_PATTERN, check_scoped
from protocol.values import first_path, out_of_int64, unencodable

PROTOCOL_VERSION = 7
"""Bumped on any incompatible change; decoders refuse versions they do not know. Version 2
added fields (logit_bias, structured_output, n, best_of; per-choice events), version 3 more
(prompt logprobs, echo, fit_to_context; the first event's prompt fields; error codes),
version 4 the request's ``tenant`` and tenant-scoped request ids (``protocol.tenants.ids``),
version 5 the prompt controls (chat template switches and kwargs, ``suffix``;
``truncate_prompt_tokens``, ``bad_words``, ``allowed_token_ids``) and ``stop_reason``,
version 6 tool calls (``structured_output.tools``; a chat message's ``tool_calls``,
``tool_call_id`` and ``name``), version 7 the prefix cache's partition (``cache_salt``,
``cache_scope``; ``protocol.tenants.cache_scope``), ``Usage.cached_tokens`` and the tools a call
may name (``ToolCalls.allowed``, OpenAI's ``allowed_tools``): older messages are
still read, and mean the same."""

SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, PROTOCOL_VERSION})

ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
"""Request and worker ids become part of Redis key names: only key-safe characters."""

WIRE_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,200}$"
"""A request id on the wire: a plain id, or a tenant-scoped one (``{tenant}::{id}``, up to
40 + 2 + 128 characters)."""

StopReason = str | int
"""What stopped a choice with ``finish_reason`` "stop" (vLLM's ``stop_reason``): the stop
string that matched, or the stop token id; absent for EOS, a finished grammar or length."""
FinishReason = Literal["stop", "length", "abort", "error", "timeout", "cancelled"]
JobState = Literal["queued", "running", "done", "failed", "cancelled", "timeout"]
ErrorKind = Literal["invalid_request", "internal", "unavailable"]

TERMINAL_STATES: frozenset[str] = frozenset({"done", "failed", "cancelled", "timeout"})

_STATE_FOR_FINISH: dict[str, JobState] = {
    "stop": "done",
    "length": "done",
    "abort": "failed",
    "error": "failed",
    "timeout": "timeout",
    "cancelled": "cancelled",
}


def state_for_finish(reason: FinishReason) -> JobState:
    """The job state a request ends in, given the finish reason of its terminal event."""
    return _STATE_FOR_FINISH[reason]


def new_request_id() -> str:
    return uuid.uuid4().hex


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChatMessage(_Wire):
    """One chat turn; the worker renders the list with the model's own chat template."""

    role: str = Field(min_length=1, max_length=64)
    content: str
    # tool calling (docs/tools.md): the calls an assistant turn made, the call a tool
    # turn answers, and the name of the function that answered
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: fields left out rather than null."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class GenerateRequest(_Wire):
    """A generation job, as enqueued on the requests stream."""

    version: int = PROTOCOL_VERSION
    request_id: str = Field(default_factory=new_request_id, pattern=WIRE_ID_PATTERN)
    tenant: str | None = Field(default=None, pattern=TENANT_PATTERN, description=(
        "Who the request belongs to (None: the default tenant); its request_id must then "
        "be scoped, '{tenant}::{id}' (protocol.tenants.ids)."))
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31, description="Lower runs first.")
    timeout_s: float | None = Field(
        default=None, gt=0, description="Deadline measured from created_at, queueing included."
    )
    model: str | None = Field(default=None, max_length=256)
    created_at: float = Field(default_factory=time.time, ge=0)
    stream: bool = True
    echo: bool = Field(
        default=False, description="Send the prompt's text on the first event (its "
        "``prompt_text``): for a prompt given as token ids, only the worker can decode it.")
    # How the worker builds the prompt (vLLM's names): the chat template's switches and
    # extra variables (``messages`` only), and fill-in-the-middle (``prompt`` only).
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(default=False, description=(
        "Leave the last (assistant) message open: the model continues it."))
    chat_template_kwargs: dict[str, Any] | None = None
    suffix: str | None = Field(default=None, description=(
        "The text after the completion (fill-in-the-middle; needs a model with FIM tokens)."))
    # The prefix-cache partition (protocol.tenants.cache_scope): a salt narrowing the tenant's
    # (vLLM's cache_salt), and the sharing group the gateway names (None: the tenant's).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    cache_scope: str | None = Field(default=None, pattern=TENANT_PATTERN)

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> GenerateRequest:
        given = [
            name
            for name in ("prompt", "prompt_token_ids", "messages")
            if getattr(self, name) is not None
        ]
        check_scoped(self.tenant, self.request_id)
        if len(given) != 1:
            raise ValueError(
                "prompt: exactly one of prompt, prompt_token_ids, messages is required "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.prompt_token_ids is not None and any(t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids: token ids must be >= 0")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: at least one message is required")
        self._check_prompt_controls()
        check_cache_salt(self.cache_salt)
        dumped = self.model_dump()
        too_big = first_path(dumped, out_of_int64)
        if too_big:
            raise ValueError(f"{too_big}: integer out of the 64-bit range")
        broken = first_path(dumped, unencodable)
        if broken:
            raise ValueError(f"{broken}: not valid Unicode text (a lone surrogate?)")
        if self.stream and self.params.ranks_candidates:
            raise ValueError("stream: best_of > n cannot be streamed (the best n are chosen "
                             "once every candidate has finished)")
        return self


    def _check_prompt_controls(self) -> None:
        chat = self.messages is not None
        for name in ("chat_template_kwargs", "continue_final_message"):
            if getattr(self, name) and not chat:
                raise ValueError(f"{name}: only for a request with messages")
        if not self.add_generation_prompt and not chat:
            raise ValueError("add_generation_prompt: only for a request with messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be used with "
                             "add_generation_prompt (set it to false)")
        if self.continue_final_message and self.messages and \
                self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the "
                             "assistant's")
        if self.chat_template_kwargs is not None:
            check_template_kwargs(self.chat_template_kwargs)
        if self.suffix is not None and self.prompt is None:
            raise ValueError("suffix: only for a text prompt (fill-in-the-middle)")


class Usage(_Wire):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    total_tokens: int = Field(default=0, ge=0)
    # Prompt tokens served from the prefix cache, within the request's own partition
    # (OpenAI's prompt_tokens_details.cached_tokens); None: not reported (version < 7)
    cached_tokens: int | None = Field(default=None, ge=0)


class Timings(_Wire):
    """Seconds, measured by the worker: queued (created -> scheduled), to first token, total."""

    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class TopLogprob(_Wire):
    token_id: int
    logprob: float
    token: str | None = None


class PromptLogprob(_Wire):
    """One prompt token: its logprob given the tokens before it (None for the first)."""

    token_id: int
    logprob: float | None = None
    token: str | None = None
    top: list[TopLogprob] = Field(default_factory=list)


class TokenLogprob(_Wire):
    """Logprob of one sampled token; ``token`` is its text, filled by the worker's tokenizer."""

    token_id: int
    logprob: float
    token: str | None = None
    top: list[TopLogprob] = Field(default_factory=list)


class ChoiceResult(_Wire):
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


class TokenEvent(_Wire):
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


class JobStatus(_Wire):
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


class Cancel(_Wire):
    """Published on the control channel; workers abort the request if they hold it."""

    version: int = PROTOCOL_VERSION
    request_id: str = Field(pattern=WIRE_ID_PATTERN)
    reason: str = Field(default="cancelled by client", max_length=1024)


class WorkerHeartbeat(_Wire):
    """The value of a worker's heartbeat key; the key's TTL is what makes a worker 'live'."""

    version: int = PROTOCOL_VERSION
    worker_id: str = Field(pattern=ID_PATTERN)
    model: str
    started_at: float
    updated_at: float
    stats: dict[str, float | int | str] = Field(default_factory=dict)
