"""The protocol's version, its id patterns and the vocabulary every message shares (finish
reasons, job states, error kinds), with the base of every wire model.

Models forbid unknown fields: a typo such as ``max_token`` from a hand-written producer in
another language is refused with the field named instead of being silently ignored.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict

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


class Wire(BaseModel):
    """A wire message: unknown fields are refused, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
