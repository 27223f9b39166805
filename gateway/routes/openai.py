"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models (and one
model, ``/v1/models/{id}``).

Bodies are read raw and parsed by ``gateway/body.py`` (off the event loop when large).
A streamed response does not commit its 200 at once: it holds until every request of the
exchange has sent its first event (``Generations.first``), so anything the worker knows
before the first token — the prompt's length, an out-of-vocabulary id, a grammar the
vocabulary cannot follow — is a 4xx the client's SDK can act on, not an in-band error
after a 200. The held events are the response's first chunks; nothing waits longer than
it would have (docs/operations.md measures it), and past ``stream_hold_s`` (a long queue)
the 200 goes out and a late refusal comes in-band, as an event of the stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from gateway.admission import require_api_key
from gateway.body import parse_json, run_sized, validate
from gateway.errors import APIError, failure, unavailable
from gateway.generations import Batch, Generations
from gateway.openai_api.format import Formatter
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.queue_client import ClientGone, QueueClient
from gateway.served.models import ServedModels
from gateway.sse import DONE, PING, EventStreamResponse, sse
from gateway.tenancy.principal import scoped, tenant
from gateway.tenancy.tenants import Tenant
from protocol.codec import ProtocolError
from protocol.models import GenerateRequest, TokenEvent
from protocol.streaming import StreamTimeout

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def get_queue(request: Request) -> QueueClient:
    queue: QueueClient = request.app.state.queue
    return queue


def get_served(request: Request) -> ServedModels:
    served: ServedModels = request.app.state.served
    return served


