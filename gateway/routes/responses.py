"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat path.

The body is mapped to a chat completions body (``gateway/openai_api/responses.py``) and
served like one (same admission, queue, hold before the 200); the output is reshaped
into a Response object, or streamed as Responses events
(``gateway/openai_api/responses_stream.py``). Nothing is stored, so there is no
``GET /v1/responses/{id}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from gateway.admission import require_api_key
from gateway.body import parse_json, run_sized, validate
from gateway.errors import APIError, failure, unavailable
from gateway.generations import Batch, Generations
from gateway.openai_api.format import Formatter
from gateway.openai_api.logprobs import chat_content
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.responses import ChatBody, new_id, response_body, to_chat_body
from gateway.openai_api.responses_stream import ResponsesStream
from gateway.openai_api.schemas import ChatCompletionRequest
from gateway.openai_api.tool_output import ToolStream
from gateway.queue_client import QueueClient
from gateway.routes.openai import get_queue, held_or_collected, start
from gateway.sse import PING
from protocol.codec import ProtocolError
from protocol.models import GenerateRequest
from protocol.streaming import StreamTimeout

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
Prepared = tuple[dict[str, Any], ChatBody, list[GenerateRequest], ResponseShape]


@router.post("/responses")
async def responses(http: Request, queue: QueueClient = Depends(get_queue)) -> Response:
    def prepare(raw: bytes) -> Prepared:
        settings = queue.settings
        body = parse_json(raw)
        plan = to_chat_body(body)
        messages = plan.chat["messages"]
        if len(messages) > settings.max_messages:
            raise APIError(400, f"input: {len(messages)} items exceed the limit of "
                           f"{settings.max_messages}", param="input")
        try:
            requests, shape = validate(ChatCompletionRequest, plan.chat
                                       ).to_generate_requests(settings)
        except APIError as exc:
            raise plan.translate(exc) from None
        return body, plan, requests, shape

    body, plan, requests, shape = await run_sized(await http.body(), prepare)
    try:
        model, group = await start(requests, http, queue)
        body = {**body, "model": model}
        resp_id = new_id("resp")
        got = await held_or_collected(
            group, http, shape.stream,
            lambda held: _stream(group, body, resp_id, shape, held, plan.request.logprobs))
    except APIError as exc:  # a refusal before the first byte: the Responses field
        raise plan.translate(exc) from None
    if isinstance(got, Response):
        return got
    chat = Formatter(shape.request_id, model, shape).response(got)
    return JSONResponse(response_body(chat, body, resp_id))


async def _stream(group: Generations, body: dict[str, Any], resp_id: str,
                  shape: ResponseShape, held: Batch, logprobs: bool) -> AsyncIterator[bytes]:
    events_out = ResponsesStream(body, resp_id)
    tools = ToolStream(shape.tools)
    settings = group.queue.settings
    prompt = 0
    yield events_out.opening()
    batch = held
    try:
        while True:
            out = b""
            for _, events in batch:
                for event in events:
                    prompt = event.prompt_tokens or prompt
                    if logprobs and event.logprobs:
                        events_out.add_logprobs(chat_content(event.logprobs)["content"])
                    if event.text:
                        out += events_out.feed(tools.feed(event.text))
                    if event.finish_reason is None:
                        continue
                    error = failure(event)
                    if error is not None:
                        yield out + _error(events_out, error)
                        return
                    usage = event.usage
                    cut = event.finish_reason == "length" or event.stop_reason is not None
                    out += events_out.feed(tools.finish(cut))
                    out += events_out.closing(
                        event.finish_reason, usage.prompt_tokens if usage else prompt,
                        usage.completion_tokens if usage else 0,
                        (usage.cached_tokens or 0) if usage else 0)
            if out:
                yield out
            if group.finished:
                return
            batch = await group.next(settings.keepalive_s)
            if not batch:
                yield PING
    except StreamTimeout as exc:
        yield _error(events_out, APIError(504, str(exc)))
    except (RedisError, OSError) as exc:
        yield _error(events_out, unavailable(exc, settings.retry_after_s))
    except ProtocolError as exc:
        yield _error(events_out, APIError(502, f"bad message from the queue: {exc}"))


def _error(stream: ResponsesStream, error: APIError) -> bytes:
    inner = error.body()["error"]
    return stream.event("error", code=inner.get("code") or inner.get("type"),
                         message=inner["message"], param=inner.get("param"))
