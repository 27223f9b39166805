"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

lm-evaluation-harness's default run against an OpenAI-compatible server tokenizes through
them; the shapes are vLLM's. ``/tokenize`` takes ``prompt`` (``add_special_tokens``
default true) or ``messages`` (rendered by the model's chat template exactly as for
generation; ``add_generation_prompt`` default true, ``continue_final_message``,
``add_special_tokens`` default false) and answers ``{count, max_model_len, tokens}`` (and
``token_strs`` with ``return_token_strs``); ``/detokenize`` takes ``tokens`` and answers
``{prompt}``; ``/tokenizer_info`` answers the tokenizer's config with its
``chat_template``. A worker of the model answers (``gateway/tokenizer_client.py``); the
bodies are bounded by the same caps as generation's prompts, the tenant's key is required
as on ``/v1``, and a tenant has at most ``tokenizer_max_inflight`` calls in flight.

Every input is checked before a worker is asked, each refusal a 400 naming the field:
wrong types (strict), a token id out of ``[0, 2**63)`` (a worker then checks the model's
vocabulary), text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``),
more tokens than ``max_prompt_tokens``, more characters than ``max_prompt_chars``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.admission import require_api_key
from gateway.body import parse_json, run_sized, validate
from gateway.errors import APIError
from gateway.openai_api.chat_messages import ChatMessageIn
from gateway.routes.openai import body_schema
from gateway.settings import GatewaySettings
from gateway.tenancy.principal import tenant
from gateway.tokenizer_client import TokenizerClient, reply_response
from protocol.tokenizer import TokenizerRequest, bad_token

router = APIRouter(dependencies=[Depends(require_api_key)])

_FIXED_FIELDS = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
                 "media_io_kwargs")
"""vLLM's fields that would change the template: only the served template renders."""


class TokenizeBody(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool | None = False

    def fields(self, settings: GatewaySettings) -> dict[str, Any]:
        """The wire request's fields; 400 naming the field for what cannot be run."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages",
                           param="prompt")
        extra = self.model_extra or {}
        for name in _FIXED_FIELDS:
            if extra.get(name) not in (None, {}, []):
                raise APIError(400, f"{name}: not supported (the model's own chat template "
                               "renders)", param=name)
        if self.prompt is not None and len(self.prompt) > settings.max_prompt_chars:
            raise APIError(400, f"prompt: {len(self.prompt)} characters exceed the limit "
                           f"of {settings.max_prompt_chars}", param="prompt")
        generation = self.add_generation_prompt
        if generation is None:
            generation = not self.continue_final_message
        if generation and self.continue_final_message:
            raise APIError(400, "continue_final_message: cannot be combined with "
                           "add_generation_prompt", param="continue_final_message")
        messages = None if self.messages is None else [
            m.to_protocol(i) for i, m in enumerate(self.messages)]
        return {"prompt": self.prompt, "messages": messages,
                "add_special_tokens": self.add_special_tokens,
                "add_generation_prompt": generation,
                "continue_final_message": self.continue_final_message,
                "return_token_strs": bool(self.return_token_strs)}


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(default=None, max_length=256)
    tokens: list[int]

    def fields(self, settings: GatewaySettings) -> dict[str, Any]:
        if len(self.tokens) > settings.max_prompt_tokens:
            raise APIError(400, f"tokens: {len(self.tokens)} tokens exceed the limit of "
                           f"{settings.max_prompt_tokens}", param="tokens")
        bad = bad_token(self.tokens)
        if bad is not None:
            raise APIError(400, bad, param="tokens")
        return {"tokens": self.tokens}


def get_tokenizer(request: Request) -> TokenizerClient:
    tokenizer: TokenizerClient = request.app.state.tokenizer
    return tokenizer


@router.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
async def tokenize(http: Request, tok: TokenizerClient = Depends(get_tokenizer)) -> Response:
    settings = tok.settings

    def prepare(raw: bytes) -> tuple[str | None, TokenizerRequest]:
        body = validate(TokenizeBody, parse_json(raw, settings.max_messages,
                                                 settings.max_prompt_chars))
        return body.model, tok.request("tokenize", **body.fields(settings))

    async with tok.call(tenant(http)) as call:  # 429 before the body is read
        model, request = await run_sized(await http.body(), prepare)
        return await reply_response(await tok.send(model, request, call))


@router.post("/detokenize", openapi_extra=body_schema(DetokenizeBody))
async def detokenize(http: Request, tok: TokenizerClient = Depends(get_tokenizer)) -> Response:
    def prepare(raw: bytes) -> tuple[str | None, TokenizerRequest]:
        body = validate(DetokenizeBody, parse_json(raw))
        return body.model, tok.request("detokenize", **body.fields(tok.settings))

    async with tok.call(tenant(http)) as call:
        model, request = await run_sized(await http.body(), prepare)
        return await reply_response(await tok.send(model, request, call))


@router.get("/tokenizer_info")
async def tokenizer_info(
    http: Request,
    model: str | None = Query(default=None, max_length=256,
                              description="The served model (default: the only one)."),
    tok: TokenizerClient = Depends(get_tokenizer),
) -> Response:
    async with tok.call(tenant(http)) as call:
        return await reply_response(await tok.send(model, tok.request("info"), call))