def body_schema(model: type[Any]) -> dict[str, Any]:
    """OpenAPI for a body the route parses itself (FastAPI would validate it on the loop)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


@router.post("/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(http: Request, queue: QueueClient = Depends(get_queue)) -> Response:
    def prepare(raw: bytes) -> tuple[list[GenerateRequest], ResponseShape]:
        return validate(CompletionRequest, parse_json(raw)).to_generate_requests(
            queue.settings)

    return await _serve(*await run_sized(await http.body(), prepare), http, queue)


@router.post("/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(http: Request, queue: QueueClient = Depends(get_queue)) -> Response:
    def prepare(raw: bytes) -> tuple[list[GenerateRequest], ResponseShape]:
        settings = queue.settings
        body = parse_json(raw, settings.max_messages, settings.max_prompt_chars)
        return validate(ChatCompletionRequest, body).to_generate_requests(settings)

    return await _serve(*await run_sized(await http.body(), prepare), http, queue)


@router.get("/models")
async def models(http: Request, served: ServedModels = Depends(get_served)) -> dict[str, Any]:
    """The served model names: the configured one and those live workers advertise, then
    the LoRA adapters the caller's tenant may use (its own and the fleet-wide ones its
    allowlist admits, by the names it knows them by), each with its ``parent``."""
    return {"object": "list", "data": await _model_cards(served, tenant(http))}


@router.get("/models/{model_id:path}")
async def model(model_id: str, http: Request,
                served: ServedModels = Depends(get_served)) -> dict[str, Any]:
    """One served model as ``/v1/models`` lists it (the SDK's ``models.retrieve``); 404
    ``model_not_found`` for any other id. A hub id's slash is part of the path."""
    for fresh in (False, True):
        card = next((c for c in await _model_cards(served, tenant(http), fresh)
                     if c["id"] == model_id), None)
        if card is not None:
            return card
    raise APIError(404, f"model: the model {model_id!r} does not exist", param="model",
                   code="model_not_found")


async def _model_cards(served: ServedModels, who: Tenant, fresh: bool = False
                       ) -> list[dict[str, Any]]:
    """vLLM's cards: a base model's ``root`` is its name and ``parent`` null; an
    adapter's ``parent`` is its base model and ``root`` its own name (vLLM shows the path
    there: a server's paths are no caller's business); ``owned_by`` is the caller's tenant
    for its own adapters."""
    workers = await served.workers(fresh)
    started = {w.model: int(min(x.started_at for x in workers if x.model == w.model))
               for w in workers}
    cards = [{"id": name, "object": "model", "created": started.get(name, 0),
              "owned_by": "ferry", "root": name, "parent": None}
             for name in await served.base_names()]
    adapters = await served.tenant_adapters(who, fresh)
    return cards + [{"id": name, "object": "model", "created": int(record.created),
                     "owned_by": "ferry" if record.owner is None else record.owner,
                     "root": name, "parent": record.parent}
                    for name, record in sorted(adapters.items())]


async def start(requests: list[GenerateRequest], http: Request,
                queue: QueueClient) -> tuple[str, Generations]:
    """Resolve the model, scope to the tenant, admit and enqueue: (the caller's name of the
    model, the group). The requests carry the model's key (an adapter's registry key)."""
    received_at = time.time()
    who = tenant(http)
    route = await get_served(http).route(requests[0].model, who)
    requests = scoped(who, [r.model_copy(update={"model": route.key}) for r in requests])
    await queue.admit(requests, who)
    return route.name, await Generations.start(queue, requests, received_at)


async def held_or_collected(
    group: Generations, http: Request, stream: bool,
    streamer: Callable[[Batch], AsyncIterator[bytes]],
) -> Response | list[list[TokenEvent]]:
    """A stream (once every request has said something) or every request's events;
    errors before the first byte are HTTP errors. Shared by /v1/responses."""
    queue = group.queue
    try:
        if stream:
            held = await group.first(http, queue.settings.stream_hold_s)
            for _, events in held:
                error = failure(events[-1])
                if error is not None:
                    raise error
            return EventStreamResponse(streamer(held), on_close=group.close)
        per_prompt = await group.collect(http)
    except StreamTimeout as exc:
        await group.close()
        raise APIError(504, str(exc)) from None
    except ClientGone:
        await group.close()
        return Response(status_code=499)
    except BaseException:
        await group.close()
        raise
    await group.close()
    for events in per_prompt:
        error = failure(events[-1]) if events else None
        if error is not None:
            raise error
    return per_prompt


async def _serve(requests: list[GenerateRequest], shape: ResponseShape, http: Request,
                 queue: QueueClient) -> Response:
    model, group = await start(requests, http, queue)
    fmt = Formatter(shape.request_id, model, shape)
    got = await held_or_collected(group, http, shape.stream,
                                  lambda held: _stream(group, fmt, held))
    return got if isinstance(got, Response) else JSONResponse(fmt.response(got))


async def _stream(group: Generations, fmt: Formatter, held: Batch) -> AsyncIterator[bytes]:
    """SSE chunks in OpenAI's format, one write per wake-up carrying every event that was
    ready by then (the held ones first); errors become an error chunk, then ``[DONE]``."""
    settings = group.queue.settings
    batch = held
    try:
        opening = fmt.opening()
        while True:
            out, error = _frames(fmt, batch)
            if opening:
                out, opening = opening + out, b""
            if error is not None:
                yield out + sse(error.body())
                break
            if out:
                yield out
            if group.finished:
                if fmt.shape.include_usage:
                    yield fmt.usage_chunk()
                break
            batch = await group.next(settings.keepalive_s)
            if not batch:
                yield PING
    except StreamTimeout as exc:
        yield sse(APIError(504, str(exc)).body())
    except (RedisError, OSError) as exc:  # headers are sent: report in-band
        yield sse(unavailable(exc, settings.retry_after_s).body())
    except ProtocolError as exc:
        yield sse(APIError(502, f"bad message from the queue: {exc}").body())
    yield DONE


def _frames(fmt: Formatter, batch: Batch) -> tuple[bytes, APIError | None]:
    parts = []
    for prompt, events in batch:
        out, error = fmt.frames(prompt, events)
        parts.append(out)
        if error is not None:
            return b"".join(parts), error
    return b"".join(parts), None
