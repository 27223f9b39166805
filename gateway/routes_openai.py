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
from gateway.served_models import ServedModels
from gateway.sse import DONE, PING, EventStreamResponse, sse
from protocol.codec import ProtocolError
from protocol.models import TokenEvent
from protocol.streaming import StreamTimeout

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


def get_served(request: Request) -> ServedModels:
    served: ServedModels = request.app.state.served
    return served


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
async def models(served: ServedModels = Depends(get_served)) -> dict[str, Any]:
    """The served model names: the configured one and those live workers advertise."""
    workers = await served.workers()
    started = {w.model: int(min(x.started_at for x in workers if x.model == w.model))
               for w in workers}
    data = [{"id": name, "object": "model", "created": started.get(name, 0),
             "owned_by": "ferry"} for name in await served.names()]
    return {"object": "list", "data": data}


async def _serve(
    body: CompletionRequest | ChatCompletionRequest, http: Request, engine: Engine, chat: bool
) -> Response:
    received_at = time.time()
    model = await get_served(http).resolve(body.model)
    request = body.to_generate_request(engine.settings).model_copy(update={"model": model})
    await engine.admit(request)
    generation = await engine.start(request, received_at)
    fmt = Formatter(request.request_id, model, chat, n=request.params.n)
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
    if fmt.chat:  # the role, once per choice
        yield b"".join(sse(fmt.chunk(None, first=True, index=i)) for i in range(fmt.n))
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
    """The SSE messages of a batch of events, as one write. With ``n > 1`` each event's
    tokens go to choice ``event.index``; a choice's finish chunk follows the event that
    ends it, and the terminal event closes whichever choices are still open."""
    parts = []
    for event in events:
        if event.text or event.logprobs:
            parts.append(fmt.text_frame(event.text, event.index) if event.logprobs is None
                         else sse(fmt.chunk(event, index=event.index)))
        if event.choice_finish_reason is not None:
            parts.append(fmt.finish_frame(event.index, event.choice_finish_reason))
        if event.finish_reason is None:
            continue
        error = failure(event)
        if error is not None:
            parts.append(sse(error.body()))
            break
        parts += fmt.close_open_choices(event)
        if include_usage:
            parts.append(sse(fmt.usage_chunk(event.usage)))
    return b"".join(parts)
