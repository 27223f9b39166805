"""The Responses API's request body (``POST /v1/responses``), strictly typed as OpenAI's.

Every field a client may send has its type here, so ``tools: 5``, ``store: "yes"`` or a
part's ``text: 5`` is a 400 naming the field (``gateway/field_errors.py``), as on the
chat route; unknown fields are ignored and logged, as there. What each known field does
(honoured, refused unless harmless, ignored) is ``ResponsesRequest.check``'s: the same
rule as ``gateway/openai_api/fields.py`` — nothing that changes the output is silently
dropped. ``gateway/openai_api/responses.py`` maps a checked body onto a chat body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gateway.errors import APIError
from protocol.sampling import MAX_LOGPROBS
from protocol.structured.tools import NAME_PATTERN

_STRICT = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (  # OpenAI's ResponseIncludable: the others ask for items Ferry never makes
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", LOGPROBS)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text", "text"]
    text: str


Text = str | list[TextPart]


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text


class ReasoningItem(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning"]


def _type_or(default: str) -> Any:
    """A discriminator reading ``type``, ``default`` where it is left out."""
    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            kind = value.get("type", default)
            return kind if isinstance(kind, str) else None
        return getattr(value, "type", None)
    return tag


Item = Annotated[Annotated[MessageItem, Tag("message")]
                 | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")],
                 Discriminator(_type_or("message"), custom_error_type="item_type",
                               custom_error_message="unknown item type (supported: "
                               "message, function_call, function_call_output, reasoning)")]


class ToolIn(BaseModel):
    """A tool; only ``function`` tools are served (``tools.<i>.type`` names the others)."""

    model_config = _STRICT
    type: str
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class AllowedTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"] = "function"
    name: str


class AllowedToolsChoice(BaseModel):
    """OpenAI's ``{"type": "allowed_tools", "mode", "tools": [{"type", "name"}]}``."""

    model_config = _STRICT
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


ObjectChoice = Annotated[Annotated[FunctionChoice, Tag("function")]
                         | Annotated[AllowedToolsChoice, Tag("allowed_tools")],
                         Discriminator(_type_or(""), custom_error_type="tool_choice_type",
                                       custom_error_message="only a function or "
                                       "allowed_tools (of function tools) may be chosen")]


class FormatText(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    name: str = "output"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# field -> why it is refused when set (to anything but null, or the harmless values below)
REFUSED = {
    "previous_response_id": "responses are not stored by this server (stateless): send "
                            "the whole conversation as input",
    "conversation": "conversations are not stored by this server (stateless)",
    "prompt": "stored prompt templates are not supported",
}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``' body; ``check`` refuses what cannot be honoured."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str | None = Field(default=None, max_length=256)
    input: str | list[Item]
    instructions: Text | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | ObjectChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not OpenAI's; the chat route's
    stream: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    context_management: list[Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    cache_salt: Any = None  # the chat route's field, checked there
    # accepted and ignored: they cannot change the text
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)  # built-in tools only (none here)
    stream_options: dict[str, Any] | None = None

    @property
    def logprobs(self) -> bool:
        """``include`` asks for the output text's logprobs."""
        return LOGPROBS in (self.include or ())

    def check(self) -> None:
        """400 naming the first field whose value asks for what this server cannot do."""
        for name, why in REFUSED.items():
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: {why}", param=name)
        if self.store:
            raise APIError(400, "store: responses are not stored by this server "
                           "(stateless); send store: false", param="store")
        if self.background:
            raise APIError(400, "background: not supported", param="background")
        if self.truncation == "auto":
            raise APIError(400, "truncation: only 'disabled' is supported (an input too long "
                           "for the context is a 400 context_length_exceeded)",
                           param="truncation")
        if self.reasoning and any(v is not None for k, v in self.reasoning.items()
                                  if not (k == "effort" and v == "none")):
            raise APIError(400, "reasoning: not supported by this server (its model does "
                           "not reason); leave it out or null", param="reasoning")
        if self.context_management:
            raise APIError(400, "context_management: not supported by this server",
                           param="context_management")
        if self.text is not None and self.text.verbosity is not None:
            raise APIError(400, "text.verbosity: not supported by this server",
                           param="text.verbosity")
        self._check_logprobs()

    def _check_logprobs(self) -> None:
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise APIError(400, f"include.{i}: unknown value {value!r} (one of: "
                               f"{', '.join(INCLUDABLE)})", param=f"include.{i}")
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be between 0 and {MAX_LOGPROBS}, got "
                           f"{top}", param="top_logprobs")
        if top and not self.logprobs:
            raise APIError(400, f"top_logprobs: requires include [{LOGPROBS!r}]",
                           param="top_logprobs")
