"""HTTP request bodies (OpenAI-compatible, plus the jobs API) and their mapping to the protocol.

Unknown OpenAI fields are ignored, as OpenAI-compatible servers do, because SDKs and
frameworks send many harmless ones (``user``, ``metadata``, ``store``); fields whose meaning
we cannot honour (``tools``, ``functions``, ``tool_choice: "required"``, audio, ...) are
refused with 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError
from gateway.settings import GatewaySettings
from gateway.structured import StructuredFields, check_params
from protocol.codec import describe_validation_error
from protocol.models import ID_PATTERN, ChatMessage, GenerateRequest
from protocol.sampling import SamplingParams

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "min_tokens", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
)
# OpenAI chat fields that change what the answer must be, which Ferry cannot produce.
# Each maps to the values that are harmless (an empty/"none" choice means "no tools").
_UNSUPPORTED_CHAT = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "tool_choice": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIBase(StructuredFields):  # [structured output] response_format, guided_*
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    # Ferry extras
    request_id: str | None = Field(default=None, pattern=ID_PATTERN)
    timeout_s: float | None = Field(default=None, gt=0)

    def _check_choices(self, settings: GatewaySettings, best_of: int | None = None) -> None:
        """``n`` and ``best_of`` within the configured maximum; ``best_of`` (more candidates
        than choices) cannot be streamed, as OpenAI answers."""
        for name, value in (("n", self.n), ("best_of", best_of)):
            if value is not None and not 1 <= value <= settings.max_n:
                raise APIError(400, f"{name}: must be between 1 and {settings.max_n}, got "
                               f"{value}", param=name)
        if best_of is not None and best_of < self.n:
            raise APIError(400, f"best_of: must be >= n ({self.n}), got {best_of}",
                           param="best_of")
        if self.stream and best_of is not None and best_of > self.n:
            raise APIError(400, "best_of: cannot be used with stream (the best choices are "
                           "known only once every candidate has finished)", param="best_of")

    def _sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        values: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        values["max_tokens"] = max_tokens
        values["n"] = self.n
        values["best_of"] = getattr(self, "best_of", None)
        if logprobs is not None:
            values["logprobs"] = logprobs
        values["structured_output"] = self.structured_output()  # [structured output]
        try:
            return SamplingParams.model_validate(values)
        except ValidationError as exc:
            message = describe_validation_error(exc)
            raise APIError(400, message, param=_param_of(exc, message)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _param_of(exc: ValidationError, message: str) -> str | None:
    """The top-level field an error is about: its location, else the field that a model
    validator's message starts with (``"logit_bias: ..."``)."""
    loc = exc.errors()[0]["loc"]
    if loc:
        return str(loc[0])
    named = message.split(":", 1)[0]
    return named.split(".")[0] if named and " " not in named else None


def _build(**fields: Any) -> GenerateRequest:
    try:
        return GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        message = describe_validation_error(exc)
        raise APIError(400, message, param=_param_of(exc, message)) from None


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_generate_request(self, settings: GatewaySettings) -> GenerateRequest:
        self._check_choices(settings, self.best_of)
        for name, unsupported in (("echo", self.echo), ("suffix", self.suffix)):
            if unsupported:
                raise APIError(400, f"{name}: not supported", param=name)
        prompt, token_ids = _single_prompt(self.prompt)
        params = self._sampling(self.max_tokens or 16, self.logprobs)
        return _build(
            request_id=self.request_id, prompt=prompt, prompt_token_ids=token_ids, params=params,
            priority=self.priority, timeout_s=self.timeout_s, model=self.model, stream=self.stream,
        )


def _single_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(p, int) for p in prompt):
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _single_prompt(prompt[0])
    raise APIError(400, "prompt: exactly one prompt (a string or a list of token ids) is "
                   "supported per request", param="prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None

    def to_protocol(self, index: int) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages.{index}.content: only text parts are "
                                   f"supported, got {part.type!r}", param="messages")
            content = "\n".join(part.text or "" for part in content)
        return ChatMessage(role=self.role, content=content or "")


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    tool_choice: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    def _check_chat_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools: tool calling is not supported", param="tools")
        for name, harmless in _UNSUPPORTED_CHAT.items():
            if getattr(self, name) not in harmless:
                raise APIError(400, f"{name}: not supported by this server", param=name)
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "modalities: only ['text'] is supported", param="modalities")

    def to_generate_request(self, settings: GatewaySettings) -> GenerateRequest:
        self._check_choices(settings)
        self._check_chat_supported()
        default = min(settings.default_max_tokens, settings.max_tokens_limit)
        max_tokens = self.max_completion_tokens or self.max_tokens or default
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        messages = [m.to_protocol(i) for i, m in enumerate(self.messages)]
        return _build(
            request_id=self.request_id, messages=messages,
            params=self._sampling(max_tokens, logprobs), priority=self.priority,
            timeout_s=self.timeout_s, model=self.model, stream=self.stream,
        )


class JobCreate(BaseModel):
    """POST /v1/jobs: the protocol's GenerateRequest, minus what the gateway fills in."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(default=None, pattern=ID_PATTERN)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    timeout_s: float | None = Field(default=None, gt=0)
    model: str | None = Field(default=None, max_length=256)
    stream: bool = True

    def to_generate_request(self) -> GenerateRequest:
        check_params(self.params)  # [structured output] 400 if the grammar cannot compile
        return _build(**{name: getattr(self, name) for name in type(self).model_fields})

