"""The gateway's side of the tokenizer request/reply (``protocol/tokenizer.py``): ask a
worker of the model for a tokenization, wait for its answer, map failures to HTTP errors.

The gateway has no tokenizer and no torch by design, so ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` are answered by a live worker of the model: the request goes onto the
model's list, its reply comes back on a key of its own, BLPOPed in slices shorter than
the Redis socket timeout until ``tokenizer_timeout_s``. Errors: an unknown model is a 404
(``ServedModels``), no live worker of the model a 503 with Retry-After, no answer in time
a 503 too (the request is taken back off the list, so no worker spends time on it later),
a worker's refusal its own status (400 for a bad token id) naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog

from gateway.errors import APIError
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import DEFAULT, Tenant
from protocol.aclient import AsyncFerryClient
from protocol.codec import ProtocolError
from protocol.tokenizer import (
    REQUEST_TTL_S,
    TokenizerRequest,
    decode_tokenizer_reply,
    encode_tokenizer_message,
)

log = structlog.get_logger("ferry.gateway")

_MIN_SLICE_S = 0.1


class TokenizerClient:
    def __init__(self, client: AsyncFerryClient, served: ServedModels,
                 settings: GatewaySettings) -> None:
        self.client = client
        self.served = served
        self.settings = settings

    async def ask(self, model: str | None, op: str, tenant: Tenant | None = None,
                  **fields: Any) -> dict[str, Any]:
        """The response body of ``op`` (``tokenize``, ``detokenize``, ``info``,
        ``check_lora``) on ``model`` (None: the served one; a LoRA adapter: its base
        model's tokenizer), answered by one of its workers; ``APIError`` otherwise."""
        name = (await self.served.route(model, tenant or DEFAULT)).base
        await self._require_worker(name)
        timeout = self.settings.tokenizer_timeout_s
        request = TokenizerRequest(op=op, reply_id=uuid.uuid4().hex,  # type: ignore[arg-type]
                                   deadline=time.time() + timeout, **fields)
        keys, redis = self.client.keys, self.client.redis
        queue, payload = keys.tokenizer_requests(name), encode_tokenizer_message(request)
        pipe = redis.pipeline(transaction=False)
        pipe.rpush(queue, payload)
        pipe.expire(queue, max(REQUEST_TTL_S, int(timeout) + 1))
        await pipe.execute()
        raw = await self._wait(keys.tokenizer_reply(name, request.reply_id), timeout)
        if raw is None:
            await redis.lrem(queue, 1, payload)  # taken back: nobody waits for it now
            log.warning("tokenizer_no_answer", model=name, op=op, timeout_s=timeout)
            raise APIError(503, f"model: no worker of {name!r} answered within {timeout:g}s; "
                           "retry later", param="model", headers=self._retry_after)
        try:
            reply = decode_tokenizer_reply(raw)
        except ProtocolError as exc:
            raise APIError(502, f"bad tokenizer reply from a worker: {exc}",
                           type_="server_error") from None
        if reply.status != 200 or reply.body is None:
            raise APIError(reply.status, reply.error or "the worker refused the request",
                           param=reply.param)
        return reply.body

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
