"""HTTP request bodies (OpenAI-compatible, plus the jobs API) and their mapping to the protocol.

Types are strict, as OpenAI's are: ``max_tokens: "5"`` or ``true`` is a 400, not a 5 or a
1 (a float field still takes an integer). Fields Ferry honours are declared here; every
other known OpenAI / vLLM field is refused or ignored by ``gateway/openai_api/fields.py``, so
none that changes the output is silently dropped. A completions ``prompt`` may be a list:
each prompt becomes a request of its own (``to_generate_requests``), choice ``i`` of
prompt ``p`` is returned as index ``p * n + i``, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Any, ClassVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.body import validation_error
from gateway.errors import APIError
from gateway.openai_api.chat_messages import ChatMessageIn
from gateway.openai_api.fields import refuse_unsupported
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.structured import StructuredFields, check_params
from gateway.openai_api.tools import ToolFields
from gateway.settings import GatewaySettings
from protocol.models import ID_PATTERN, ChatMessage, GenerateRequest, new_request_id
from protocol.sampling import MAX_LOGPROBS, SamplingParams
from protocol.structured.constraint import StructuredOutput

log = structlog.get_logger("ferry.gateway")

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "ignore_eos", "min_tokens", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "prompt_logprobs",
    "truncate_prompt_tokens", "bad_words", "allowed_token_ids",
)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (guidellm sends it)


class _OpenAIBase(StructuredFields):  # [structured output] response_format, guided_*, ...
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)
    route: ClassVar[str] = "completions"

    model: str | None = Field(default=None, max_length=256)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    echo: bool = False
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
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    # vLLM's prefix-cache salt: checked as the protocol's (protocol/tenants/cache_scope.py)
    cache_salt: str | None = None
    # Ferry extras
    request_id: str | None = Field(default=None, pattern=ID_PATTERN)
    timeout_s: float | None = Field(default=None, gt=0)

    def _check_common(self, settings: GatewaySettings, best_of: int | None = None) -> None:
        """Refused fields, ``n``/``best_of`` bounds, and what cannot be streamed."""
        ignored = refuse_unsupported(self.model_extra or {}, self.route)
        if ignored:
            log.info("request_fields_ignored", fields=ignored[:20])
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
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true",
                           param="stream_options")
        _check_range("prompt_logprobs", self.prompt_logprobs)

    def _sampling(self, max_tokens: int, fit: bool, logprobs: int | None) -> SamplingParams:
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        values: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if self.stop is not None:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        values.update(max_tokens=max_tokens, fit_to_context=fit, n=self.n,
                      best_of=getattr(self, "best_of", None))
        if logprobs is not None:
            values["logprobs"] = logprobs
        values["structured_output"] = self.structured_output()  # [structured output]
        try:
            return SamplingParams.model_validate(values)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def _shape(self, chat: bool, **kw: Any) -> ResponseShape:
        options = self.stream_options or StreamOptions()
        return ResponseShape(
            chat=chat, n=self.n, stream=self.stream, include_usage=options.include_usage,
            continuous_usage=options.continuous_usage_stats,
            token_ids_as_text=bool(self.return_tokens_as_token_ids),
            prompt_logprobs=self.prompt_logprobs is not None, **kw)


def _check_range(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name}: must be between 0 and {MAX_LOGPROBS}, got {value}",
                       param=name)


def _build(**fields: Any) -> GenerateRequest:
    try:
        return GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise validation_error(exc) from None


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None  # fill-in-the-middle: the worker refuses it without FIM tokens

    def to_generate_requests(
        self, settings: GatewaySettings
    ) -> tuple[list[GenerateRequest], ResponseShape]:
        """One request per prompt, and how to shape the response."""
        self._check_common(settings, self.best_of)
        _check_range("logprobs", self.logprobs)
        prompts = _prompts(self.prompt, settings.max_prompts)
        generate = self.max_tokens != 0
        if not generate and not self.echo:
            raise APIError(400, "max_tokens: must be at least 1 (0 only with echo)",
                           param="max_tokens")
        max_tokens = self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        if not generate:
            max_tokens = 1  # generated and dropped: vLLM's echo without generation
        params = self._sampling(max_tokens, self.max_tokens is None, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params = params.model_copy(update={"prompt_logprobs": self.logprobs})
        base = self.request_id or new_request_id()
        requests = [_build(
            request_id=base if len(prompts) == 1 else f"{base}-{i}", params=params,
            prompt=p if isinstance(p, str) else None,
            prompt_token_ids=p if isinstance(p, list) else None, priority=self.priority,
            timeout_s=self.timeout_s, model=self.model, stream=self.stream,
            echo=self.echo or None, suffix=self.suffix or None, cache_salt=self.cache_salt,
        ) for i, p in enumerate(prompts)]
        # a truncated prompt's echo is what the worker kept (its prompt_text)
        kept = params.truncate_prompt_tokens is None
        shape = self._shape(False, request_id=base, echo=self.echo, generate=generate,
                            prompts=len(prompts),
                            echo_texts=[p if isinstance(p, str) and kept else None
                                        for p in prompts])
        return requests, shape


def _prompts(prompt: Any, limit: int) -> list[str | list[int]]:
    """The prompt list: a string, one list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)
    if len(prompts) > limit:
        raise APIError(400, f"prompt: {len(prompts)} prompts exceed the limit of {limit}",
                       param="prompt")
    return prompts


class ChatCompletionRequest(ToolFields, _OpenAIBase):
    route: ClassVar[str] = "chat"

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's chat template controls; add_generation_prompt left out: true, or false when
    # continuing the final message
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_generate_requests(
        self, settings: GatewaySettings
    ) -> tuple[list[GenerateRequest], ResponseShape]:
        self._check_common(settings)
        _check_range("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true",
                           param="top_logprobs")
        given = self.max_completion_tokens or self.max_tokens
        default = min(settings.default_max_tokens or settings.max_tokens_limit,
                      settings.max_tokens_limit)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling(given or default, given is None, logprobs)
        messages = [m.to_protocol(i) for i, m in enumerate(self.messages)]
        last = messages[-1]
        generation_prompt = self.add_generation_prompt
        request = _build(
            request_id=self.request_id, messages=messages, params=params,
            priority=self.priority, timeout_s=self.timeout_s, model=self.model,
            stream=self.stream, continue_final_message=self.continue_final_message,
            add_generation_prompt=not self.continue_final_message
            if generation_prompt is None else generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs or None,
            cache_salt=self.cache_salt,
        )
        echo = last.content if self.echo and last.role == "assistant" else None
        return [request], self._shape(True, request_id=request.request_id, chat_echo=echo,
                                      tools=self.tool_names())

    def structured_output(self) -> StructuredOutput | None:
        """``response_format`` and friends, with the tools on top (docs/tools.md)."""
        return self.with_tools(super().structured_output())


class JobCreate(BaseModel):
    """POST /v1/jobs: the protocol's GenerateRequest, minus what the gateway fills in."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str | None = Field(default=None, pattern=ID_PATTERN)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    timeout_s: float | None = Field(default=None, gt=0)
    model: str | None = Field(default=None, max_length=256)
    stream: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    suffix: str | None = None
    cache_salt: str | None = None

    def to_generate_request(self) -> GenerateRequest:
        check_params(self.params)  # [structured output] 400 if the grammar cannot compile
        return _build(**{name: getattr(self, name) for name in type(self).model_fields})


ENDPOINT_SCHEMAS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
"""The endpoints a Batch API line may name, and the body schema of each."""
