"""What a producer sends: a generation request (its prompt as text, token ids or chat
messages, with the prompt controls checked together) and the cancel of one.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field, model_validator

from protocol.chat_template import check_template_kwargs
from protocol.models.wire import PROTOCOL_VERSION, WIRE_ID_PATTERN, Wire, new_request_id
from protocol.sampling import SamplingParams
from protocol.structured.tools import ToolCall
from protocol.tenants.cache_scope import MAX_CACHE_SALT_CHARS, check_cache_salt
from protocol.tenants.ids import TENANT_PATTERN, check_scoped
from protocol.values import first_path, out_of_int64, unencodable


class ChatMessage(Wire):
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


class GenerateRequest(Wire):
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


class Cancel(Wire):
    """Published on the control channel; workers abort the request if they hold it."""

    version: int = PROTOCOL_VERSION
    request_id: str = Field(pattern=WIRE_ID_PATTERN)
    reason: str = Field(default="cancelled by client", max_length=1024)
