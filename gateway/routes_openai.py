"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from gateway.admission import require_api_key
from gateway.engine import ClientGone, Engine, Generation
from gateway.errors import APIError, unavailable
from gateway.openai_format import Formatter, failure
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.sse import DONE, PING, EventStreamResponse, sse
from protocol.codec import ProtocolError
from protocol.models import TokenEvent
from protocol.streaming import StreamTimeout

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


@router.post("/completions")
async def completions(
    body: CompletionRequest, http: Request, engine: Engine = Depends(get_engine)
) -> Response:
    return await _serve(body, http, engine, chat=False)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, http: Request, engine: Engine = Depends(get_engine)
) -> Response:
    return await _serve(body, http, engine, chat=True)


@router.get("/models")
async def models(engine: Engine = Depends(get_engine)) -> dict[str, Any]:
    """Models that live workers advertise in their heartbeats."""
    workers = await engine.client.live_workers()
    names = sorted({w.model for w in workers})
    started = {w.model: int(min(x.started_at for x in workers if x.model == w.model))
               for w in workers}
    data = [{"id": name, "object": "model", "created": started[name], "owned_by": "ferry"}
            for name in names]
    return {"object": "list", "data": data}


async def _serve(
    body: CompletionRequest | ChatCompletionRequest, http: Request, engine: Engine, chat: bool
) -> Response:
    received_at = time.time()
    request = body.to_generate_request(engine.settings)
    await engine.admit(request)
    generation = await engine.start(request, received_at)
    fmt = Formatter(request.request_id, request.model or engine.settings.served_model_name, chat)
    if body.stream:
        return EventStreamResponse(
            _stream(generation, fmt, body.include_usage), on_close=generation.close
        )
    try:
        events = await generation.collect(http)
    except StreamTimeout as exc:
        raise APIError(504, str(exc)) from None
    except ClientGone:
        return Response(status_code=499)
    finally:
        await generation.close()
    error = failure(events[-1])
    if error is not None:
        raise error
    return JSONResponse(fmt.response(events))


async def _stream(
    generation: Generation, fmt: Formatter, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE chunks in OpenAI's format, one write per wake-up carrying every event that was
    ready by then; errors become an error chunk, then ``[DONE]``."""
    keepalive = generation.engine.settings.keepalive_s
    if fmt.chat:
        yield sse(fmt.chunk(None, first=True))
    try:
        while not generation.finished:
            events = await generation.next(keepalive)
            yield _frames(fmt, events, include_usage) if events else PING
    except StreamTimeout as exc:
        yield sse(APIError(504, str(exc)).body())
    except (RedisError, OSError) as exc:  # headers are sent: report in-band
        yield sse(unavailable(exc, generation.engine.settings.retry_after_s).body())
    except ProtocolError as exc:
        yield sse(APIError(502, f"bad message from the queue: {exc}").body())
    yield DONE


def _frames(fmt: Formatter, events: list[TokenEvent], include_usage: bool) -> bytes:
    """The SSE messages of a batch of events, as one write."""
    parts = []
    for event in events:
        if event.text or event.logprobs:
            parts.append(fmt.text_frame(event.text) if event.logprobs is None
                         else sse(fmt.chunk(event)))
        if event.finish_reason is None:
            continue
        error = failure(event)
        if error is not None:
            parts.append(sse(error.body()))
            break
        parts.append(sse(fmt.chunk(None, finish_reason=event.finish_reason)))
        if include_usage:
            parts.append(sse(fmt.usage_chunk(event.usage)))
    return b"".join(parts)
