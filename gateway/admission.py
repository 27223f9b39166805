"""Admission control: refuse what would waste or overload a GPU before it is enqueued.

Order matters for the client: a malformed or oversized request gets its 4xx even when the
queue is full, so the cheap local checks run before the Redis round-trip for the lag.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping, Sequence

import structlog
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, error_body
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import DEFAULT
from protocol.aclient import AsyncFerryClient
from protocol.cluster.shard_health import ShardDownError
from protocol.models import GenerateRequest


def check_limits(request: GenerateRequest, settings: GatewaySettings) -> None:
    """400 naming the field for a prompt or ``max_tokens`` over the configured caps."""
    params = request.params
    for name, value in (("n", params.n), ("best_of", params.best_of)):
        if value is not None and value > settings.max_n:
            raise APIError(400, f"{name}: {value} exceeds the limit of {settings.max_n}",
                           param=name)
    limit = settings.max_tokens_limit
    if request.params.max_tokens > limit:
        raise APIError(400, f"max_tokens: {request.params.max_tokens} exceeds the limit of "
                       f"{limit}", param="max_tokens")
    if request.prompt is not None and len(request.prompt) > settings.max_prompt_chars:
        raise APIError(400, f"prompt: {len(request.prompt)} characters exceed the limit of "
                       f"{settings.max_prompt_chars}", param="prompt")
    ids = request.prompt_token_ids
    if ids is not None and len(ids) > settings.max_prompt_tokens:
        raise APIError(400, f"prompt: {len(ids)} tokens exceed the limit of "
                       f"{settings.max_prompt_tokens}", param="prompt")
    if request.messages is not None:
        chars = sum(len(m.content) for m in request.messages)
        if chars > settings.max_prompt_chars:
            raise APIError(400, f"messages: {chars} characters exceed the limit of "
                           f"{settings.max_prompt_chars}", param="messages")


async def check_queue(client: AsyncFerryClient, settings: GatewaySettings,
                      requests: Sequence[GenerateRequest] = ()) -> None:
    """429 with Retry-After while more than ``max_queue_lag`` requests wait for a worker.

    On a Redis Cluster the lag is read shard by shard, each read bounded, and a shard that
    does not answer is left out and marked lost (``protocol/cluster/shard_health.py``): the others
    keep admitting, and a request whose id hashes to a lost shard gets its 503 here, at
    once, naming the shard (its master and replicas are away; nothing would serve it)."""
    limit = settings.max_queue_lag
    if limit is None:  # no read of the shards here: ask the requests' own
        lag = 0
        await client.confirm_shards([request.request_id for request in requests])
    else:
        lag = await client.queue_lag()
    for request in requests:
        try:
            client.check_shard(request.request_id)
        except ShardDownError as exc:
            raise APIError(503, f"{exc}; retry later", code="shard_unavailable",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
    if limit is not None and lag >= limit:
        raise APIError(
            429, f"queue is full: {lag} requests waiting (limit {limit})",
            headers={"Retry-After": str(settings.retry_after_s)},
        )


async def require_api_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` is a tenant's key (when keys exist);
    the tenant it names is kept on the request (``gateway.tenancy.principal``)."""
    if not request.app.state.tenants.authenticated:
        request.state.tenant = DEFAULT
        return
    tenants = await request.app.state.queue.tenants.get()  # FERRY_API_KEYS' tenants named
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    tenant = tenants.resolve(token.strip())
    if scheme.lower() != "bearer" or tenant is None:
        raise APIError(401, "authorization: missing or invalid API key",
                       param="authorization", headers={"WWW-Authenticate": "Bearer"})
    request.state.tenant = tenant
    structlog.contextvars.bind_contextvars(tenant=tenant.id)


async def require_metrics_key(request: Request) -> None:
    """``/metrics`` shows every tenant's traffic, so no tenant's key opens it. With
    ``FERRY_METRICS_KEY`` it needs ``Authorization: Bearer <metrics key>`` (401 otherwise);
    without one it is open on a gateway without keys (anyone can use that API anyway) and
    refused (403) on a gateway with keys."""
    settings: GatewaySettings = request.app.state.settings
    if settings.metrics_key is None:
        if request.app.state.tenants.authenticated:
            raise APIError(403, "metrics: this gateway has API keys, so /metrics needs "
                           "FERRY_METRICS_KEY, sent as a bearer token", param="authorization",
                           type_="permission_error", code="metrics_key_required")
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.metrics_key.encode()):
        raise APIError(401, "authorization: missing or invalid metrics key",
                       param="authorization", headers={"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: from Content-Length up front, else while reading.
    ``paths`` gives some paths their own limit (``/v1/files`` takes whole files).

    Pure ASGI (not BaseHTTPMiddleware) so it neither buffers nor breaks SSE responses.
    """

    def __init__(self, app: ASGIApp, max_bytes: int,
                 paths: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.max_bytes)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode(errors="replace")
        if declared.isdigit() and int(declared) > limit:
            await self._reject(send, limit)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException passes FastAPI's body parsing untouched -> handler.
                    raise HTTPException(413, self._message(limit))
            return message

        await self.app(scope, limited_receive, send)

    def _message(self, limit: int) -> str:
        return f"body: request body exceeds the limit of {limit} bytes"

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps(error_body(self._message(limit), "invalid_request_error", "body",
                                     "request_too_large"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})
