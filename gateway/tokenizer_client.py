"""The gateway's side of the tokenizer request/reply (``protocol/tokenizer.py``): ask a
worker of the model for a tokenization, wait for its answer, map failures to HTTP errors.

The gateway has no tokenizer and no torch by design, so ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` are answered by a live worker of the model: the call goes onto its
tenant's list for the model (``protocol/tokenizer_queue.py``: the workers serve tenants in
turn), its reply comes back on a key of its own, BLPOPed in slices shorter than the Redis
socket timeout until ``tokenizer_timeout_s``. A tenant has at most
``tokenizer_max_inflight`` calls in flight across every gateway (``Quotas.admit_tokenizer``;
429 past it), so what Redis holds for one tenant is bounded: that many requests of at most
``MAX_REQUEST_BYTES`` each, and their replies.

Errors: a bad input is a 400 naming the field (checked before anything is sent: token ids
msgpack cannot carry, text that is not valid Unicode, a request over its size limit); an
unknown model a 404 (``ServedModels``), no live worker of the model a 503 with
Retry-After, no answer in time a 503 too (the call is taken back off its list, so no
worker spends time on it later), a worker's refusal its own status (400 for a bad token
id) naming the field. A large reply is decoded and written as JSON off the event loop.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from fastapi.responses import Response
from pydantic import ValidationError

from gateway.body import OFFLOAD_BYTES, validation_error
from gateway.errors import APIError
from gateway.metrics.prometheus import Metrics
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.quotas import Quotas
from gateway.tenancy.tenants import DEFAULT, Tenant
from protocol.aclient import AsyncFerryClient
from protocol.codec import ProtocolError
from protocol.tokenizer import (
    MAX_REQUEST_BYTES,
    REQUEST_TTL_S,
    TokenizerRequest,
    decode_tokenizer_reply,
    encode_tokenizer_message,
)
from protocol.tokenizer_queue import PUSH_LUA, TAKE_BACK_LUA, item, push_args

log = structlog.get_logger("ferry.gateway")


@dataclass(frozen=True)
class Call:
    """One tokenizer call in flight: whose (None: the gateway's own), its id (the
    reply's), when its caller stops waiting (unix time)."""

    tenant: Tenant | None
    id: str
    deadline: float

    @property
    def queue(self) -> str:
        """The tenant whose list the call waits on."""
        return (self.tenant or DEFAULT).id


_MIN_SLICE_S = 0.1
_INPUTS = ("prompt", "messages", "tokens", "lora_path")


class TokenizerClient:
    def __init__(self, client: AsyncFerryClient, served: ServedModels,
                 settings: GatewaySettings, metrics: Metrics | None = None) -> None:
        self.client = client
        self.served = served
        self.settings = settings
        self.metrics = metrics
        self.quotas = Quotas(client, settings.job_ttl_s, settings.retry_after_s)

    @staticmethod
    def request(op: str, **fields: Any) -> TokenizerRequest:
        """The wire request of ``op`` with ``fields``; 400 naming the field for an input
        it cannot carry. Its reply id and deadline are its call's (``send``)."""
        try:
            request = TokenizerRequest(op=op, reply_id="0", deadline=0.0,  # type: ignore[arg-type]
                                       **fields)
        except ValidationError as exc:
            raise validation_error(exc) from None
        return request

    @contextlib.asynccontextmanager
    async def call(self, tenant: Tenant | None) -> AsyncIterator[Call]:
        """One call of ``tenant`` in flight (``tenant`` None: the gateway's own, no quota);
        429 past the tenant's ``tokenizer_max_inflight``. A route enters it before it reads
        the body, so a refusal costs one script call, not a parse of a large body."""
        call = Call(tenant, uuid.uuid4().hex,
                    time.time() + self.settings.tokenizer_timeout_s)
        if tenant is not None:
            await self._admit(tenant, call.id, call.deadline)
        try:
            yield call
        finally:
            if tenant is not None:
                with anyio.CancelScope(shield=True):
                    await self.quotas.release_tokenizer(tenant, call.id)

    async def ask(self, model: str | None, op: str, tenant: Tenant | None = None,
                  **fields: Any) -> dict[str, Any]:
        """The response body of ``op`` (``tokenize``, ``detokenize``, ``info``,
        ``check_lora``) on ``model`` (None: the served one; a LoRA adapter: its base
        model's tokenizer), answered by one of its workers; ``APIError`` otherwise."""
        async with self.call(tenant) as call:
            return reply_body(await self.send(model, self.request(op, **fields), call))

    async def send(self, model: str | None, request: TokenizerRequest, call: Call) -> bytes:
        """``request`` answered by a worker of ``model`` as ``call``: the reply's msgpack
        bytes (200), ``APIError`` otherwise."""
        name = (await self.served.route(model, call.tenant or DEFAULT)).base
        await self._require_worker(name)
        request = request.model_copy(update={"reply_id": call.id, "deadline": call.deadline})
        payload = encode_tokenizer_message(request)
        if len(payload) > MAX_REQUEST_BYTES:
            field = next((f for f in _INPUTS if getattr(request, f) is not None), "body")
            raise APIError(400, f"{field}: {len(payload)} bytes encoded, more than a "
                           f"tokenizer request may carry ({MAX_REQUEST_BYTES})", param=field)
        return await self._call(name, request, payload, call)

    async def _admit(self, tenant: Tenant, call_id: str, deadline: float) -> None:
        try:
            await self.quotas.admit_tokenizer(tenant, call_id, deadline,
                                              self.settings.tokenizer_max_inflight)
        except APIError:
            if self.metrics is not None:
                self.metrics.rejections.labels("quota").inc()
                self.metrics.tenant_rejections.labels(tenant.id, "tokenizer_inflight").inc()
            log.info("quota_refused", tenant=tenant.id, quota="tokenizer_inflight")
            raise

    async def _call(self, name: str, request: TokenizerRequest, payload: bytes,
                    call: Call) -> bytes:
        """Push the call onto its tenant's list, wait for its reply; 503 without one."""
        keys, redis = self.client.keys, self.client.redis
        base, entry = keys.tokenizer_requests(name), item(payload)
        timeout = max(0.0, call.deadline - time.time())
        script_keys, args = push_args(base, call.queue, entry,
                                      max(REQUEST_TTL_S, int(timeout) + 1))
        await redis.eval(PUSH_LUA, len(script_keys), *script_keys, *args)  # type: ignore[misc]
        raw = None
        try:
            raw = await self._wait(keys.tokenizer_reply(name, call.id), timeout)
        finally:
            if raw is None:  # taken back (also when cancelled): nobody waits for it now,
                with anyio.CancelScope(shield=True):  # and its slot is given back
                    await redis.eval(TAKE_BACK_LUA, 2, script_keys[0],  # type: ignore[misc]
                                     script_keys[1], entry, call.queue)
        if raw is None:
            waited = self.settings.tokenizer_timeout_s
            log.warning("tokenizer_no_answer", model=name, op=request.op, timeout_s=waited)
            raise APIError(503, f"model: no worker of {name!r} answered within {waited:g}s; "
                           "retry later", param="model", headers=self._retry_after)
        return raw

    @property
    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}

    async def _require_worker(self, name: str) -> None:
        """503 unless a live worker serves ``name`` (a cached read, then a fresh one)."""
        for fresh in (False, True):
            if any(w.model == name for w in await self.served.workers(fresh)):
                return
        raise APIError(503, f"model: no live worker serves {name!r}; retry later",
                       param="model", headers=self._retry_after)

    async def _wait(self, key: str, timeout: float) -> bytes | None:
        """BLPOP ``key`` for up to ``timeout``, in slices the socket timeout allows."""
        deadline = time.monotonic() + timeout
        slice_s = max(_MIN_SLICE_S, self.settings.redis_timeout_s / 2)
        while (left := deadline - time.monotonic()) > 0:
            popped = await self.client.redis.blpop([key], timeout=max(_MIN_SLICE_S,
                                                                      min(left, slice_s)))
            if popped is not None:
                return bytes(popped[1])
        return None


async def reply_response(raw: bytes) -> Response:
    """A worker's reply as the HTTP response: decoded and written as JSON on a worker
    thread when it is large (the ids of a long text), so the event loop stays free."""
    if len(raw) <= OFFLOAD_BYTES:
        return _response(raw)
    return await anyio.to_thread.run_sync(_response, raw)


def _response(raw: bytes) -> Response:
    content = json.dumps(reply_body(raw), ensure_ascii=False, allow_nan=False,
                         separators=(",", ":")).encode()
    return Response(content, media_type="application/json")


def reply_body(raw: bytes) -> dict[str, Any]:
    """The reply's body (a 200); its refusal as an ``APIError`` with its status."""
    try:
        reply = decode_tokenizer_reply(raw)
    except ProtocolError as exc:
        raise APIError(502, f"bad tokenizer reply from a worker: {exc}",
                       type_="server_error") from None
    if reply.status != 200 or reply.body is None:
        raise APIError(reply.status, reply.error or "the worker refused the request",
                       param=reply.param)
    return reply.body
